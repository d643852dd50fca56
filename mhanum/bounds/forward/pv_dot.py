"""Step 7's ``P·V`` dot by Theorem R.8 (papers/summation.md): its additions charged through the
one-signed total of the products ``p̂_j ṽ_j``, not through ``Σ_j p̂_j |ṽ_j|`` along every key."""

from __future__ import annotations

import numpy as np

from mhanum._types import NumpyArray
from mhanum.bounds.enclosure import one_signed_sizes, one_signed_total
from mhanum.bounds.factors import evaluation_rounding
from mhanum.bounds.forward.evaluation import dot, quiet
from mhanum.bounds.forward.one_martingale import Increments
from mhanum.numerics import Numerics

__all__ = ["pv_one_signed"]


def pv_one_signed(
    num: Numerics,
    bits: tuple[int, int],
    read: tuple[NumpyArray, NumpyArray],
    output: tuple[NumpyArray, NumpyArray, NumpyArray, NumpyArray],
    deviations: NumpyArray,
    lam: float | None,
    eta_scale: float | NumpyArray = 1.0,
) -> tuple[NumpyArray | float, Increments | None]:
    """The error of ``P·V``'s dot (not online over several blocks) by Theorem R.8 (with
    ``lam``, the smaller of R.8 and R.8', one event per output entry of the ``d_v`` per key
    the union bound counts), or
    ``inf`` outside it; and with ``lam``, R.8''s martingale form for Theorem A.3e (``None``
    outside R.8').

    ``read = (p̂|v|, v̄)``: ``Σ_j p̂_j|ṽ_j|`` of the weights and values as the dot reads them
    and ``v̄ >= |ṽ|``; ``output = (o, its float64 error, p, v_extra)``: the float64 ``o = p v``
    of the exact softmax ``p`` of the logits and ``v_extra >= |ṽ - v|``; ``deviations >= |p̂_j
    - p_j|`` per key (steps 4-6: the logits', the softmax's, the rounding into ``F_p`` and the
    operand read). The products' signed sum is then ``|Σ_j p̂_j ṽ_j| <= |o| + Σ_j p_j (v̄_j -
    |v_j|) + Σ_j |p̂_j - p_j| v̄_j``, and the one-signed total ``C`` follows
    (:func:`one_signed_total`). ``eta_scale >= 1/ℓ̂`` where the dot reads the unnormalised
    weights ``ℓ̂ p̂_j`` and its result is divided by ``ℓ̂`` (the online softmax on one block):
    its underflow is the dot's own over ``ℓ̂``.
    """
    (p_hat_v, v_abs), (o, ev, p, v_extra) = read, output
    n = v_abs.shape[-2]
    with quiet():
        signed = np.abs(o) + ev + dot(p, v_extra) + deviations @ v_abs
        signed = signed * (1 + evaluation_rounding(n))
        total = one_signed_total(p_hat_v, signed, n)
        sizes = one_signed_sizes(num, n, bits, p_hat_v, total, eta_scale)
        found: list[NumpyArray] = []
        form = None
        if sizes is not None:
            found.append(sizes.deterministic())
            spread = None if lam is None else sizes.spread()
            if spread is not None and lam is not None:
                form = Increments(np.zeros_like(spread) + sizes.underflow(), spread, None, found[0])
                found.append(form.bound(lam))
    return (np.inf if not found else np.fmin.reduce(found)), form
