"""The oracle's verdict: the certified reference and the tolerance around it, the check of a
kernel's output against them, and the failure and warning a test sees (``AttentionMismatch``,
``PredictedOverflow``). :mod:`mhanum.testing` builds oracles; :mod:`mhanum.testing.grad` builds one
per gradient."""

from __future__ import annotations

import dataclasses
import inspect
import math
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import ml_dtypes
import numpy as np
from numpy.typing import ArrayLike

from mhanum._errors import InvalidArgument
from mhanum.testing.kernels import Kernel

__all__ = [
    "AttentionMismatch",
    "Candidate",
    "Oracle",
    "PredictedOverflow",
    "as_float64",
    "assert_close",
    "first_largest",
    "fold_candidates",
    "keyword_defaults",
    "keywords_over",
]


class AttentionMismatch(AssertionError):
    """A kernel's output lies outside its certified tolerance (an ``AssertionError``)."""


class PredictedOverflow(UserWarning):
    """A kernel returned inf or NaN where the exact value is finite, at elements where its
    model may overflow (their tolerance is infinite): allowed, and reported."""


@dataclasses.dataclass(frozen=True)
class Oracle:
    """The exact answer and its certified tolerance, element by element.

    The contract of :meth:`assert_close`, element by element:

    * **Bounded** (a finite tolerance): ``|actual - exact| <= tolerance``, else the element
      fails. An inf or NaN where the exact value is finite fails there: the model predicts no
      overflow, so the kernel does not compute as its descriptor says (a bug, or a descriptor
      to correct); the message says so.
    * **Unbounded** (an infinite tolerance, :attr:`unbounded`): the model proves nothing
      there, and :attr:`reason` says why (a stage that may overflow its format, a masking
      constant not proved to vanish, a row that attends no key). Any value passes, inf and
      NaN included: a kernel that overflows where its model may overflow computes as
      modelled. Such an overflow is reported, not hidden: :class:`PredictedOverflow` is
      warned, naming the element, the bound's term and the reason; a failure elsewhere counts
      the unbounded elements; :meth:`unbounded_report` describes them on request.

    Attributes:
        exact: the certified reference (float64) under the kernel's fully-masked-row convention.
        tolerance: ``|actual - exact| <= tolerance`` for every output the kernel may compute
            under one of its candidate numerics; 0 where the convention fixes the answer exactly
            (a row that attends no key under ``-inf`` masking: NaN or zeros); ``inf`` where the
            model bounds nothing.
        term: the name of the bound term that governs each element's tolerance.
        reason: why each element's tolerance is infinite (the governing candidate's
            :attr:`mhanum.bounds.Bound.reasons`, or why a finite masking constant is not proved
            to vanish); ``""`` where it is finite.
        kernel: the kernel descriptor.
        dtype: the input format the tolerance was computed for.
    """

    exact: np.ndarray
    tolerance: np.ndarray
    term: np.ndarray
    reason: np.ndarray
    kernel: Kernel
    dtype: str

    @property
    def unbounded(self) -> np.ndarray:
        """A boolean array of the elements whose tolerance is infinite: the model bounds
        nothing there, and :attr:`reason` says why."""
        return ~np.isfinite(self.tolerance)

    def check(self, actual: Any) -> tuple[np.ndarray, np.ndarray]:
        """``(failing, ratio)``: a boolean array of the elements outside the tolerance, and
        ``|actual - exact| / tolerance`` (``inf`` where a number is due and NaN or inf came;
        0 where the tolerance is infinite, whatever came: :attr:`unbounded`).

        Raises:
            InvalidArgument: for an ``actual`` of another shape.
        """
        got = self._actual(actual)
        exact_nan = np.isnan(self.exact)
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            err = np.abs(got - self.exact)
            ratio = np.where(err == 0, 0.0, err / self.tolerance)
        both_nan = exact_nan & np.isnan(got)
        ratio = np.where(both_nan, 0.0, ratio)
        ratio = np.where(~both_nan & (np.isnan(got) | exact_nan), np.inf, ratio)
        ratio = np.where(~np.isfinite(got) & ~both_nan, np.inf, ratio)
        ratio = np.where(self.unbounded, 0.0, ratio)
        return ratio > 1, ratio

    def message(self, actual: Any) -> str | None:
        """The failure report for ``actual``, or None when every element is within tolerance."""
        failing, ratio = self.check(actual)
        n = int(failing.sum())
        if not n:
            return None
        got = self._actual(actual)
        worst = np.unravel_index(int(np.argmax(np.where(failing, ratio, -1.0))), ratio.shape)
        index = tuple(int(i) for i in worst)
        a, e, tol = float(got[worst]), float(self.exact[worst]), float(self.tolerance[worst])
        text = (
            f"{n} of {failing.size} elements outside the certified tolerance of kernel "
            f"{self.kernel.name!r} ({self.dtype} inputs); worst at index {index}: "
            f"actual {a!r}, exact {e!r}"
        )
        if math.isfinite(e) and not math.isfinite(a):
            text += (
                ": the kernel overflowed where the exact value is finite and the model predicts "
                "no overflow: a bug, or a descriptor that does not describe the kernel; the "
                f"tolerance there is {tol:.3g}, governed by the bound's {self.term[worst]!r} term"
            )
        else:
            text += (
                f", |actual - exact| {abs(a - e):.3g}, tolerance {tol:.3g}, "
                f"ratio {ratio[worst]:.3g}; "
                f"the tolerance there is governed by the bound's {self.term[worst]!r} term"
            )
        unbounded = self.unbounded_report(actual)
        return text if unbounded is None else f"{text}. Besides, {unbounded}"

    def unbounded_report(self, actual: Any) -> str | None:
        """What ``actual`` holds where the model bounds nothing (:attr:`unbounded`), or None
        when every element is bounded: how many such elements, how many of them the kernel
        overflowed (inf or NaN where the exact value is finite), and the first overflowed
        element (else the first unbounded one) with its term and reason."""
        free = self.unbounded
        count = int(free.sum())
        if not count:
            return None
        got = self._actual(actual)
        over = free & ~np.isfinite(got) & np.isfinite(self.exact)
        first = np.argwhere(over if over.any() else free)[0]
        at = tuple(int(i) for i in first)
        why = f"its bound's {self.term[at]!r} term is infinite there ({self.reason[at]})"
        kernel = f"kernel {self.kernel.name!r} ({self.dtype} inputs)"
        free_text = f"{count} of {free.size} elements are unbounded by the model"
        if not over.any():
            return f"{free_text} of {kernel}: any value passes there; at index {at}, {why}"
        return (
            f"{kernel} overflowed where the exact value is finite at {int(over.sum())} of "
            f"{free.size} elements; the model allows this: {why}; first at index {at}: actual "
            f"{float(got[at])!r}, exact {float(self.exact[at])!r}; {free_text}: any value "
            "passes there"
        )

    def assert_close(self, actual: Any) -> None:
        """Raise :class:`AttentionMismatch` with :meth:`message` when a bounded element fails;
        warn :class:`PredictedOverflow` when the kernel overflowed only where its model
        allows it (the class docstring states the contract)."""
        assert_close(self, actual, stacklevel=3)

    def _actual(self, actual: Any) -> np.ndarray:
        got = as_float64(actual, "actual")
        if got.shape != self.exact.shape:
            msg = f"actual: expected shape {self.exact.shape}, got {got.shape}"
            raise InvalidArgument(msg)
        return got


