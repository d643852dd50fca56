"""What every adapter shares: the path model, input checks, mask shapes, predictions."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

from mhanum import _validate as V
from mhanum._errors import InvalidArgument
from mhanum.formats import round_to
from mhanum.numerics import Numerics
from mhanum.params import MHAParams

if TYPE_CHECKING:
    from mhanum._types import ArrayLike

FULLY_MASKED = ("nan", "zero", "uniform", "unmasked")


@dataclasses.dataclass(frozen=True)
class PathModel:
    """mhanum's model of one framework code path.

    Attributes:
        framework: adapter name (``torch``, ``keras``, ``flax``, ``jax``, ``model``).
        path: the code path (e.g. ``explicit``, ``sdpa``, ``fast``, ``fused``).
        numerics: the :class:`~mhanum.Numerics` of the path: formats, mask mode and constant,
            scale placement, softmax format, exp/division accuracy, operand rounding (TF32).
        fully_masked: what the path returns for a query row whose every key is masked, in the
            terms of :func:`mhanum.reference.multi_head_attention`: ``"nan"``, ``"zero"`` (each
            head's output is 0, so the layer returns the output bias), ``"uniform"`` (the mean of
            the values), or ``"unmasked"`` (a finite constant *added* to every logit of the row
            cancels in exact arithmetic: the row is the unmasked softmax, up to absorption).
        source: where the behaviour was read (file and function of the installed version).
        notes: anything the numerics cannot express.
    """

    framework: str
    path: str
    numerics: Numerics
    fully_masked: str
    source: str
    notes: str = ""

    def __post_init__(self) -> None:
        if self.fully_masked not in FULLY_MASKED:
            msg = f"fully_masked: expected one of {FULLY_MASKED}, got {self.fully_masked!r}"
            raise InvalidArgument(msg)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready description (the numerics as its one-line ``describe()``)."""
        return {
            "framework": self.framework,
            "path": self.path,
            "numerics": self.numerics.describe(),
            "fully_masked": self.fully_masked,
            "source": self.source,
            "notes": self.notes,
        }


def check_path(path: str, paths: tuple[str, ...], name: str = "path") -> str:
    """``path`` if it is one of ``paths``; else :class:`InvalidArgument` naming ``name``."""
    if path not in paths:
        msg = f"{name}: expected one of {paths}, got {path!r}"
        raise InvalidArgument(msg)
    return path


def float32_params(params: MHAParams, num_heads: int, num_kv_heads: int | None = None) -> MHAParams:
    """``params`` checked and rounded to float32 (what a float32 layer holds); with
    ``num_kv_heads``, grouped-query weights (checked through their expansion, returned grouped).

    Raises:
        InvalidArgument: for parameters that do not validate, or missing biases (every adapted
            layer has all four biases).
    """
    if not isinstance(params, MHAParams):
        msg = f"params: expected an MHAParams, got {type(params).__name__}"
        raise InvalidArgument(msg)
    full = params if num_kv_heads is None else params.expand_kv_heads(num_heads, num_kv_heads)
    full.validate(num_heads)
    if any(b is None for b in (params.bq, params.bk, params.bv, params.bo)):
        msg = "params: expected all four biases (bq, bk, bv, bo), got None for some"
        raise InvalidArgument(msg)
    if full.qk_width != full.v_width:
        msg = f"params.wv: expected H*d_v = H*d_k = {full.qk_width}, got {full.v_width}"
        raise InvalidArgument(msg)
    fields = {
        f.name: round_to(np.asarray(getattr(params, f.name), np.float64), "float32").astype(
            np.float32
        )
        for f in dataclasses.fields(params)
    }
    return MHAParams(**fields)


def batched(x: ArrayLike, name: str, width: int) -> np.ndarray:
    """``x`` rounded to a float32 ``(B, L, width)`` array (a 2-D ``(L, width)`` gets ``B = 1``).

    Raises:
        InvalidArgument: for a wrong rank or width, or non-finite values.
    """
    arr = V.float_array(x, name, min_ndim=2)
    arr = np.asarray(arr)
    if arr.ndim == 2:
        arr = arr[None]
    if arr.ndim != 3 or arr.shape[-1] != width:
        msg = f"{name}: expected shape (B, L, {width}) or (L, {width}), got {np.shape(x)}"
        raise InvalidArgument(msg)
    V.check_finite(arr, name)
    return arr.astype(np.float32)


def mask3(mask: ArrayLike | None, batch: int, lq: int, lk: int) -> np.ndarray | None:
    """An mhanum mask (True = attend) broadcast to ``(B, Lq, Lk)``.

    Raises:
        InvalidArgument: for a non-boolean mask or one that does not broadcast.
    """
    if mask is None:
        return None
    arr = np.asarray(mask)
    if arr.dtype != np.bool_:
        msg = f"mask: expected a boolean array (True = attend), got dtype {arr.dtype}"
        raise InvalidArgument(msg)
    if arr.ndim > 3:
        msg = f"mask: expected shape (Lq, Lk) or (B, Lq, Lk), got {arr.shape}"
        raise InvalidArgument(msg)
    try:
        return np.broadcast_to(arr, (batch, lq, lk)).copy()
    except ValueError:
        msg = f"mask: expected a shape broadcastable to ({batch}, {lq}, {lk}), got {arr.shape}"
        raise InvalidArgument(msg) from None


def fully_masked_rows(mask: np.ndarray | None) -> np.ndarray | None:
    """``(B, Lq)``: rows of a ``(B, Lq, Lk)`` mask with no attended key (None without a mask)."""
    return None if mask is None else np.asarray(~mask.any(axis=-1))


def predict(
    model: PathModel,
    params: MHAParams,
    x_q: np.ndarray,
    x_kv: np.ndarray,
    num_heads: int,
    mask: np.ndarray | None,
) -> np.ndarray:
    """What ``model`` predicts the framework returns: mhanum's attention under its numerics.

    ``mask`` is the effective ``(B, Lq, Lk)`` mask (True = attend). Rows the path answers with
    zeros get the output bias, as the framework returns them.
    """
    from mhanum.emulate.attention import multi_head_attention

    m4 = None if mask is None else mask[:, None]
    out = np.array(
        multi_head_attention(x_q, x_kv, params, num_heads, mask=m4, numerics=model.numerics)
    )
    rows = fully_masked_rows(mask)
    if rows is not None and rows.any() and model.fully_masked == "zero":
        out[rows] = np.asarray(params.bo, out.dtype)
    return out


def reference(
    params: MHAParams,
    x_q: np.ndarray,
    x_kv: np.ndarray,
    num_heads: int,
    mask: np.ndarray | None,
    fully_masked: str = "nan",
) -> np.ndarray:
    """The certified float64 reference with ``mask`` (True = attend) and a fully-masked policy.

    ``"unmasked"`` attends every key of a fully-masked row (an added constant cancels).
    """
    from mhanum import reference as ref

    if fully_masked == "unmasked":
        if mask is not None:
            mask = np.where(~mask.any(axis=-1, keepdims=True), True, mask)
        fully_masked = "nan"
    m4 = None if mask is None or mask.all() else mask[:, None]
    x_q64, x_kv64 = (np.asarray(x, np.float64) for x in (x_q, x_kv))
    return np.asarray(
        ref.multi_head_attention(
            x_q64, x_kv64, params, num_heads, mask=m4, fully_masked=fully_masked
        )
    )


def unbatch(out: np.ndarray, like: ArrayLike) -> np.ndarray:
    """Drop the batch dimension added by :func:`batched` for a 2-D input."""
    return out[0] if np.ndim(like) == 2 else out
