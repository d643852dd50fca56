"""``jax.nn.dot_product_attention`` inside a multi-head layer built from mhanum's weights.

The layer projects with ``x @ w + b`` in float32 (``jax.numpy``), splits heads into the
``(B, T, N, H)`` layout ``jax.nn.dot_product_attention`` wants, and projects the output. The
``xla`` implementation (jax 0.10, ``jax/_src/nn/functions.py`` ``_dot_product_attention_core``)
scales the logits after the einsum, **replaces** masked logits by ``-0.7 * finfo(dtype).max``
(capped at float32's range, ``_get_large_negative``), and runs the softmax in float32 even for
float64 inputs. The mask is boolean only, **True = attend**; a fully-masked row is uniform.
The ``cudnn`` implementation (GPUs) is not modelled here (see ``mhanum.devices``).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from mhanum import masks
from mhanum._errors import InvalidArgument
from mhanum.adapters import _common as C
from mhanum.gradients import Gradients
from mhanum.numerics import Numerics
from mhanum.params import MHAParams

if TYPE_CHECKING:
    from jax.typing import ArrayLike as JaxArrayLike

    from mhanum._types import ArrayLike

__all__ = [
    "PATHS",
    "JaxLayer",
    "effective_mask",
    "extract",
    "load",
    "model",
    "numerics",
    "run",
    "sdpa",
    "sdpa_grad",
    "version",
]

PATHS = ("xla",)

_SOURCE = "jax/_src/nn/functions.py: dot_product_attention, _dot_product_attention_core"


@dataclasses.dataclass(frozen=True)
class JaxLayer:
    """float32 weights and a head count: the state of a ``jax.nn`` multi-head layer."""

    params: MHAParams
    num_heads: int


def version() -> str:
    """The installed jax version."""
    return str(jax.__version__)


def load(params: MHAParams, num_heads: int) -> JaxLayer:
    """A :class:`JaxLayer` holding ``params`` rounded to float32."""
    return JaxLayer(C.float32_params(params, num_heads), int(num_heads))


def extract(layer: JaxLayer) -> MHAParams:
    """The layer's weights (float64 copies)."""
    fields = dataclasses.fields(layer.params)
    return MHAParams(*(np.asarray(getattr(layer.params, f.name), np.float64) for f in fields))