def assert_close(oracle: Oracle, actual: Any, *, stacklevel: int) -> None:
    """:meth:`Oracle.assert_close`, its warning attributed ``stacklevel`` frames up."""
    text = oracle.message(actual)
    if text is not None:
        raise AttentionMismatch(text)
    got = oracle._actual(actual)
    if (oracle.unbounded & ~np.isfinite(got) & np.isfinite(oracle.exact)).any():
        warnings.warn(PredictedOverflow(oracle.unbounded_report(actual)), stacklevel=stacklevel)


def first_largest(
    arrays: Iterable[ArrayLike], shape: tuple[int, ...]
) -> tuple[np.ndarray, np.ndarray]:
    """``(largest, which)``: the entrywise largest of ``arrays`` (each broadcast to ``shape``),
    and the index of the first array that holds it, as ``np.argmax`` over their stack gives it
    (a NaN counts as the largest, and the first NaN is taken) without stacking them: one pass
    of each array against the running largest.

    Example:
        >>> import numpy as np
        >>> largest, which = first_largest([[1.0, 5.0, 2.0], [3.0, 5.0, np.nan]], (3,))
        >>> largest.tolist(), which.tolist()
        ([3.0, 5.0, nan], [1, 0, 1])
    """
    it = iter(arrays)
    first = next(it, None)
    if first is None:
        msg = "arrays: expected at least one array, got none"
        raise InvalidArgument(msg)
    largest = np.array(np.broadcast_to(np.asarray(first, np.float64), shape))
    which = np.zeros(shape, np.intp)
    for i, a in enumerate(it, 1):
        a = np.asarray(a, np.float64)
        beyond = (a > largest) | (np.isnan(a) & ~np.isnan(largest))
        which[beyond] = i
        np.maximum(largest, a, out=largest)
    return largest, which


