"""Upper bounds of the exact probabilities and of the exact gradients' magnitudes, from float64
evaluations whose own errors are charged (papers/backward.md, Lemma O.2).

:func:`mhanum.testing.attention_grad_tolerance` charges the certified reference's float64
rounding, ``2^-52·|exact|``, on these bounds of ``|exact|`` instead of computing the reference:
the exact gradients are sums of products of ``P >= 0``, ``|d_out|``, ``|v|``, ``|q|`` and
``|k|``, so bounding each factor bounds them.

>>> import numpy as np
>>> q, k = np.zeros((1, 2)), np.ones((3, 2))
>>> up = probabilities_upper(q, k, None, None, 1.0, None)
>>> bool(np.all(up >= 1 / 3)), bool(np.all(up < 1 / 3 + 1e-12))
(True, True)
"""

from __future__ import annotations

import numpy as np

from mhanum import masks

__all__ = ["gradient_magnitudes", "probabilities_upper"]

U64 = 2.0**-52  # twice float64's unit roundoff: every relative factor below has margin
TINY = 2.0**-1074  # float64's smallest subnormal: one underflow of a sum of products


def _up(x: np.ndarray, n: int) -> np.ndarray:
    """``>=`` the exact value of a float64 sum of ``n`` nonnegative products ``x`` (Higham
    (2002), (3.5): ``γ_n`` of the terms, each term's underflow at most ``2^-1075``)."""
    return x * (1 + (n + 4) * U64) + n * TINY


def probabilities_upper(
    q: np.ndarray,
    k: np.ndarray,
    mask: masks.Band | np.ndarray | None,
    bias: np.ndarray | None,
    c: float,
    cap: float | None,
) -> np.ndarray:
    """``>=`` the exact probabilities ``P = softmax(S)`` of the logits ``S = c·q kᵀ`` (``cap·
    tanh(·/cap)`` with a soft-cap) ``+ bias``, 0 at keys the mask (a boolean array, True =
    attend, or a :class:`mhanum.masks.Band`) or a ``-inf`` bias excludes.

    With ``E_l >= |Ŝ_l - S_l|`` the float64 logits' error (``(d + 4)·2^-52`` of ``|c||q||k|``
    and of the bias, ``2^-52`` of ``|Ŝ|`` and of the row maximum for the sum and the shift,
    ``2^-49·cap`` for tanh) and ``W`` its largest over a row's keys, ``P_j <= e^{2W}
    e^{Ŝ_j - m}/Σ_l e^{Ŝ_l - m}``. The float64 quotient ``p̂_j`` is within a factor ``(1 + (n +
    16)·2^-50)`` of that ratio and ``2^-1074`` of underflow (the denominator is at least 1),
    so ``P_j <= (p̂_j + 2^-1073)·e^{2W(1 + 2^-40)}·(1 + (n + 16)·2^-50)``, the ``2^-40`` covering
    the rounding of ``W`` and of the exponent. A row where a kept logit or its error is not
    finite gets the trivial bound ``P <= 1``; every bound is at most 1."""
    d, n = q.shape[-1], k.shape[-2]
    with np.errstate(over="ignore", invalid="ignore"):
        raw = c * (q @ np.swapaxes(k, -1, -2))
        err = (d + 4) * U64 * abs(c) * (np.abs(q) @ np.swapaxes(np.abs(k), -1, -2))
        s = raw
        if cap is not None:
            s = cap * np.tanh(raw / cap)
            err = err + 2.0**-49 * abs(cap)
        excluded = ~np.asarray(masks.dense(masks.normalise(mask, s.shape), s.shape), bool)
        if bias is not None:
            s = s + bias
            err = err + (d + 4) * U64 * np.abs(np.where(np.isfinite(bias), bias, 0.0))
            excluded = excluded | np.broadcast_to(bias == -np.inf, s.shape)
        err = np.broadcast_to(err, s.shape)
        bad = ~excluded & ~(np.isfinite(s) & np.isfinite(err))
        row_bad = bad.any(axis=-1, keepdims=True)
        live = np.where(excluded | bad, -np.inf, s)
        top = live.max(axis=-1, keepdims=True)
        top = np.where(np.isfinite(top), top, 0.0)
        e = np.where(excluded | bad, 0.0, np.exp(live - top))
        p = e / e.sum(axis=-1, keepdims=True)
        err = err + U64 * (np.abs(s) + np.abs(top))
        worst = np.where(excluded | bad, 0.0, err).max(axis=-1, keepdims=True)
        growth = np.exp(2 * worst * (1 + 2.0**-40)) * (1 + (n + 16) * 2.0**-50)
        up = (p + 2 * TINY) * growth + TINY
        up = np.where(row_bad | ~np.isfinite(up), 1.0, np.minimum(up, 1.0))
    return np.where(excluded, 0.0, up)


