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

Only conventions that Theorem K.1 with the operand placement covers are listed, for one
:class:`~mhanum.kvcache.KVQuant` that stores both K and V (as ``attention_bound(kv_cache=)``
takes it). A convention the bounds do not model is named in :data:`KV_CACHE_NOT_MODELLED` with
the reason, rather than given a tolerance that might not hold.

>>> cache = get_kv_cache("vllm-fp8-e4m3")
>>> cache.format, cache.granularity, float(cache.scale), cache.placement
('float8_e4m3fn', 'tensor', 1.0, 'operand')
>>> get_kv_cache("vllm-fp8-e4m3", scale=0.05).scale
0.05
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
        cache: the :class:`~mhanum.kvcache.KVQuant` that stores both K and V, with the scale the
            kernel uses when the deployment gives none.
        evidence: where each modelling choice was read (files and functions).
        notes: what the model assumes or leaves out.
    """

    name: str
    cache: KVQuant
    evidence: tuple[str, ...]
    notes: str = ""

    def kv_cache(self, scale: ArrayLike | None = None) -> KVQuant:
        """The convention's :class:`~mhanum.kvcache.KVQuant`, with ``scale`` (the deployment's
        scale of both K and V, broadcastable to the granularity's shape) in place of the
        default when given.

        Raises:
            InvalidArgument: for a scale that is not positive and finite (naming
                ``kv_cache.scale``).
        """
        if scale is None:
            return self.cache
        return dataclasses.replace(self.cache, scale=scale)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready description."""
        c = self.cache
        scale = None if c.scale is None else getattr(c.scale, "tolist", lambda: c.scale)()
        return {
            "name": self.name,
            "cache": {
                "format": c.format,
                "granularity": c.granularity,
                "scale": scale,
                "divisor": c.divisor,
                "scale_format": str(getattr(c.scale_format, "name", c.scale_format)),
                "dequant_format": str(getattr(c.dequant_format, "name", c.dequant_format)),
                "placement": c.placement,
                "saturate": c.saturate,
            },
            "evidence": list(self.evidence),
            "notes": self.notes,
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


KV_CACHE_KERNELS: Mapping[str, KVCacheKernel] = {
    k.name: k
    for k in (
        _vllm("vllm-fp8-e4m3", "float8_e4m3fn"),
        _vllm("vllm-fp8-e5m2", "float8_e5m2"),
    )
}
"""The registered KV-cache conventions, by name."""

KV_CACHE_NOT_MODELLED: Mapping[str, str] = {
    "flashinfer-fp8": "FlashInfer's fp8 cache (flashinfer/decode.py: single_decode_with_kv_cache "
    "and BatchDecodeWithPagedKVCacheWrapper.run): the kernel "
    "attends the fp8 codes, k_scale folded into the softmax scale (sm_scale *= k_scale, passed "
    "to the kernel as a float) and v_scale applied to the output (out *= v_scale after the "
    "kernel, or passed to it as a scale of its output): "
    "the accumulator placement, whose products by the scales are extra roundings of the "
    "logits and of the output that Theorem A.1 does not take yet (attention_bound refuses "
    "KVQuant(placement='accumulator'))",
    "vllm-fp8-dynamic": "vLLM's calculate_kv_scales (vllm/attention/layer.py, "
    "Attention.calc_kv_scales): k_scale = max|k| / K_SCALE_CONSTANT and v_scale = max|v| / "
    "V_SCALE_CONSTANT (200 and 100 by default, vllm/envs.py), computed once in float32 and "
    "then frozen: the keys' and the values' divisors differ, and attention_bound(kv_cache=) "
    "takes one KVQuant for both",
    "vllm-flash-attn-fp8": "vLLM's FlashAttention backend over an fp8 cache "
    "(vllm/v1/attention/backends/flash_attn.py, FlashAttentionImpl.forward: "
    "flash_attn_varlen_func with q_descale, k_descale and v_descale): the queries are "
    "quantized to fp8 too and FlashAttention-3's fp8 path runs, whose two-level accumulation "
    "is not modelled (mhanum.testing.NOT_MODELLED, 'flash-attention-3-fp8')",
}
"""KV-cache conventions without a descriptor, and why (their tolerance could not be stated as a
theorem)."""


def get_kv_cache(kv_cache: KVQuant | str, scale: ArrayLike | None = None) -> KVQuant:
    """The :class:`~mhanum.kvcache.KVQuant` of a registered convention (``scale``: the
    deployment's, in place of the default), or ``kv_cache`` itself when it is one.

    Raises:
        InvalidArgument: for an unknown name (naming the conventions that exist, and why a known
            but unmodelled one has none), or a ``scale`` with a :class:`KVQuant`.
    """
    if isinstance(kv_cache, KVQuant):
        if scale is not None:
            msg = f"scale: expected None with a KVQuant (it states its own), got {scale!r}"
            raise InvalidArgument(msg)
        return kv_cache
    if isinstance(kv_cache, str) and kv_cache in KV_CACHE_KERNELS:
        return KV_CACHE_KERNELS[kv_cache].kv_cache(scale)
    known = isinstance(kv_cache, str) and kv_cache in KV_CACHE_NOT_MODELLED
    why = f" ({kv_cache} is not modelled: {KV_CACHE_NOT_MODELLED[kv_cache]})" if known else ""
    msg = (
        f"kv_cache: expected a mhanum.kvcache.KVQuant or one of {', '.join(KV_CACHE_KERNELS)}, "
        f"got {kv_cache!r}{why}"
    )
    raise InvalidArgument(msg)
