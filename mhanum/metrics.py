"""Error metrics of a computed output against a reference.

:func:`errors` compares elementwise and reports the usual metrics together, so that none of them
hides what another shows:

* ``max_abs``: :math:`\\max_i |c_i - r_i|`;
* ``max_rel``: componentwise :math:`\\max_i |c_i - r_i| / |r_i|`; where :math:`r_i = 0` the term is
  0 if :math:`c_i = 0` and ``inf`` otherwise (a nonzero answer to a zero has no finite relative
  error);
* ``normwise_max``: :math:`\\|c - r\\|_\\infty / \\|r\\|_\\infty` over all entries (max-norm);
* ``normwise_fro``: :math:`\\|c - r\\|_F / \\|r\\|_F`;
* ``max_ulps``: :math:`\\max_i |c_i - r_i| / \\mathrm{ulp}_{fmt}(r_i)`, the spacing of the format at
  the reference value (:func:`mhanum.formats.ulp`).

NaN or Inf in the computed output, or an infinite reference (an exact value past float64's
range), is never averaged away: every metric is then ``inf`` and ``n_nonfinite`` counts the
entries (a finite answer to an infinite value, or an infinite one, has no finite error).
Entries where the reference is NaN (undefined, as for a fully-masked row under
``fully_masked="nan"``) are excluded and counted in ``n_undefined``.

With a reference given as mpf values (``reference.attention(..., return_mpf=True)``) the
differences are formed exactly in mpmath, so errors of a float64 computation are not blurred by
the half-ulp rounding of a float64 reference.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import mpmath
import numpy as np

from mhanum._errors import InvalidArgument
from mhanum.formats import Format, get_format, ulp
from mhanum.reference import nearest_float64

if TYPE_CHECKING:
    from mhanum._types import ArrayLike

__all__ = ["Errors", "errors"]


@dataclasses.dataclass(frozen=True)
class Errors:
    """Error metrics of a computed array against a reference (see the module docstring)."""

    max_abs: float
    max_rel: float
    normwise_max: float
    normwise_fro: float
    max_ulps: float | None
    fmt: str | None
    argmax_abs: tuple[int, ...]
    n_compared: int
    n_nonfinite: int
    n_undefined: int

    def as_dict(self) -> dict[str, Any]:
        """The metrics as plain JSON-serialisable values (``inf`` stays a float)."""
        return dataclasses.asdict(self) | {"argmax_abs": list(self.argmax_abs)}

    def __str__(self) -> str:
        ulps = "" if self.max_ulps is None else f", max {self.max_ulps:.3g} ulp({self.fmt})"
        extra = ""
        if self.n_nonfinite:
            extra += f", {self.n_nonfinite} non-finite computed"
        if self.n_undefined:
            extra += f", {self.n_undefined} undefined in reference"
        return (
            f"max abs {self.max_abs:.3e}, max rel {self.max_rel:.3e}, "
            f"normwise max {self.normwise_max:.3e}, normwise F {self.normwise_fro:.3e}"
            f"{ulps}{extra}"
        )


def _infer_format(dtype: np.dtype) -> Format | None:
    try:
        return get_format(dtype)
    except InvalidArgument:
        return None


def _exact_differences(computed: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """``|c - r|`` formed exactly in mpmath from mpf reference values, rounded once to float64.

    (``float(mpf)`` would round twice for subnormal differences.)
    """
    ctx = mpmath.MPContext()
    out = np.empty(computed.shape)
    for index, (c, r) in enumerate(zip(computed.flat, reference.flat, strict=True)):
        if not math.isfinite(c) or ctx.isnan(r):
            out.flat[index] = math.nan
        else:
            difference = ctx.fsub(ctx.mpf(float(c)), r, exact=True)
            out.flat[index] = abs(nearest_float64(difference))
    return out


def errors(computed: ArrayLike, reference: ArrayLike, fmt: Format | str | None = None) -> Errors:
    """Errors of ``computed`` against ``reference``.

    Args:
        computed: the output to judge (any float dtype; JAX arrays too).
        reference: float64 values or an object array of mpf values (from
            :func:`mhanum.reference.attention` with ``return_mpf=True``), same shape.
        fmt: format for ``max_ulps``; default: the format of ``computed``'s dtype when mhanum knows
            it (float32 output is measured in float32 ulps, even if it holds tf32 values).

    Returns:
        An :class:`Errors`.

    Raises:
        InvalidArgument: for shapes that differ or a non-numeric input.

    Examples:
        >>> import numpy as np
        >>> e = errors(np.float32([1.0, 2.0]), np.array([1.0, 2.0 + 2**-20]))
        >>> e.max_ulps  # 2**-20 at 2.0 is 2**-20 / 2**-22 = 4 ulps of float32
        4.0
    """
    c_arr = np.asarray(computed)
    r_arr = np.asarray(reference)
    if c_arr.shape != r_arr.shape:
        msg = f"reference: expected shape {c_arr.shape} (that of computed), got {r_arr.shape}"
        raise InvalidArgument(msg)
    fmt_obj = get_format(fmt) if fmt is not None else _infer_format(c_arr.dtype)
    try:
        c = c_arr.astype(np.float64)
    except (TypeError, ValueError):
        msg = f"computed: expected a real float array, got dtype {c_arr.dtype}"
        raise InvalidArgument(msg) from None
    if r_arr.dtype == object:
        r = np.array([float(x) for x in r_arr.flat]).reshape(r_arr.shape)
        diff = _exact_differences(c, r_arr)
    else:
        r = r_arr.astype(np.float64)
        with np.errstate(invalid="ignore", over="ignore"):
            diff = np.abs(c - r)
    undefined = np.isnan(r)
    defined = ~undefined
    nonfinite = defined & ~(np.isfinite(c) & np.isfinite(r))
    n_nonfinite = int(nonfinite.sum())
    n_compared = int(defined.sum())
    fmt_name = fmt_obj.name if fmt_obj is not None else None
    if n_nonfinite:
        index = tuple(int(i) for i in np.argwhere(nonfinite)[0])
        ulps_inf = math.inf if fmt_obj is not None else None
        return Errors(
            math.inf,
            math.inf,
            math.inf,
            math.inf,
            ulps_inf,
            fmt_name,
            index,
            n_compared,
            n_nonfinite,
            int(undefined.sum()),
        )
    d = np.where(defined, diff, 0.0)
    ref = np.where(defined, r, 0.0)
    abs_ref = np.abs(ref)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(abs_ref > 0, d / abs_ref, np.where(d > 0, math.inf, 0.0))
    index = tuple(int(i) for i in np.unravel_index(int(np.argmax(d)), d.shape)) if d.size else ()
    ref_max = float(abs_ref.max(initial=0.0))
    ref_fro = float(np.sqrt(np.sum(abs_ref**2)))
    d_max = float(d.max(initial=0.0))
    d_fro = float(np.sqrt(np.sum(d**2)))
    max_ulps = None
    if fmt_obj is not None:
        max_ulps = float(np.max(d / ulp(ref, fmt_obj), initial=0.0))
    return Errors(
        max_abs=d_max,
        max_rel=float(rel.max(initial=0.0)),
        normwise_max=_ratio(d_max, ref_max),
        normwise_fro=_ratio(d_fro, ref_fro),
        max_ulps=max_ulps,
        fmt=fmt_name,
        argmax_abs=index,
        n_compared=n_compared,
        n_nonfinite=0,
        n_undefined=int(undefined.sum()),
    )


def _ratio(num: float, den: float) -> float:
    if den > 0:
        return num / den
    return 0.0 if num == 0 else math.inf
