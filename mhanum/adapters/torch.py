"""PyTorch: ``torch.nn.MultiheadAttention`` with mhanum's weights, masks and numerics model.

Three code paths of ``MultiheadAttention.forward`` compute different things (torch 2.13,
``torch/nn/modules/activation.py`` ``MultiheadAttention.forward`` and
``torch/nn/functional.py`` ``multi_head_attention_forward``):

* ``"explicit"`` (``need_weights=True``, the default, fast path off): ``q·sqrt(1/D)`` *before*
  ``baddbmm(attn_mask, q, kᵀ)``, where a boolean mask became ``0/-inf`` and is *added*; softmax in
  float32 (max shift, Sleef ``exp``, one reciprocal of the sum then a product); a fully-masked row is
  NaN.
* ``"sdpa"`` (``need_weights=False``): ``F.scaled_dot_product_attention``, on the CPU its fused
  flash kernel (``aten/src/ATen/native/cpu/FlashAttentionKernel.cpp``): the scale on ``q kᵀ``,
  the ``0/-inf`` mask added, an online softmax over key blocks of 512 whose ``exp`` is
  ``Vectorized::exp_u20`` (documented "ULP=20"), a fully-masked row is 0, so the layer returns
  the output bias.
* ``"fast"`` (eval mode, no grad, ``batch_first``, the same tensor as query, key and value, an
  even number of heads, a boolean mask): ``torch._native_multi_head_attention``, which adds the
  bias and multiplies q by ``1/sqrt(D)`` in one pass (``transform_bias_rescale_qkv``), then a
  masked softmax; a fully-masked row is NaN.

Masks: **a boolean ``attn_mask`` True means masked out** (the opposite of mhanum, jax.nn, Keras,
Flax and ``F.scaled_dot_product_attention``); ``key_padding_mask`` True is a padded (masked) key.
:func:`run` translates an mhanum mask (True = attend). Weights: ``in_proj_weight`` (3E, E) is
``[Wqᵀ; Wkᵀ; Wvᵀ]`` (``y = x Wᵀ + b``), ``in_proj_bias`` ``[bq; bk; bv]``, ``out_proj.weight`` is
``Woᵀ``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from mhanum import masks
from mhanum._errors import InvalidArgument
from mhanum.adapters import _common as C
from mhanum.gradients import Gradients, MHAGradients
from mhanum.numerics import Numerics
from mhanum.params import MHAParams

if TYPE_CHECKING:
    from mhanum._types import ArrayLike

__all__ = [
    "MASK_FORMS",
    "PATHS",
    "SDPA_BACKENDS",
    "effective_mask",
    "extract",
    "load",
    "mha_grad",
    "model",
    "numerics",
    "run",
    "sdpa",
    "sdpa_grad",
    "sdpa_model",
    "version",
]

PATHS = ("explicit", "sdpa", "fast")
SDPA_BACKENDS = ("flash", "math")
MASK_FORMS = ("bool", "float", "key_padding")

_SOURCE = {
    "explicit": "torch/nn/functional.py: multi_head_attention_forward (need_weights branch), "
    "aten/src/ATen/native/cpu/SoftMaxKernel.cpp: _vec_softmax_lastdim",
    "sdpa": "torch/nn/functional.py: multi_head_attention_forward (SDPA branch), "
    "aten/src/ATen/native/cpu/FlashAttentionKernel.cpp: cpu_flash_attention",
    "fast": "torch/nn/modules/activation.py: MultiheadAttention.forward (fast path), "
    "aten/src/ATen/native/transformers/attention.cpp: native_multi_head_attention_cpu",
}


def version() -> str:
    """The installed torch version."""
    return str(torch.__version__)


def load(
    params: MHAParams, num_heads: int, *, batch_first: bool = True
) -> torch.nn.MultiheadAttention:
    """A float32 ``torch.nn.MultiheadAttention`` in eval mode holding exactly ``params``.

    Args:
        params: the weights (rounded to float32), with all four biases and ``d_q = d_kv``.
        num_heads: number of heads.
        batch_first: the layer's ``batch_first`` (:func:`run` handles both layouts).

    Raises:
        InvalidArgument: for parameters the layer cannot hold.
    """
    p = C.float32_params(params, num_heads)
    if p.d_q != p.d_kv or p.d_q != p.qk_width or p.d_out != p.qk_width:
        msg = (
            "params: expected d_q = d_kv = H*d_k = d_out for torch.nn.MultiheadAttention, got "
            f"{p.d_q}, {p.d_kv}, {p.qk_width}, {p.d_out}"
        )
        raise InvalidArgument(msg)
    layer = torch.nn.MultiheadAttention(
        p.qk_width, num_heads, batch_first=batch_first, dtype=torch.float32
    )
    with torch.no_grad():
        layer.in_proj_weight.copy_(torch.from_numpy(np.concatenate([p.wq.T, p.wk.T, p.wv.T])))
        layer.in_proj_bias.copy_(torch.from_numpy(np.concatenate([p.bq, p.bk, p.bv])))
        layer.out_proj.weight.copy_(torch.from_numpy(np.ascontiguousarray(p.wo.T)))
        layer.out_proj.bias.copy_(torch.from_numpy(p.bo))
    return layer.eval()


def extract(layer: torch.nn.MultiheadAttention) -> MHAParams:
    """The weights of a ``torch.nn.MultiheadAttention`` (packed in-projection) as ``MHAParams``."""
    if layer.in_proj_weight is None or layer.in_proj_bias is None:
        msg = "layer: expected a packed in_proj_weight with biases, got separate projections"
        raise InvalidArgument(msg)
    w = layer.in_proj_weight.detach().cpu().numpy().astype(np.float64)
    b = layer.in_proj_bias.detach().cpu().numpy().astype(np.float64)
    wq, wk, wv = (m.T.copy() for m in np.split(w, 3))
    bq, bk, bv = np.split(b, 3)
    wo = layer.out_proj.weight.detach().cpu().numpy().astype(np.float64).T.copy()
    bo = layer.out_proj.bias.detach().cpu().numpy().astype(np.float64)
    return MHAParams(wq, wk, wv, wo, bq, bk, bv, bo)


def numerics(path: str = "explicit", *, tf32: bool = False) -> Numerics:
    """The mhanum :class:`~mhanum.Numerics` of a float32 path (see the module docstring).

    Args:
        path: ``"explicit"``, ``"sdpa"`` or ``"fast"``.
        tf32: matmuls with TF32 operands (CUDA with
            ``torch.backends.cuda.matmul.allow_tf32 = True``; off by default since torch 1.12).
    """
    C.check_path(path, PATHS)
    common: dict[str, Any] = {
        "input": "float32",
        "accum": "float32",
        "mask_mode": "add",
        "mask_value": -math.inf,
        "div_ulps": 2.0,  # one reciprocal of the sum, then a product
        "operand_format": "tf32" if tf32 else None,
    }
    if path == "sdpa":
        return Numerics(scale="scores", softmax="online(512)", exp_ulps=20.0, **common)
    return Numerics(scale="q", **common)


def model(path: str = "explicit", *, tf32: bool = False) -> C.PathModel:
    """The :class:`~mhanum.adapters.PathModel` of a path."""
    notes = {
        "explicit": "bool attn_mask True = masked out; float masks are added as they are",
        "sdpa": "online softmax over blocks of 512 keys; exp_u20 (<= 20 ulps)",
        "fast": "taken only for self-attention (query is key is value), eval, no grad",
    }[C.check_path(path, PATHS)]
    return C.PathModel(
        "torch",
        path,
        numerics(path, tf32=tf32),
        "zero" if path == "sdpa" else "nan",
        _SOURCE[path],
        notes,
    )


def effective_mask(
    raw_mask: torch.Tensor | ArrayLike,
    path: str = "explicit",
    *,
    form: str = "bool",
    num_heads: int = 1,
) -> np.ndarray:
    """The keys a torch mask attends, in mhanum's convention (True = attend).

    A boolean ``attn_mask`` or ``key_padding_mask`` attends where it is False; a float mask where
    it is finite (``-inf`` entries exclude, finite entries are added as a bias). A 3-D
    ``attn_mask`` ``(B*H, Lq, Lk)`` gives ``(B, Lq, Lk)`` (head 0 of each batch entry).
    """
    C.check_path(path, PATHS)
    arr = raw_mask.detach().cpu().numpy() if isinstance(raw_mask, torch.Tensor) else raw_mask
    arr = np.asarray(arr)
    out = ~arr if arr.dtype == np.bool_ else np.isfinite(arr)
    if form == "key_padding":
        return out[:, None, :]
    return out[::num_heads] if out.ndim == 3 else out


@contextlib.contextmanager
def _fastpath(enabled: bool) -> Iterator[None]:
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(enabled)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(before)


def _translate(mask: np.ndarray, form: str, num_heads: int) -> dict[str, Any]:
    """mhanum ``(B, Lq, Lk)`` mask -> the keyword arguments of ``MultiheadAttention.forward``."""
    if form == "key_padding":
        if not np.all(mask == mask[:, :1, :]):
            msg = "mask: expected the same keys masked for every query with key_padding, got others"
            raise InvalidArgument(msg)
        return {"key_padding_mask": torch.from_numpy(~mask[:, 0, :])}
    per_head = np.repeat(mask, num_heads, axis=0)  # (B*H, Lq, Lk), batch-major as torch wants
    if form == "bool":
        return {"attn_mask": torch.from_numpy(~per_head)}
    bias = np.where(per_head, 0.0, -np.inf).astype(np.float32)
    return {"attn_mask": torch.from_numpy(bias)}


def run(
    layer: torch.nn.MultiheadAttention,
    x_q: ArrayLike,
    x_kv: ArrayLike,
    mask: ArrayLike | None = None,
    *,
    path: str = "explicit",
    mask_form: str = "bool",
    raw_mask: torch.Tensor | ArrayLike | None = None,
) -> np.ndarray:
    """Run ``layer`` on float32 inputs, on the chosen code path, and return numpy float32.

    Args:
        layer: a ``torch.nn.MultiheadAttention`` (e.g. from :func:`load`).
        x_q: ``(B, Lq, E)`` or ``(Lq, E)``.
        x_kv: ``(B, Lk, E)`` or ``(Lk, E)``; for ``path="fast"`` it must be ``x_q`` itself.
        mask: mhanum mask (True = attend) broadcastable to ``(B, Lq, Lk)``, translated into
            ``mask_form``: ``"bool"`` (``attn_mask``, True = masked out), ``"float"``
            (``attn_mask`` of ``0``/``-inf``) or ``"key_padding"`` (``key_padding_mask``; the
            mask must not depend on the query).
        path: ``"explicit"`` (``need_weights=True``), ``"sdpa"`` (``need_weights=False``) or
            ``"fast"`` (the native fast path, checked to be taken).
        mask_form: see ``mask``.
        raw_mask: an ``attn_mask`` passed to torch untranslated (instead of ``mask``).

    Returns:
        ``(B, Lq, E)`` (or ``(Lq, E)``) float32.

    Raises:
        InvalidArgument: for shapes that do not fit, an unknown path or form, both ``mask`` and
            ``raw_mask``, or a fast path whose conditions do not hold.
    """
    C.check_path(path, PATHS)
    C.check_path(mask_form, MASK_FORMS, "mask_form")
    if mask is not None and raw_mask is not None:
        msg = "raw_mask: expected None when mask is given, got both"
        raise InvalidArgument(msg)
    width = layer.embed_dim
    q = C.batched(x_q, "x_q", width)
    kv = q if x_kv is x_q else C.batched(x_kv, "x_kv", width)
    kwargs: dict[str, Any] = {}
    m = C.mask3(mask, q.shape[0], q.shape[1], kv.shape[1])
    if m is not None:
        kwargs = _translate(m, mask_form, layer.num_heads)
    elif raw_mask is not None:
        kwargs = {"attn_mask": torch.as_tensor(raw_mask)}
    tq = torch.from_numpy(q)
    tkv = tq if kv is q else torch.from_numpy(kv)
    if not layer.batch_first:
        tq, tkv = tq.transpose(0, 1), (tq.transpose(0, 1) if kv is q else tkv.transpose(0, 1))
    if path == "fast":
        _check_fast(layer, kv is q, kwargs)
    with torch.no_grad(), _fastpath(path == "fast"):
        out = layer(tq, tkv, tkv, need_weights=path != "sdpa", **kwargs)[0]
    if not layer.batch_first:
        out = out.transpose(0, 1)
    return C.unbatch(out.numpy(), x_q)


def mha_grad(
    layer: torch.nn.MultiheadAttention,
    x_q: ArrayLike,
    x_kv: ArrayLike,
    d_out: ArrayLike,
    mask: ArrayLike | None = None,
    *,
    path: str = "explicit",
) -> MHAGradients:
    """The gradients of ``<d_out, layer(x_q, x_kv, x_kv)>`` by torch autograd, in the layout of
    :func:`mhanum.mha_grad`.

    ``x_q`` and ``x_kv`` are separate leaf tensors, and the key and the value are the same
    tensor, so ``multi_head_attention_forward`` projects the key and the value with one packed
    linear over ``[wk; wv]``, whose backward is one product ``[dK dV] [wk wv]ᵀ`` (mhanum's
    ``dx_kv``). For self-attention, the input's gradient is ``dx_q + dx_kv``.

    Args:
        layer: a float32 ``torch.nn.MultiheadAttention`` with packed in-projection and biases
            (e.g. from :func:`load`), in eval mode.
        x_q, x_kv, mask: as for :func:`run` (a boolean mask, **True = attend**).
        d_out: the output's cotangent, shaped like the output.
        path: ``"explicit"`` (``need_weights=True``: ``q·sqrt(1/D)``, then ``q kᵀ``; with a
            head size a power of 4 the scaling is exact and the path computes what scale on the
            scores does) or ``"sdpa"`` (``need_weights=False``); the fast path takes no
            gradient.

    Returns:
        :class:`mhanum.gradients.MHAGradients` of float64 arrays holding the float32
        gradients exactly; ``params`` in the ``y = x w + b`` convention (``wq`` is
        ``in_proj_weight.grad[:E]ᵀ``, ``wo`` is ``out_proj.weight.gradᵀ``) and ``dbias = None``.

    Raises:
        InvalidArgument: for shapes that do not fit, the fast path or an unknown path, or a
            layer without packed in-projection biases.
    """
    C.check_path(path, PATHS)
    if path == "fast":
        msg = "path: expected 'explicit' or 'sdpa' (the fast path takes no gradient), got 'fast'"
        raise InvalidArgument(msg)
    extract(layer)  # a packed in-projection with biases
    width = layer.embed_dim
    q = C.batched(x_q, "x_q", width)
    kv = C.batched(x_kv, "x_kv", width)
    g = C.batched(d_out, "d_out", width)
    if g.shape != q.shape:
        msg = f"d_out: expected the output's shape {q.shape}, got {g.shape}"
        raise InvalidArgument(msg)
    kwargs: dict[str, Any] = {}
    m = C.mask3(mask, q.shape[0], q.shape[1], kv.shape[1])
    if m is not None:
        kwargs = _translate(m, "bool", layer.num_heads)
    tq = torch.from_numpy(np.array(q)).requires_grad_(True)
    tkv = torch.from_numpy(np.array(kv)).requires_grad_(True)
    a, b = tq, tkv
    if not layer.batch_first:
        a, b = tq.transpose(0, 1), tkv.transpose(0, 1)
    layer.zero_grad(set_to_none=True)
    with _fastpath(False):
        out = layer(a, b, b, need_weights=path == "explicit", **kwargs)[0]
    if not layer.batch_first:
        out = out.transpose(0, 1)
    out.backward(torch.from_numpy(np.array(g)))

    def grad(t: torch.Tensor) -> np.ndarray:
        assert t.grad is not None
        return np.asarray(t.grad.double().numpy())

    w_in, b_in = np.split(grad(layer.in_proj_weight), 3), np.split(grad(layer.in_proj_bias), 3)
    grads = MHAParams(
        wq=w_in[0].T.copy(),
        wk=w_in[1].T.copy(),
        wv=w_in[2].T.copy(),
        wo=grad(layer.out_proj.weight).T.copy(),
        bq=b_in[0],
        bk=b_in[1],
        bv=b_in[2],
        bo=grad(layer.out_proj.bias),
    )
    return MHAGradients(C.unbatch(grad(tq), x_q), C.unbatch(grad(tkv), x_kv), grads, None)


def _check_fast(
    layer: torch.nn.MultiheadAttention, self_attention: bool, kwargs: dict[str, Any]
) -> None:
    reasons = []
    if not self_attention:
        reasons.append("x_kv is not x_q")
    if layer.training:
        reasons.append("the layer is in training mode")
    if not layer.batch_first:
        reasons.append("batch_first is False")
    if layer.num_heads % 2:
        reasons.append("num_heads is odd")
    if any(torch.is_floating_point(v) for v in kwargs.values()):
        reasons.append("the mask is a float mask")
    if reasons:
        msg = f"path: expected the conditions of torch's fast path, got {'; '.join(reasons)}"
        raise InvalidArgument(msg)


def sdpa_model(backend: str = "flash", *, tf32: bool = False) -> C.PathModel:
    """The :class:`~mhanum.adapters.PathModel` of ``F.scaled_dot_product_attention`` on the CPU.

    ``"flash"`` is the fused CPU kernel (what SDPA picks for float32 on the CPU); ``"math"`` is
    ``_scaled_dot_product_attention_math``: q and k each times ``sqrt(scale)``, the mask added,
    ``_safe_softmax`` (a fully-masked row is 0).
    """
    C.check_path(backend, SDPA_BACKENDS, "backend")
    if backend == "flash":
        return dataclasses.replace(model("sdpa", tf32=tf32), path="sdpa-flash")
    num = numerics("explicit", tf32=tf32).replace(scale="qk")
    source = "aten/src/ATen/native/transformers/attention.cpp: _scaled_dot_product_attention_math"
    return C.PathModel("torch", "sdpa-math", num, "zero", source, "bool mask True = attend")


def sdpa(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    mask: masks.Band | ArrayLike | None = None,
    *,
    backend: str = "flash",
    scale: float | None = None,
    dtype: str = "float32",
    is_causal: bool = False,
    enable_gqa: bool = False,
) -> np.ndarray:
    """``F.scaled_dot_product_attention`` on numpy inputs with one chosen CPU backend.

    Args:
        q: ``(..., Lq, D)``; k: ``(..., Lk, D)``; v: ``(..., Lk, Dv)`` (rounded to ``dtype``).
        mask: boolean, **True = attend** (SDPA's own convention: passed as it is), or a
            :class:`mhanum.masks.Band`: ``masks.causal()`` as ``is_causal=True``, any other
            band as its boolean array.
        backend: ``"flash"`` or ``"math"`` (forced with ``torch.nn.attention.sdpa_kernel``).
        scale: the logit scale (default ``1/sqrt(D)``).
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``: the tensors' dtype.
        is_causal: SDPA's ``is_causal`` (query ``i`` attends keys ``j <= i``).
        enable_gqa: SDPA's ``enable_gqa`` (k and v with fewer heads than q, axis -3).

    Returns:
        ``(..., Lq, Dv)`` float32 holding the ``dtype`` outputs exactly; a fully-masked row is 0.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    C.check_path(backend, SDPA_BACKENDS, "backend")
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in dtypes:
        msg = f"dtype: expected one of {tuple(dtypes)}, got {dtype!r}"
        raise InvalidArgument(msg)
    chosen = SDPBackend.FLASH_ATTENTION if backend == "flash" else SDPBackend.MATH
    arrays = [np.asarray(a, np.float32) for a in (q, k, v)]
    if enable_gqa:
        shape = np.broadcast_shapes(*(a.shape[:-3] for a in arrays))
        full = [np.broadcast_to(a, (*shape, *a.shape[-3:])) for a in arrays]
    else:
        shape = np.broadcast_shapes(*(a.shape[:-2] for a in arrays))
        full = [np.broadcast_to(a, (*shape, *a.shape[-2:])) for a in arrays]
    # The fused kernels take (B, H, L, D) only: batch dimensions become a 4-D layout.
    tq, tk, tv = (torch.from_numpy(np.array(_four_d(a))).to(dtypes[dtype]) for a in full)
    tm = None
    if isinstance(mask, masks.Band) and mask == masks.causal() and not is_causal:
        mask, is_causal = None, True  # SDPA's own structure, as a user's call passes it
    mask = masks.resolve(mask, tq.shape[-2], tk.shape[-2])
    if mask is not None:
        lead = full[0].shape[:-2]
        m = np.broadcast_to(np.asarray(mask, bool), (*lead, tq.shape[-2], tk.shape[-2]))
        tm = torch.from_numpy(np.array(_four_d(m)))
    with torch.no_grad(), sdpa_kernel([chosen]):
        out = torch.nn.functional.scaled_dot_product_attention(
            tq, tk, tv, attn_mask=tm, scale=scale, is_causal=is_causal, enable_gqa=enable_gqa
        )
    return out.float().numpy().reshape(*full[0].shape[:-2], *out.shape[-2:])


def sdpa_grad(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    d_out: ArrayLike,
    mask: ArrayLike | None = None,
    *,
    backend: str = "math",
    scale: float | None = None,
    dtype: str = "float32",
    enable_gqa: bool = False,
) -> Gradients:
    """The gradients of ``<d_out, F.scaled_dot_product_attention(q, k, v)>`` by torch autograd.

    Args:
        q, k, v, mask, backend, scale, dtype: as for :func:`sdpa` (a boolean mask, **True =
            attend**, or ``None``).
        d_out: the output's cotangent, rounded to ``dtype``.
        enable_gqa: SDPA's ``enable_gqa``: ``k`` and ``v`` with fewer heads than ``q`` (axis
            -3, a divisor of ``q``'s); query head ``h`` reads key/value head ``h // (H / H_kv)``,
            and ``dk``, ``dv`` are those of the grouped ``k``, ``v`` (autograd sums the group's).

    Returns:
        :class:`mhanum.gradients.Gradients` of float64 arrays holding the ``dtype`` gradients
        exactly: ``dq``, ``dk``, ``dv`` (broadcast to the batch) and ``dbias = None`` (SDPA
        takes no bias gradient here).
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    C.check_path(backend, SDPA_BACKENDS, "backend")
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in dtypes:
        msg = f"dtype: expected one of {tuple(dtypes)}, got {dtype!r}"
        raise InvalidArgument(msg)
    chosen = SDPBackend.FLASH_ATTENTION if backend == "flash" else SDPBackend.MATH
    arrays = [np.asarray(a, np.float32) for a in (q, k, v, d_out)]
    lead = 3 if enable_gqa else 2  # with grouped heads, the head axis keeps its own size
    shape = np.broadcast_shapes(*(a.shape[:-lead] for a in arrays))
    full = [np.broadcast_to(a, (*shape, *a.shape[-lead:])) for a in arrays]
    tq, tk, tv, tg = (torch.from_numpy(np.array(_four_d(a))).to(dtypes[dtype]) for a in full)
    for t in (tq, tk, tv):
        t.requires_grad_(True)
    tm = None
    if mask is not None:
        m = np.broadcast_to(np.asarray(mask, bool), (*full[0].shape[:-1], full[1].shape[-2]))
        tm = torch.from_numpy(np.array(_four_d(m)))
    with sdpa_kernel([chosen]):
        out = torch.nn.functional.scaled_dot_product_attention(
            tq, tk, tv, attn_mask=tm, scale=scale, enable_gqa=enable_gqa
        )
        out.backward(tg)
    grads = []
    for t, a in zip((tq, tk, tv), full[:3], strict=True):
        assert t.grad is not None
        grads.append(t.grad.double().numpy().reshape(a.shape))
    return Gradients(grads[0], grads[1], grads[2], None)


def _four_d(a: np.ndarray) -> np.ndarray:
    """``(..., L, D)`` as ``(B, H, L, D)``: leading dimensions merged into B, or 1s prepended."""
    if a.ndim <= 4:
        return a.reshape((1,) * (4 - a.ndim) + a.shape)
    return a.reshape(-1, *a.shape[-3:])