Candidate = tuple[ArrayLike, Mapping[str, ArrayLike], Sequence[str]]
"""A candidate numerics' bound as an oracle folds it: its total, its named terms (which add up
to at most the total), and why it is infinite where it is."""


def fold_candidates(
    candidates: Sequence[Candidate], shape: tuple[int, ...]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(tolerance, term, reason)``: the candidates' largest total, element by element; the
    name of the largest term of the candidate that gives it (:func:`first_largest`'s choice
    among the candidates and among its terms); and, where the tolerance is infinite, that
    candidate's reasons (``""`` where it is finite)."""
    tol, which = first_largest((c[0] for c in candidates), shape)
    names = np.empty(shape, dtype=object)
    reason = np.full(shape, "", dtype=object)
    infinite = ~np.isfinite(tol)
    for c, (_, terms, reasons) in enumerate(candidates):
        labels = np.asarray(list(terms), dtype=object)
        top = labels[first_largest(terms.values(), shape)[1]]
        names = top if len(candidates) == 1 else np.where(which == c, top, names)
        if infinite.any():
            why = "; ".join(reasons) or "no reason recorded"
            reason = np.where((which == c) & infinite, why, reason)
    return tol, names, reason


def as_float64(x: Any, name: str) -> np.ndarray:
    """Any array (numpy, ml_dtypes, JAX, PyTorch, TensorFlow) as float64, exactly."""
    if hasattr(x, "detach"):  # a torch tensor
        x = _tensor_values(x.detach().cpu())
    try:
        arr = np.asarray(x)
    except (TypeError, ValueError) as err:
        msg = f"{name}: expected a real array, got {type(x).__name__}"
        raise InvalidArgument(msg) from err
    if arr.dtype == np.bool_ or not (
        arr.dtype.kind == "f" or str(arr.dtype) in ("bfloat16", "float8_e4m3fn", "float8_e5m2")
    ):
        msg = f"{name}: expected a floating-point array, got dtype {arr.dtype}"
        raise InvalidArgument(msg)
    return arr.astype(np.float64)


def _tensor_values(t: Any) -> np.ndarray:
    """A CPU tensor's values as a numpy array, exactly, by numpy alone: torch's own conversion
    to float64 is a parallel kernel, which waits for a core where the process's cores are busy
    (about 8 ms a call on 2 busy cores, against 0.01 ms). A format numpy has no dtype for
    (bfloat16, the float8 formats) is read as its bits in ml_dtypes' format of the same name,
    then as float64; one ml_dtypes does not hold converts through torch's ``double``."""
    fmt = str(t.dtype).removeprefix("torch.")
    try:
        return t.numpy()
    except TypeError:
        pass
    target = getattr(ml_dtypes, fmt, None)
    width = {1: "int8", 2: "int16"}.get(t.element_size())
    if target is None or width is None or np.dtype(target).itemsize != t.element_size():
        return t.double().numpy()
    import torch

    return t.view(getattr(torch, width)).numpy().view(target).astype(np.float64)


def keyword_defaults(function: Callable[..., object]) -> dict[str, Any]:
    """A function's keyword-only arguments, in the order of its signature, with their defaults
    (the keywords a ``**kwargs`` tolerance function forwards to its oracle)."""
    parameters = inspect.signature(function).parameters.values()
    return {p.name: p.default for p in parameters if p.kind is p.KEYWORD_ONLY}


def keywords_over(defaults: dict[str, Any], given: dict[str, Any], caller: str) -> dict[str, Any]:
    """``given`` over ``defaults``; a TypeError, as Python's, for a name they do not hold."""
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        msg = f"{caller}() got an unexpected keyword argument {unknown[0]!r}"
        raise TypeError(msg)
    return {**defaults, **given}
