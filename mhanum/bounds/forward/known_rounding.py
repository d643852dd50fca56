"""Lemma 6k and when steps 6k and 6r take it (papers/attention.md): rounding to nearest is
monotone, so a value known to lie in ``[a, b]`` rounds into ``[A, B]``, one value of the
format where no rounding boundary lies between ``a`` and ``b``."""

from __future__ import annotations

import numpy as np

from mhanum._types import NumpyArray
from mhanum.bounds.factors import conversion_eta, operand_error_of
from mhanum.bounds.forward.stage import Context
from mhanum.formats import round_to
from mhanum.numerics import Numerics

__all__ = ["coarser_probabilities", "known_roundings", "rounded_range"]


def coarser_probabilities(num: Numerics) -> bool:
    """Whether ``num`` stores its probabilities in a coarser format than its softmax computes
    them in: where steps 6k and 6r (and 3k through them) may apply."""
    return num.format_of("prob").u > num.format_of("softmax").u


def known_roundings(ctx: Context) -> bool:
    """Whether steps 6k and 6r may take the weights' roundings as known: asked for, the
    weights stored in a coarser format than the softmax computes them in, not lifted
    (``prob_offset``), and read by the dot exactly (:func:`operand_error_of`)."""
    num = ctx.num
    return (
        ctx.known
        and coarser_probabilities(num)
        and not num.prob_offset
        and not operand_error_of(num, num.format_of("prob"))[0]
    )


def rounded_range(
    num: Numerics, before: tuple[NumpyArray, NumpyArray]
) -> tuple[NumpyArray, NumpyArray]:
    """Lemma 6k: ``[A_j, B_j]``, the values ``fl_p`` may give for a value in ``[a_j, b_j]``:
    the nearest values of ``F_p`` to the float64 neighbours below ``a_j`` and above ``b_j``,
    and 0 below the smallest normal number of ``F_p`` or of the dot's read of it (a flush is
    one more way down to 0).

    Examples:
        >>> import numpy as np
        >>> num = Numerics(input="bfloat16", accum="float32", softmax_format="float32",
        ...                prob_format="bfloat16")
        >>> low, high = rounded_range(num, (np.array([1 / 3 - 1e-7]), np.array([1 / 3 + 1e-7])))
        >>> float(low[0]) == float(high[0]) == 0.333984375  # fl(1/3), known
        True
    """
    f_p = num.format_of("prob")
    eta_read = operand_error_of(num, f_p)[1] + conversion_eta(num, num.operand_rounding or f_p)
    a, b = before
    low = round_to(np.nextafter(np.maximum(a, 0.0), -np.inf), f_p)
    low = np.where(a >= max(f_p.smallest_normal, eta_read), low, 0.0)
    return low, round_to(np.nextafter(b, np.inf), f_p)
