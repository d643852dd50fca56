"""Flax NNX ``flax.nnx.MultiHeadAttention`` with mhanum's weights, masks and numerics model.

Code paths (flax 0.12, ``flax/nnx/nn/attention.py`` ``dot_product_attention``):

* ``"fused"`` (dropout 0 and attention weights not sown, the default): it calls
  ``jax.nn.dot_product_attention`` (the ``xla`` implementation on the CPU,
  ``jax/_src/nn/functions.py`` ``_dot_product_attention_core``): the scale on the logits, masked
  logits **replaced** by ``-0.7 * finfo(float32).max`` and the softmax in float32, even for float64
  inputs. The layer's ``precision`` argument is not passed on. A fully-masked row is uniform.
* ``"explicit"`` (``sow_weights=True``, or dropout): ``dot_product_attention_weights``:
  ``q / sqrt(depth)`` *before* the einsum, masked logits **replaced** by ``finfo(dtype).min``,
  ``jax.nn.softmax`` in the compute dtype. A fully-masked row is uniform.

The mask is ``(batch, heads, Lq, Lk)``, **True = attend**. Weights: ``LinearGeneral`` kernels
query/key/value ``(E, H, D)`` = ``W.reshape(E, H, D)``, biases ``(H, D)``; out ``(H, D, E)``,
bias ``(E,)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import flax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mhanum._errors import InvalidArgument
from mhanum.adapters import _common as C
from mhanum.numerics import Numerics
from mhanum.params import MHAParams

if TYPE_CHECKING:
    import jax

    from mhanum._types import ArrayLike

__all__ = ["PATHS", "effective_mask", "extract", "load", "model", "numerics", "run", "version"]

PATHS = ("fused", "explicit")

_SOURCE = {
    "fused": "flax/nnx/nn/attention.py: dot_product_attention (jax.nn branch); "
    "jax/_src/nn/functions.py: _dot_product_attention_core, _get_large_negative",
    "explicit": "flax/nnx/nn/attention.py: dot_product_attention_weights",
}


def version() -> str:
    """The installed flax version."""
    return str(flax.__version__)


def load(params: MHAParams, num_heads: int) -> nnx.MultiHeadAttention:
    """A float32 ``nnx.MultiHeadAttention`` holding exactly ``params``.

    Raises:
        InvalidArgument: for parameters the layer cannot hold.
    """
    p = C.float32_params(params, num_heads)
    d = p.qk_width // num_heads
    layer: Any = nnx.MultiHeadAttention(
        num_heads=num_heads,
        in_features=p.d_q,
        qkv_features=p.qk_width,
        out_features=p.d_out,
        decode=False,
        rngs=nnx.Rngs(0),
    )
    if p.d_q != p.d_kv:
        msg = f"params.wk: expected d_kv = d_q = {p.d_q} for nnx.MultiHeadAttention, got {p.d_kv}"
        raise InvalidArgument(msg)
    weights: Any = ((layer.query, p.wq, p.bq), (layer.key, p.wk, p.bk), (layer.value, p.wv, p.bv))
    for dense, w, b in weights:
        _set(dense.kernel, w.reshape(w.shape[0], num_heads, d))
        _set(dense.bias, b.reshape(num_heads, d))
    _set(layer.out.kernel, p.wo.reshape(num_heads, d, p.d_out))
    _set(layer.out.bias, np.asarray(p.bo))
    return layer


def _set(variable: nnx.Variable, value: np.ndarray) -> None:
    """Assign a parameter (``set_value`` from flax 0.12 on, ``.value`` before)."""
    if hasattr(variable, "set_value"):
        variable.set_value(jnp.asarray(value))
    else:
        variable.value = jnp.asarray(value)


def _get(variable: Any) -> np.ndarray:
    """A parameter's value as float64 numpy."""
    value = variable.get_value() if hasattr(variable, "get_value") else variable.value
    return np.asarray(value, np.float64)


def extract(layer: nnx.MultiHeadAttention) -> MHAParams:
    """The weights of an ``nnx.MultiHeadAttention`` as ``MHAParams`` (float64)."""

    qk, kk, vk = (_get(m.kernel) for m in (layer.query, layer.key, layer.value))
    qb, kb, vb = (_get(m.bias).reshape(-1) for m in (layer.query, layer.key, layer.value))
    ok = _get(layer.out.kernel)
    return MHAParams(
        qk.reshape(qk.shape[0], -1),
        kk.reshape(kk.shape[0], -1),
        vk.reshape(vk.shape[0], -1),
        ok.reshape(-1, ok.shape[-1]),
        qb,
        kb,
        vb,
        _get(layer.out.bias),
    )


