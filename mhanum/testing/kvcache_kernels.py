"""KV-cache descriptors: named conventions of serving kernels for quantized KV caches, with
evidence.

A :class:`KVCacheKernel` says how a kernel stores K and V in a quantized cache and reads them
back, as a :class:`mhanum.kvcache.KVQuant` (papers/kvcache.md, K.0): the cache format, the
scales' granularity, how the scales are made, how the kernel divides by them, whether it
saturates, and where it applies them when it reads the cache. ``kv_cache=`` of
:func:`mhanum.testing.attention_oracle` takes a descriptor's name (its default scales) or the
:class:`~mhanum.kvcache.KVQuant` that :meth:`KVCacheKernel.kv_cache` makes with the scale a
deployment uses; the tolerance is then Theorem A.1 with Theorem K.1's entries as the operands'
errors, against the exact attention of the unquantized ``k`` and ``v``.

Only conventions that Theorem K.1 covers are listed (the operand placement: vLLM's Triton
attention; the accumulator placement, one scale per tensor: FlashInfer), each as the
:class:`~mhanum.kvcache.KVQuant` of K and, where it differs, of V (``attention_bound(kv_cache=)``
takes one for both or the pair). A convention the bounds do not model is named in
:data:`KV_CACHE_NOT_MODELLED` with the reason, rather than given a tolerance that might not hold.

>>> cache = get_kv_cache("vllm-fp8-e4m3")
>>> cache.format, cache.granularity, float(cache.scale), cache.placement
('float8_e4m3fn', 'tensor', 1.0, 'operand')
>>> get_kv_cache("vllm-fp8-e4m3", scale=0.05).scale
0.05
>>> k_cache, v_cache = get_kv_cache("vllm-fp8-e4m3", scale=0.05, v_scale=0.02)
>>> float(k_cache.scale), float(v_cache.scale)
(0.05, 0.02)
>>> tuple(c.divisor for c in get_kv_cache("vllm-fp8-dynamic"))
(200.0, 100.0)
>>> get_kv_cache("flashinfer-fp8-e4m3").placement
'accumulator'
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from mhanum._errors import InvalidArgument
from mhanum.kvcache import KVQuant

if TYPE_CHECKING:
    from mhanum._types import ArrayLike

__all__ = ["KV_CACHE_KERNELS", "KV_CACHE_NOT_MODELLED", "KVCacheKernel", "get_kv_cache"]


@dataclasses.dataclass(frozen=True)
class KVCacheKernel:
    """A named convention for a quantized KV cache.

    Attributes:
        name: the registry name (``"vllm-fp8-e4m3"``, ...).
        cache: the :class:`~mhanum.kvcache.KVQuant` that stores K (and V, unless
            ``v_cache``), with the scale the kernel uses when the deployment gives none.
        evidence: where each modelling choice was read (files and functions).
        notes: what the model assumes or leaves out.
        v_cache: V's :class:`~mhanum.kvcache.KVQuant` where it differs from K's, else
            ``None``.
    """

    name: str
    cache: KVQuant
    evidence: tuple[str, ...]
    notes: str = ""
    v_cache: KVQuant | None = None

    def kv_cache(
        self, scale: ArrayLike | None = None, v_scale: ArrayLike | None = None
    ) -> KVQuant | tuple[KVQuant, KVQuant]:
        """The convention's :class:`~mhanum.kvcache.KVQuant` (or the pair of K's and V's),
        with ``scale`` (the deployment's scale of K, and of V unless ``v_scale`` is given;
        broadcastable to the granularity's shape) in place of the default when given.

        Raises:
            InvalidArgument: for a scale that is not positive and finite (naming
                ``kv_cache.scale``).
        """
        k_cache = self.cache if scale is None else dataclasses.replace(self.cache, scale=scale)
        v_cache = self.v_cache or self.cache
        if v_scale is not None:
            v_cache = dataclasses.replace(v_cache, scale=v_scale)
        elif scale is not None and self.v_cache is None:
            v_cache = k_cache
        return k_cache if v_cache is k_cache else (k_cache, v_cache)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready description."""
        out: dict[str, Any] = {"name": self.name, "cache": _cache_dict(self.cache)}
        if self.v_cache is not None:
            out["v_cache"] = _cache_dict(self.v_cache)
        return out | {"evidence": list(self.evidence), "notes": self.notes}


def _cache_dict(c: KVQuant) -> dict[str, Any]:
    scale = None if c.scale is None else getattr(c.scale, "tolist", lambda: c.scale)()
    return {
        "format": c.format,
        "granularity": c.granularity,
        "scale": scale,
        "divisor": c.divisor,
        "scale_format": str(getattr(c.scale_format, "name", c.scale_format)),
        "dequant_format": str(getattr(c.dequant_format, "name", c.dequant_format)),
        "placement": c.placement,
        "saturate": c.saturate,
    }


_VLLM_WRITE = (
    "vllm csrc/cache_kernels.cu: reshape_and_cache_flash_kernel (and reshape_and_cache_kernel) "
    "store every key entry as fp8::scaled_convert<cache_t, scalar_t, kv_dt>(key, k_scale) and "
    "every value entry with v_scale: one float scale per tensor"
)
_VLLM_CONVERT = (
    "vllm csrc/quantization/fp8/nvidia/quant_utils.cuh: scaled_vec_conversion<uint8_t, float> "
    "(and its __nv_bfloat16 and half overloads, which convert the entry to float first): "
    "__nv_cvt_float_to_fp8(a / scale, __NV_SATFINITE, fp8_type): the quotient in float32, "
    "saturated to the largest finite code, rounded to nearest"
)
_VLLM_READ = (
    "vllm vllm/attention/ops/triton_unified_attention.py: kernel_unified_attention_2d and "
    "kernel_unified_attention_3d read K = (K_load.to(tl.float32) * tl.load(k_scale)).to(Q.dtype) "
    "and V likewise with v_scale before tl.dot, when the queries are not fp8: the operand "
    "placement, the product in float32, then rounded to the queries' type (the input format, "
    "whose rounding attention_bound adds where it is narrower than float32)"
)
_VLLM_SCALES = (
    "vllm vllm/attention/layer.py: Attention.__init__ sets _k_scale = _v_scale = 1.0 (float32 "
    "tensors) unless a checkpoint's scales are loaded (BaseKVCacheMethod, "
    "vllm/model_executor/layers/quantization/kv_cache.py; older checkpoints hold one kv_scale "
    "for both); with calculate_kv_scales the scales differ (KV_CACHE_NOT_MODELLED)"
)
_VLLM_NOTES = (
    "one scale for both K and V: the default 1.0, or a checkpoint's merged kv_scale "
    "(kv_cache(scale=...)); the division a / scale is correctly rounded (nvcc's default "
    "-prec-div) or a product by the rounded reciprocal, both covered by Theorem K.1, but not a "
    "division approximated under --use_fast_math"
)


def _vllm(name: str, fmt: str) -> KVCacheKernel:
    cache = KVQuant(
        fmt, granularity="tensor", scale=1.0, scale_format="float32", dequant_format="float32",
        placement="operand", saturate=True,
    )  # fmt: skip
    return KVCacheKernel(name, cache, (_VLLM_WRITE, _VLLM_CONVERT, _VLLM_READ, _VLLM_SCALES),
                         _VLLM_NOTES)  # fmt: skip


_VLLM_DYNAMIC = (
    "vllm vllm/attention/layer.py: Attention.calc_kv_scales (calculate_kv_scales=True): "
    "_k_scale.copy_(torch.abs(key).max() / self.k_range) and _v_scale likewise with v_range, "
    "k_range and v_range float32 tensors of K_SCALE_CONSTANT = 200 and V_SCALE_CONSTANT = 100 "
    "(vllm/envs.py): the absolute maximum over the whole tensor (exact in its type) divided in "
    "float32, once, on the first batch; then calculate_kv_scales = False and the scales stay"
)


def _vllm_dynamic() -> KVCacheKernel:
    base = _vllm("vllm-fp8-dynamic", "float8_e4m3fn")
    k_cache = dataclasses.replace(base.cache, scale=None, divisor=200.0)
    return dataclasses.replace(
        base,
        cache=k_cache,
        v_cache=dataclasses.replace(k_cache, divisor=100.0),
        evidence=(*base.evidence[:3], _VLLM_DYNAMIC),
        notes=(
            "the batch the scales are computed on (absmax / 200 for K, absmax / 100 for V, per "
            "tensor); a later batch reads the frozen scales: get_kv_cache('vllm-fp8-e4m3', "
            "scale=k_scale, v_scale=v_scale)"
        ),
    )


_FLASHINFER_READ = (
    "flashinfer flashinfer/decode.py: single_decode_with_kv_cache and "
    "BatchDecodeWithPagedKVCacheWrapper.run attend the fp8 codes of the cache; 'if k_scale is not "
    "None: sm_scale *= k_scale' folds K's scale into the softmax scale (a Python float, passed "
    "to the kernel), and 'if v_scale is not None: out *= v_scale' multiplies the kernel's output, "
    "already in its dtype, after the kernel: the accumulator placement, one scale per tensor "
    "(the scalar arguments)"
)
_FLASHINFER_NOTES = (
    "the cache written as vLLM writes it (one float scale per tensor, the quotient in float32, "
    "saturated); the product sm_scale·k_scale is charged as up to three roundings of the "
    "scores' constant, and out *= v_scale (torch's product in float32, then the output's dtype) "
    "as two roundings in the output format (papers/attention.md, step 7'')"
)


def _flashinfer(name: str, fmt: str) -> KVCacheKernel:
    base = _vllm(name, fmt)
    cache = dataclasses.replace(base.cache, placement="accumulator")
    evidence = (_VLLM_WRITE, _VLLM_CONVERT, _FLASHINFER_READ)
    return KVCacheKernel(name, cache, evidence, _FLASHINFER_NOTES)


KV_CACHE_KERNELS: Mapping[str, KVCacheKernel] = {
    k.name: k
    for k in (
        _vllm("vllm-fp8-e4m3", "float8_e4m3fn"),
        _vllm("vllm-fp8-e5m2", "float8_e5m2"),
        _vllm_dynamic(),
        _flashinfer("flashinfer-fp8-e4m3", "float8_e4m3fn"),
        _flashinfer("flashinfer-fp8-e5m2", "float8_e5m2"),
    )
}
"""The registered KV-cache conventions, by name."""

KV_CACHE_NOT_MODELLED: Mapping[str, str] = {
    "vllm-flash-attn-fp8": "vLLM's FlashAttention backend over an fp8 cache "
    "(vllm/v1/attention/backends/flash_attn.py, FlashAttentionImpl.forward: "
    "flash_attn_varlen_func with q_descale, k_descale and v_descale): the queries are "
    "quantized to fp8 too and FlashAttention-3's fp8 path runs, whose two-level accumulation "
    "is not modelled (mhanum.testing.NOT_MODELLED, 'flash-attention-3-fp8')",
}
"""KV-cache conventions without a descriptor, and why (their tolerance could not be stated as a
theorem)."""


def get_kv_cache(
    kv_cache: KVQuant | tuple[KVQuant, KVQuant] | str,
    scale: ArrayLike | None = None,
    v_scale: ArrayLike | None = None,
) -> KVQuant | tuple[KVQuant, KVQuant]:
    """The :class:`~mhanum.kvcache.KVQuant` of a registered convention, or the pair of K's and
    V's where they differ (``scale``: the deployment's scale of K, and of V unless ``v_scale``
    is given, in place of the default), or ``kv_cache`` itself when it is one or a pair.

    Raises:
        InvalidArgument: for an unknown name (naming the conventions that exist, and why a known
            but unmodelled one has none), or a ``scale`` with a :class:`KVQuant`.
    """
    given = kv_cache if isinstance(kv_cache, tuple) else (kv_cache,)
    if all(isinstance(c, KVQuant) for c in given) and len(given) in (1, 2):
        if scale is not None or v_scale is not None:
            msg = f"scale: expected None with a KVQuant (it states its own), got {scale!r}"
            raise InvalidArgument(msg)
        return kv_cache  # type: ignore[return-value]
    if isinstance(kv_cache, str) and kv_cache in KV_CACHE_KERNELS:
        return KV_CACHE_KERNELS[kv_cache].kv_cache(scale, v_scale)
    why = ""
    if isinstance(kv_cache, str) and kv_cache in KV_CACHE_NOT_MODELLED:
        why = f" ({kv_cache} is not modelled: {KV_CACHE_NOT_MODELLED[kv_cache]})"
    msg = (
        f"kv_cache: expected a mhanum.kvcache.KVQuant, a pair of them (k's, v's) or one of "
        f"{', '.join(KV_CACHE_KERNELS)}, got {kv_cache!r}{why}"
    )
    raise InvalidArgument(msg)