def gradient_magnitudes(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    d_out: np.ndarray,
    mask: masks.Band | np.ndarray | None,
    bias: np.ndarray | None,
    scale: tuple[float, float | None],
    sink: object = None,
) -> dict[str, np.ndarray]:
    """``>=`` the magnitudes of the exact gradients of ``<d_out, attention(q, k, v)>``, in the
    shapes :func:`mhanum.reference.attention_grad` returns them (``dbias`` over the full
    logits, ``dsink`` summed over the rows); ``scale`` is ``(c, cap)``, the logit scale as
    a float and the soft-cap or ``None``.

    Lemma O.2 (papers/backward.md): with ``P̄ >= P`` (:func:`probabilities_upper`; a sink is
    one more key, zero key and value, bias ``σ``), ``|dP_ij| = |d_out_i·v_j| <= a_ij =
    |d_out_i||v_j|``, ``|D_i| = |Σ_j P_ij dP_ij| <= Σ_j P̄_ij a_ij``, ``|dS_ij| = P_ij|dP_ij -
    D_i| <= P̄_ij(a_ij + |D_i|)``; a soft-cap's slope lies in ``[0, 1]``, so ``|dq| <= |c||dS|
    |k|``, ``|dk| <= |c||dS|ᵀ|q|``, and ``|dv| <= P̄ᵀ|d_out|``, ``|dbias| <= |dS|``, ``|dsink|
    <= Σ_i P̄_iσ |D_i|`` (the sink's ``dP`` is 0). Each product and sum is rounded up by
    :func:`_up`; ``|c|`` by ``2^-52`` (the scale the reference takes exactly is within
    ``2^-53`` of its float)."""
    c, cap = scale
    n, lq = k.shape[-2], q.shape[-2]
    if sink is None:
        p_up = probabilities_upper(q, k, mask, bias, c, cap)
        p_sink = None
    else:
        k2, _, m2, b2 = masks.with_sink(q, k, v, mask, bias, np.asarray(sink, np.float64))
        full = probabilities_upper(q, k2, m2, b2, c, cap)
        p_up, p_sink = full[..., :n], full[..., n:]
    with np.errstate(over="ignore", invalid="ignore"):
        a = _up(np.abs(d_out) @ np.swapaxes(np.abs(v), -1, -2), v.shape[-1])
        d_abs = _up((p_up * a).sum(axis=-1, keepdims=True), n)
        ds = _up(p_up * (a + d_abs), 2)
        c_abs = abs(c) * (1 + U64)
        out = {
            "dq": _up(c_abs * (ds @ np.abs(k)), n + 1),
            "dk": _up(c_abs * (np.swapaxes(ds, -1, -2) @ np.abs(q)), lq + 1),
            "dv": _up(np.swapaxes(p_up, -1, -2) @ np.abs(d_out), lq),
            "dbias": ds,
        }
        if p_sink is not None:
            out["dsink"] = _up((p_sink * d_abs).sum(axis=(-2, -1)), lq + 1)
    return out