def numerics(path: str = "xla", *, precision: str = "default") -> Numerics:
    """The mhanum :class:`~mhanum.Numerics` of ``jax.nn.dot_product_attention`` in float32.

    Args:
        path: ``"xla"``.
        precision: ``"default"`` (float32 on CPU), ``"tf32"`` (NVIDIA Ampere+ default) or
            ``"bf16"`` (one bfloat16 pass, the TPU default).
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
    return Numerics(
        input="float32",
        accum="float32",
        scale="scores",
        mask_mode="fill",
        mask_value="0.7*finfo.min",
        **dot[precision],
    )


def model(path: str = "xla", *, precision: str = "default") -> C.PathModel:
    """The :class:`~mhanum.adapters.PathModel` of the ``xla`` implementation."""
    return C.PathModel(
        "jax",
        path,
        numerics(path, precision=precision),
        "uniform",
        _SOURCE,
        "bool mask only; softmax in float32 even for float64 inputs",
    )


def effective_mask(raw_mask: ArrayLike, path: str = "xla") -> np.ndarray:
    """A ``jax.nn`` mask attends where it is True."""
    C.check_path(path, PATHS)
    arr = np.asarray(raw_mask)
    if arr.dtype != np.bool_:
        msg = f"raw_mask: expected a boolean mask (jax.nn takes no other), got {arr.dtype}"
        raise InvalidArgument(msg)
    return arr


def _heads(x: jax.Array, n: int) -> jax.Array:
    return x.reshape(*x.shape[:-1], n, x.shape[-1] // n)


def run(
    layer: JaxLayer,
    x_q: ArrayLike,
    x_kv: ArrayLike,
    mask: ArrayLike | None = None,
    *,
    path: str = "xla",
    raw_mask: JaxArrayLike | None = None,
) -> np.ndarray:
    """Run the layer with ``jax.nn.dot_product_attention(implementation=path)``; numpy float32.

    Args:
        layer: a :class:`JaxLayer` (from :func:`load`).
        x_q: ``(B, Lq, E)`` or ``(Lq, E)``.
        x_kv: ``(B, Lk, E)`` or ``(Lk, E)``.
        mask: mhanum mask (True = attend) broadcastable to ``(B, Lq, Lk)``.
        path: ``"xla"``.
        raw_mask: a boolean mask passed untranslated, broadcastable to ``(B, H, Lq, Lk)``.

    Raises:
        InvalidArgument: for shapes that do not fit, an unknown path, or both masks.
    """
    C.check_path(path, PATHS)
    if mask is not None and raw_mask is not None:
        msg = "raw_mask: expected None when mask is given, got both"
        raise InvalidArgument(msg)
    p, n = layer.params, layer.num_heads
    q_in = C.batched(x_q, "x_q", p.d_q)
    kv_in = C.batched(x_kv, "x_kv", p.d_kv)
    m = C.mask3(mask, q_in.shape[0], q_in.shape[1], kv_in.shape[1])
    given = jnp.asarray(m[:, None]) if m is not None else raw_mask
    out = _forward(q_in, kv_in, p, given, n, path)
    return C.unbatch(np.asarray(out), x_q)


def _forward(
    x_q: np.ndarray,
    x_kv: np.ndarray,
    p: Any,
    mask: JaxArrayLike | None,
    n: int,
    implementation: Any,
) -> jax.Array:
    q = _heads(jnp.asarray(x_q) @ p.wq + p.bq, n)
    k = _heads(jnp.asarray(x_kv) @ p.wk + p.bk, n)
    v = _heads(jnp.asarray(x_kv) @ p.wv + p.bv, n)
    o = jax.nn.dot_product_attention(q, k, v, mask=mask, implementation=implementation)
    return o.reshape(*o.shape[:-2], -1) @ p.wo + p.bo


_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def sdpa(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    mask: masks.Band | ArrayLike | None = None,
    *,
    scale: float | None = None,
    dtype: str = "float32",
) -> np.ndarray:
    """``jax.nn.dot_product_attention(implementation="xla")`` on numpy ``(..., L, d)`` inputs.

    A :class:`mhanum.masks.Band` on the main diagonal (``offset = 0``) is passed as jax's own
    structure, ``is_causal=True`` for :func:`mhanum.masks.causal` and ``local_window_size`` for
    a window (so jax builds it, as a user's call would); any other band, and a boolean array
    (True = attend), is passed as ``mask``. The heads move to jax's ``(B, T, N, H)`` layout.
    Where k and v carry fewer heads (axis -3) than q, jax computes grouped-query attention
    itself: query head ``h`` reads key/value head ``h // (H / H_kv)``.

    Args:
        q: ``(..., Lq, d)``; k: ``(..., Lk, d)``; v: ``(..., Lk, d_v)`` (rounded to ``dtype``);
            for grouped-query attention ``q`` ``(..., H, Lq, d)`` and k, v ``(..., H_kv, Lk, d)``.
        mask: a boolean array broadcastable to ``(..., Lq, Lk)`` or a ``Band``.
        scale: the logit scale (default ``1/sqrt(d)``).
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``.

    Returns:
        ``(..., Lq, d_v)`` float32 holding the ``dtype`` outputs exactly.

    Raises:
        InvalidArgument: for an unknown ``dtype`` or a mask that is neither.
    """
    if dtype not in _DTYPES:
        msg = f"dtype: expected one of {tuple(_DTYPES)}, got {dtype!r}"
        raise InvalidArgument(msg)
    arrays = [np.asarray(a, np.float64) for a in (q, k, v)]
    grouped = min(a.ndim for a in arrays) >= 3 and arrays[1].shape[-3] != arrays[0].shape[-3]
    if grouped:
        h, h_kv = arrays[0].shape[-3], arrays[1].shape[-3]
        if arrays[2].shape[-3] != h_kv or h % h_kv:
            msg = f"k: expected a number of key/value heads dividing q's {h}, got {h_kv}"
            raise InvalidArgument(msg)
        lead = np.broadcast_shapes(*(a.shape[:-3] for a in arrays))
        full = [
            np.broadcast_to(a, (*lead, *a.shape[-3:])).reshape(-1, *a.shape[-3:]) for a in arrays
        ]
        # (B, N, L, d) as jax's (B, T, N, H)
        jq, jk, jv = (jnp.asarray(np.swapaxes(a, 1, 2), _DTYPES[dtype]) for a in full)
        lead = (*lead, h)
    else:
        lead = np.broadcast_shapes(*(a.shape[:-2] for a in arrays))
        full = [
            np.broadcast_to(a, (*lead, *a.shape[-2:])).reshape(-1, *a.shape[-2:]) for a in arrays
        ]
        # (B, L, d) as jax's (B, T, N, H) with one head per batch element
        jq, jk, jv = (jnp.asarray(a[:, :, None, :], _DTYPES[dtype]) for a in full)
    lq, lk = full[0].shape[-2], full[1].shape[-2]
    kwargs: dict[str, Any] = {}
    if isinstance(mask, masks.Band) and mask.offset == 0:
        if mask.left is None and mask.right == 0:
            kwargs["is_causal"] = True
        else:
            big = max(lq, lk)  # jax takes integers: an unbounded side is the whole row
            left = big if mask.left is None else mask.left
            right = big if mask.right is None else mask.right
            kwargs["local_window_size"] = (left, right)
    elif mask is not None:
        m = np.asarray(masks.resolve(mask, lq, lk))
        if m.dtype != np.bool_:
            msg = f"mask: expected a boolean array (True = attend) or a Band, got dtype {m.dtype}"
            raise InvalidArgument(msg)
        heads = lead[-1] if grouped else 1
        m = np.broadcast_to(m, (*lead, lq, lk)).reshape(-1, heads, lq, lk)
        kwargs["mask"] = jnp.asarray(m)
    out = jax.nn.dot_product_attention(jq, jk, jv, scale=scale, implementation="xla", **kwargs)
    out = np.asarray(out.astype(jnp.float32))  # (B, T, N, H)
    return np.swapaxes(out, 1, 2).reshape(*lead, lq, np.shape(v)[-1])


def sdpa_grad(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    d_out: ArrayLike,
    mask: ArrayLike | None = None,
    *,
    scale: float | None = None,
    dtype: str = "float32",
) -> Gradients:
    """The gradients of ``<d_out, jax.nn.dot_product_attention(q, k, v)>`` by ``jax.vjp``
    (``implementation="xla"``) on numpy ``(..., L, d)`` inputs.

    Args:
        q, k, v, scale, dtype: as for :func:`sdpa`; ``mask`` a boolean array (**True =
            attend**) or ``None``.
        d_out: the output's cotangent, rounded to ``dtype``.

    Returns:
        :class:`mhanum.gradients.Gradients` of float64 arrays holding the ``dtype`` gradients
        exactly: ``dq``, ``dk``, ``dv`` (broadcast to the batch), ``dbias = None``.

    Raises:
        InvalidArgument: for an unknown ``dtype``.
    """
    if dtype not in _DTYPES:
        msg = f"dtype: expected one of {tuple(_DTYPES)}, got {dtype!r}"
        raise InvalidArgument(msg)
    arrays = [np.asarray(a, np.float64) for a in (q, k, v, d_out)]
    lead = np.broadcast_shapes(*(a.shape[:-2] for a in arrays))
    full = [np.broadcast_to(a, (*lead, *a.shape[-2:])).reshape(-1, *a.shape[-2:]) for a in arrays]
    jq, jk, jv, jg = (jnp.asarray(a[:, :, None, :], _DTYPES[dtype]) for a in full)
    lq, lk = full[0].shape[-2], full[1].shape[-2]
    kwargs: dict[str, Any] = {}
    if mask is not None:
        m = np.broadcast_to(np.asarray(mask, bool), (*lead, lq, lk)).reshape(-1, 1, lq, lk)
        kwargs["mask"] = jnp.asarray(m)

    def f(a: jax.Array, b: jax.Array, c: jax.Array) -> jax.Array:
        return jax.nn.dot_product_attention(a, b, c, scale=scale, implementation="xla", **kwargs)

    _, vjp = jax.vjp(f, jq, jk, jv)
    grads = vjp(jg)
    shapes = [(*lead, *a.shape[-2:]) for a in full[:3]]
    out = [
        np.asarray(gr[:, :, 0, :], np.float64).reshape(sh)
        for gr, sh in zip(grads, shapes, strict=True)
    ]
    return Gradients(out[0], out[1], out[2], None)