def numerics(path: str = "fused", *, precision: str = "default") -> Numerics:
    """The mhanum :class:`~mhanum.Numerics` of a float32 path.

    Args:
        path: ``"fused"`` or ``"explicit"``.
        precision: JAX's default matmul precision on the device: ``"default"`` (float32 on CPU),
            ``"tf32"`` (NVIDIA Ampere+ default) or ``"bf16"`` (one bfloat16 pass, TPU default).
    """
    C.check_path(path, PATHS)
    dot: dict[str, dict[str, Any]] = {
        "default": {},
        "tf32": {"operand_format": "tf32"},
        "bf16": {"dot": "bf16x1"},
    }
    if precision not in dot:
        msg = f"precision: expected one of {tuple(dot)}, got {precision!r}"
        raise InvalidArgument(msg)
    common: dict[str, Any] = {"input": "float32", "accum": "float32", **dot[precision]}
    if path == "fused":
        return Numerics(scale="scores", mask_mode="fill", mask_value="0.7*finfo.min", **common)
    return Numerics(scale="q", mask_mode="fill", mask_value="finfo.min", **common)


def model(path: str = "fused", *, precision: str = "default") -> C.PathModel:
    """The :class:`~mhanum.adapters.PathModel` of a path."""
    notes = {
        "fused": "jax.nn.dot_product_attention: softmax always float32; precision= not passed",
        "explicit": "q / sqrt(depth) is modelled as a product by 1/sqrt(depth) (the same value "
        "when depth is a power of 4)",
    }[C.check_path(path, PATHS)]
    return C.PathModel(
        "flax", path, numerics(path, precision=precision), "uniform", _SOURCE[path], notes
    )


def effective_mask(raw_mask: ArrayLike, path: str = "fused") -> np.ndarray:
    """The keys a raw Flax mask attends (True = attend; it is cast to bool)."""
    C.check_path(path, PATHS)
    return np.asarray(raw_mask).astype(bool)


def run(
    layer: nnx.MultiHeadAttention,
    x_q: ArrayLike,
    x_kv: ArrayLike,
    mask: ArrayLike | None = None,
    *,
    path: str = "fused",
    raw_mask: jax.Array | None = None,
) -> np.ndarray:
    """Run ``layer`` (deterministic) on float32 inputs on the chosen path; numpy float32 out.

    Args:
        layer: an ``nnx.MultiHeadAttention`` (e.g. from :func:`load`).
        x_q: ``(B, Lq, E)`` or ``(Lq, E)``.
        x_kv: ``(B, Lk, E)`` or ``(Lk, E)``.
        mask: mhanum mask (True = attend) broadcastable to ``(B, Lq, Lk)``.
        path: ``"fused"`` or ``"explicit"`` (``sow_weights=True``).
        raw_mask: a mask passed untranslated, broadcastable to ``(B, H, Lq, Lk)``.

    Raises:
        InvalidArgument: for shapes that do not fit, an unknown path, or both masks.
    """
    C.check_path(path, PATHS)
    if mask is not None and raw_mask is not None:
        msg = "raw_mask: expected None when mask is given, got both"
        raise InvalidArgument(msg)
    width = _get(layer.query.kernel).shape[0]
    q = C.batched(x_q, "x_q", width)
    kv = C.batched(x_kv, "x_kv", width)
    m = C.mask3(mask, q.shape[0], q.shape[1], kv.shape[1])
    given = jnp.asarray(m[:, None]) if m is not None else raw_mask
    args = (jnp.asarray(q), jnp.asarray(kv))
    if path == "fused":
        out = layer(*args, mask=given, deterministic=True)
    elif hasattr(nnx, "capture"):  # flax >= 0.12: sowing only inside nnx.capture
        out = nnx.capture(layer, nnx.Intermediate)(
            *args, mask=given, deterministic=True, sow_weights=True
        )[0]
    else:
        out = layer(*args, mask=given, deterministic=True, sow_weights=True)
    return C.unbatch(np.asarray(out), x_q)
