"""Rounding-error bounds for the softmax stage (naive, safe and online), and for logit perturbations.

The bounds are *a posteriori* in the logits: they take the logits ``x`` the softmax is applied to
and bound, componentwise, the error of :func:`mhanum.softmax` on exactly those logits. They are
rigorous (no ``O(u^2)`` dropped) and include underflow. Their derivations are in
``papers/softmax.md``; the first-order forms reduce to Blanchard, Higham & Higham (2021),
Theorems 3.3 and 4.3, and the online bound (Theorem S.3) is new.

Model of the arithmetic in the softmax format ``F`` (unit roundoff ``u = 2^-p``, smallest normal
``2^emin``), shared by every theorem here:

* ``+ - *`` are correctly rounded (round to nearest): ``fl(a op b) = (a op b)(1 + δ) + η``,
  ``|δ| <= u``;
* ``exp`` has relative error ``<= ε_exp = 2·exp_ulps·u`` (an ulp is at most ``2u`` relative) and
  division ``<= ε_div = (1 + u)^(2·div_ulps) - 1`` (:func:`division_error`; XLA divides by a
  broadcast row sum as a product with its correctly rounded reciprocal, two roundings:
  ``div_ulps = 1``, the default);
* underflow: XLA's CPU backend flushes float32, bfloat16 (carried in float32) and float64
  subnormals to zero (inputs and results), so each rounding carries an absolute error
  ``η <= 2^emin (1 + ε)``; float16 (carried in float32) underflows gradually, ``η <= ε·2^emin``;
* no overflow (a bound that cannot exclude it is ``inf``);
* a sum of ``N`` nonnegative terms in the order ``numerics.summation`` has relative error at most
  ``γ_h`` with ``h`` the height of its tree (sequential and native ``N - 1``, pairwise
  ``⌈log2 N⌉``, ``blocked(b)`` ``(b - 1) + (⌈N/b⌉ - 1)``), Kahan the constant of Theorem R.4
  (papers/summation.md).

The model's constants, and the steps every row takes, are :mod:`mhanum.bounds.softmax_model`;
one row of each theorem is :mod:`mhanum.bounds.softmax_rows`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from mhanum._errors import InvalidArgument
from mhanum.bounds._result import Bound
from mhanum.bounds.factors import division_error, summation_gamma
from mhanum.bounds.softmax_model import UNEVALUABLE, Model, past_evaluation_range
from mhanum.bounds.softmax_rows import (
    lse_row,
    naive_or_safe_row,
    online_row,
    online_sum_upper,
    scaled_maxima_fit,
)
from mhanum.formats import representable, round_to
from mhanum.numerics import Numerics, resolve

__all__ = ["division_error", "logit_perturbation", "lse_bound", "softmax_bound", "summation_gamma"]

_SOURCE = "blanchard-higham-higham-2021"
_ASSUMPTIONS = (
    "round to nearest in the softmax format",
    "exp within numerics.exp_ulps ulps, division within numerics.div_ulps ulps",
    "underflow: an absolute error 2^emin (flush to zero) or eps*2^emin (gradual) per rounding",
    "no overflow (the bound is inf where overflow is not excluded)",
    "logits representable in the score format",
)


def _logits(x: Any, num: Numerics) -> np.ndarray:
    try:
        arr = np.asarray(x)
    except (TypeError, ValueError) as err:
        msg = f"x: expected a real array of logits, got {type(x).__name__}"
        raise InvalidArgument(msg) from err
    if arr.dtype.kind not in "fiu" and not str(arr.dtype).startswith(("bfloat", "float")):
        msg = f"x: expected a real array of logits, got dtype {arr.dtype}"
        raise InvalidArgument(msg)
    arr = arr.astype(np.float64)
    if arr.ndim < 1 or arr.shape[-1] < 1:
        msg = f"x: expected shape (..., n) with n >= 1, got {arr.shape}"
        raise InvalidArgument(msg)
    if np.isnan(arr).any() or np.isposinf(arr).any():
        msg = "x: expected finite logits (-inf allowed), got NaN or +inf"
        raise InvalidArgument(msg)
    if not np.isfinite(arr).any(axis=-1).all():
        msg = "x: expected at least one finite logit per row, got a row of -inf"
        raise InvalidArgument(msg)
    score = num.format_of("score")
    if not representable(arr, score).all():
        msg = f"x: expected logits representable in the score format {score.name}; round them"
        raise InvalidArgument(msg)
    return arr


def softmax_bound(x: Any, numerics: Numerics | str | None = None) -> Bound:
    """Componentwise bound on the error of :func:`mhanum.softmax` for the logits ``x``.

    **Theorem S.1 (naive), S.2 (safe), S.3 (online).** Let ``x`` be logits in the score format,
    ``x̂ = fl_F(x)`` in the softmax format ``F``, ``p = softmax(x)`` exactly and ``p̂`` the result
    of ``mhanum.softmax(x, numerics=numerics)``. Under the model of this module (round to
    nearest, ``ε_exp``, ``ε_div``, the summation ``γ``, underflow terms, no overflow),

    .. math::

        |\\hat p_i - p_i| \\le \\mathrm{total}_i,

    where ``total`` is the rigorous a posteriori bound of ``papers/softmax.md`` (§1-3). To first
    order in ``u``, with ``σ_j`` the error of the exp argument (``σ_j = |x̂_j - x_j|`` naive;
    ``+ u|x̂_j - x̂_max|`` or 0 when the difference is exact, safe and online) and ``γ`` the
    summation constant over ``n`` terms (over ``B`` terms for online):

    .. math::

        \\frac{|\\hat p_i - p_i|}{p_i} \\le \\sigma_i + \\sum_j p_j\\sigma_j
            + 2\\varepsilon_{\\exp} + \\gamma + \\varepsilon_{\\div}
            \\;\\Big[ + \\sum_j p_j \\Big(u + \\sum_{l = k(j)+1}^{K} (\\sigma_{c,l}
            + \\varepsilon_{\\exp} + 2u)\\Big) \\Big]_{\\text{online}} + O(u^2)
            + \\text{underflow}

    with ``K = ⌈n/B⌉`` blocks, ``k(j)`` the block of ``j``, ``σ_j <= u(m_{k(j)} - x̂_j)`` for the
    in-block terms and ``σ_{c,l} <= u(m_l - m_{l-1})`` the error of the argument of the ``l``-th
    rescaling factor (the ``u`` is the rounding of adding a block sum to the rescaled total). With ``exp_ulps = div_ulps =
    1/2`` and sequential summation: naive ``(n + 2)u`` (within BHH Thm 3.3's ``(n + 3)u``), safe
    ``(n + 2 + 2(x_max - x_min))u`` (BHH Thm 4.3, here componentwise), online
    ``(B + 3 + 2(x_max - x_min) + 3(⌈n/B⌉ - 1))u`` at most (Theorem S.3; ``B + 2 + ...`` for
    one block): each term is rescaled at most ``⌈n/B⌉ - 1`` times, and the arguments of the
    rescalings telescope to at most ``x_max - x_j``.

    Args:
        x: logits ``(..., n)``, each representable in ``numerics``' score format; ``-inf``
            entries (masked) are allowed, at least one finite per row.
        numerics: a :class:`mhanum.Numerics` or a preset name.

    Returns:
        A :class:`Bound` shaped like ``x``: ``total`` and the terms ``shift``, ``exp``, ``sum``,
        ``division``, ``underflow``, ``rescaling`` (online), ``second_order`` (the rest of the
        rigorous total). ``inf`` where overflow or total underflow of the naive sum cannot be
        excluded, or (online) an exponential or the running sum may overflow: with
        ``prob_offset = k`` they are lifted by ``2^k`` and more where the shift
        ``fl(fl(m·c2) - k)`` rounds (papers/softmax.md, §3').

    Raises:
        InvalidArgument: for a bad ``numerics``, NaN/+inf or a row of ``-inf`` in ``x``, or
            logits not representable in the score format.

    Examples:
        >>> b = softmax_bound([0.0, 1.0, 2.0], "fp32")
        >>> bool((b.total < 10 * 2.0**-24).all())
        True

    References:
        Blanchard, Higham & Higham, IMA J. Numer. Anal. 41(4), 2021, Thms 3.3, 4.3;
        Milakov & Gimelshein, arXiv:1805.02867 (the online algorithm); papers/softmax.md.
    """
    num = resolve(numerics)
    arr = _logits(x, num)
    model = Model(num)
    rounded = _rounded_into(arr, model)
    rows_x = arr.reshape(-1, arr.shape[-1])
    rows_r = rounded.reshape(-1, arr.shape[-1])
    kind = num.softmax_kind
    totals, unders = [], []
    terms: dict[str, list[np.ndarray]] = {}
    flags: set[str] = set()  # why some row is infinite (see _softmax_row)
    for xs, xr in zip(rows_x, rows_r, strict=True):
        total, t, under, flag = _softmax_row(xs, xr, model, kind, num.softmax_block)
        flags.add(flag)
        totals.append(total)
        unders.append(under)
        for name, value in t.items():
            terms.setdefault(name, []).append(value)
    total_arr = np.stack(totals).reshape(arr.shape)
    out = {name: np.stack(v).reshape(arr.shape) for name, v in terms.items()}
    out["underflow"] = np.stack(unders).reshape(arr.shape)
    with np.errstate(invalid="ignore"):
        rest = total_arr - sum(out.values())
    out["second_order"] = np.where(np.isfinite(rest), np.maximum(rest, 0.0), 0.0)
    label = {"naive": "S.1", "safe": "S.2", "online": "S.3"}[kind]
    return Bound(
        reasons=_softmax_reasons(flags, num, model),
        total=total_arr,
        terms=out,
        theorem=f"papers/softmax.md Theorem {label}",
        assumptions=_ASSUMPTIONS,
        source=_SOURCE if kind != "online" else None,
    )


def _rounded_into(arr: np.ndarray, model: Model) -> np.ndarray:
    """The logits rounded into the softmax format, where none may overflow it."""
    rounded = round_to(arr, model.fmt)
    if np.isinf(rounded[np.isfinite(arr)]).any():
        msg = f"x: expected logits within the range of the softmax format {model.fmt.name}"
        raise InvalidArgument(msg)
    return rounded


def _softmax_row(
    xs: np.ndarray, xr: np.ndarray, model: Model, kind: str, block: int | None
) -> tuple[np.ndarray, dict[str, np.ndarray], np.ndarray, str]:
    """One row of Theorem S.1, S.2 or S.3 (``kind``): (total, first-order terms, underflow) and
    why the row is infinite, if it is: ``"unevaluable"`` (past float64's evaluation range, every
    entry ``inf``), ``"scaled_over"`` (exp2 forms: a scaled maximum may overflow), ``"over"``
    (online: an exponential or the running sum may overflow), ``"vacuous"`` (the bound itself
    is infinite somewhere), else ``""``."""
    if past_evaluation_range(xs, xr):
        infinite = np.full(xr.shape, np.inf)
        names = ("shift", "exp", "sum", "division") + ("rescaling",) * (kind == "online")
        return infinite, dict.fromkeys(names, infinite), infinite, "unevaluable"
    if kind == "online":
        assert block is not None
        total, t, under = online_row(xs, xr, model, block)
    else:
        total, t, under = naive_or_safe_row(xs, xr, model, safe=kind == "safe")
    if model.base2 and kind != "naive" and not scaled_maxima_fit(xr, model, block):
        return np.full_like(total, np.inf), t, under, "scaled_over"
    if kind == "online" and not (online_sum_upper(xr, model, block or 1) <= model.fmt.max_finite):
        return np.full_like(total, np.inf), t, under, "over"
    return total, t, under, "" if np.isfinite(total).all() else "vacuous"


def _softmax_reasons(flags: set[str], num: Numerics, model: Model) -> tuple[str, ...]:
    """Why :func:`softmax_bound` is infinite on some row, from the rows' flags
    (:func:`_softmax_row`), in words."""
    kind = num.softmax_kind
    reasons: tuple[str, ...] = ()
    if "vacuous" in flags:
        why = (
            f"exp of an unshifted logit or the row sum may overflow {model.fmt.name}, or the sum "
            "exceed 2^-emin of the reciprocal's format (flushed to zero), or the computed sum "
            "be off by 100%"
            if kind == "naive"
            else "the computed row sum may be off by 100% (its error factor reaches 1)"
        )
        reasons = (f"{kind} softmax: {why}",)
    if "unevaluable" in flags:
        reasons = (*reasons, UNEVALUABLE)
    if "scaled_over" in flags:
        why = (
            f"{kind} softmax ({num.exp_form}): a row's (running) maximum times log2 e may "
            f"overflow {model.fmt.name} (largest finite {model.fmt.max_finite:.6g}), and "
            "inf - inf is NaN"
        )
        reasons = (*reasons, why)
    if "over" in flags:
        lifted = f" (exponentials lifted by 2^{num.prob_offset}, prob_offset)" * bool(model.lift)
        why = (
            f"online softmax: an exponential or the running sum{lifted} may overflow "
            f"{model.fmt.name} (largest finite {model.fmt.max_finite:.6g})"
        )
        reasons = (*reasons, why)
    return reasons


def lse_bound(
    x: Any,
    numerics: Numerics | str | None = None,
    *,
    algorithm: str = "shifted",
    log_ulps: float = 0.5,
) -> Bound:
    """Absolute bound on the error of the log-sum-exp ``y = log Σ exp(x_i)`` (Theorem S.5).

    **Theorem S.5.** The algorithms are those of Blanchard, Higham & Higham (2021), run in the
    softmax format ``F`` of ``numerics`` with its summation order (mhanum has no log-sum-exp of
    its own; ``papers/reproduce_bhh2021.py`` runs them): ``basic`` (Alg. 3.1)
    ``ŷ = fl(log fl(Σ fl(exp x̂_i)))``; ``shifted`` (Alg. 4.1) ``a = max x̂ = x̂_k``,
    ``ŝ = fl(Σ_{i≠k} fl(exp fl(x̂_i - a)))``, ``ŷ = fl(a + fl(log1p ŝ))``. With ``log``/``log1p``
    within ``log_ulps`` ulps (``ε_log = 2·log_ulps·u``), the model of this module and
    ``x̂ = fl_F(x)`` with ``δ = max|x̂ - x|``:

    .. math::

        \\text{basic: } |\\hat y - y| \\le \\delta + \\ell + \\varepsilon_{\\log}(|y| + \\delta
            + \\ell), \\qquad \\ell = \\max(\\log(1+M), -\\log(1-\\Lambda)),

        \\text{shifted: } |\\hat y - y| \\le \\delta + (1+u)\\big(\\ell' + \\varepsilon_{\\log}(b
            + \\ell') + \\eta\\big) + u(|y| + \\delta) + \\eta, \\qquad
            \\ell' = \\frac{\\Delta s}{1 + \\max(s - \\Delta s, 0)},

    with ``[1 - Λ, 1 + M]`` the relative enclosure of the computed sum (Theorem S.1),
    ``s = Σ_{i≠k} e^{x̂_i - a}``, ``b = log1p(s)`` and ``Δs`` the bound on ``|ŝ - s|``. To first
    order and with exact rounding these are BHH Thm 3.2, ``|ŷ - y|/|y| <= (1 + (n + 1)/|y|)u``
    up to the sum's constant, and Thm 4.2, ``|ŷ - y|/|y| <= |(y + n - x_min)/y| u``-like (``ℓ'``
    is at most ``(n - 1 + ...)u·s/(1+s)``). Proof in ``papers/softmax.md`` §5.

    Args:
        x: logits ``(..., n)`` representable in the score format (``-inf`` allowed, one finite
            per row).
        numerics: a :class:`mhanum.Numerics` or a preset name (its softmax format, summation
            order, ``exp_ulps``).
        algorithm: ``"basic"`` or ``"shifted"``.
        log_ulps: assumed accuracy of ``log`` and ``log1p`` in ulps of ``F``.

    Returns:
        A :class:`Bound` with ``total`` shaped ``x.shape[:-1]`` (``inf`` where the basic
        algorithm may overflow or its sum underflow entirely, with the reason in ``reasons``)
        and terms ``input``, ``sum``, ``log`` (and ``add`` for shifted).

    Raises:
        InvalidArgument: as :func:`softmax_bound`, for an unknown ``algorithm`` or a bad
            ``log_ulps``.
    """
    if algorithm not in ("basic", "shifted"):
        msg = f"algorithm: expected 'basic' or 'shifted', got {algorithm!r}"
        raise InvalidArgument(msg)
    if (
        isinstance(log_ulps, bool)
        or not isinstance(log_ulps, (int, float))
        or not (math.isfinite(log_ulps) and log_ulps >= 0)
    ):
        msg = f"log_ulps: expected a finite number >= 0, got {log_ulps!r}"
        raise InvalidArgument(msg)
    num = resolve(numerics)
    arr = _logits(x, num)
    model = Model(num)
    rounded = _rounded_into(arr, model)
    eps_log = 2 * log_ulps * model.u
    rows_x, rows_r = arr.reshape(-1, arr.shape[-1]), rounded.reshape(-1, arr.shape[-1])
    rows = [
        lse_row(xs, xr, model, algorithm == "shifted", eps_log)
        for xs, xr in zip(rows_x, rows_r, strict=True)
    ]
    shape = arr.shape[:-1]
    names = rows[0][1].keys()
    total = np.array([r[0] for r in rows]).reshape(shape)
    reasons: tuple[str, ...] = ()
    if not np.isfinite(total).all():
        why = (
            "an exponential or the sum may overflow, or every exponential underflow (log 0)"
            if algorithm == "basic"
            else "the sum's error may exceed the sum"
        )
        reasons = (f"{algorithm} log-sum-exp in {model.fmt.name}: {why}",)
        if any(past_evaluation_range(*r) for r in zip(rows_x, rows_r, strict=True)):
            reasons = (*reasons, UNEVALUABLE)
    return Bound(
        reasons=reasons,
        total=total,
        terms={k: np.array([r[1][k] for r in rows]).reshape(shape) for k in names},
        theorem="papers/softmax.md Theorem S.5",
        assumptions=(*_ASSUMPTIONS, "log and log1p within log_ulps ulps"),
        source=_SOURCE,
    )


def logit_perturbation(delta: Any, probabilities: Any = None) -> Bound:
    """How much a perturbation of the logits moves the softmax (Theorem S.4).

    **Theorem S.4.** For logits ``s`` and ``s + Δs`` with ``p = softmax(s)``,
    ``p̃ = softmax(s + Δs)``:

    .. math::

        |\\log \\tilde p_i - \\log p_i| \\le |\\Delta s_i| + \\|\\Delta s\\|_\\infty
            \\le 2\\|\\Delta s\\|_\\infty, \\qquad
        |\\tilde p_i - p_i| \\le \\big(e^{|\\Delta s_i| + \\|\\Delta s\\|_\\infty} - 1\\big) p_i
            \\le \\big(e^{2\\|\\Delta s\\|_\\infty} - 1\\big) p_i .

    Exact (no rounding): it bounds the effect of earlier errors (scores, masks, the logits'
    rounding) on the softmax. Proof in ``papers/softmax.md`` §4.

    Args:
        delta: the perturbation ``Δs`` (``(..., n)``; the row's ``∞``-norm is taken over the last
            axis) or a nonnegative scalar ``‖Δs‖∞``.
        probabilities: ``p``, broadcastable with ``delta``; if given the bound is absolute, else
            relative (a factor of ``p_i``).

    Returns:
        A :class:`Bound` with ``total`` the bound on ``|p̃_i - p_i|`` (or on ``|p̃_i/p_i - 1|``)
        and the term ``log_p`` (the bound on ``|Δ log p_i|``).

    Raises:
        InvalidArgument: for a non-finite or negative scalar, NaN in ``delta``, or probabilities
            outside ``[0, 1]``.

    Examples:
        >>> float(logit_perturbation(0.5).terms["log_p"])
        1.0
    """
    d = np.asarray(delta, dtype=np.float64) if _is_real(delta) else None
    if d is None or np.isnan(d).any() or np.isinf(d).any():
        msg = f"delta: expected a finite real array or number, got {delta!r}"
        raise InvalidArgument(msg)
    if d.ndim == 0:
        if d < 0:
            msg = f"delta: expected a norm >= 0 when a scalar, got {float(d)}"
            raise InvalidArgument(msg)
        log_p = 2 * d
    else:
        log_p = np.abs(d) + np.max(np.abs(d), axis=-1, keepdims=True)
    rel = np.expm1(log_p)
    total = rel
    if probabilities is not None:
        p = np.asarray(probabilities, dtype=np.float64) if _is_real(probabilities) else None
        if p is None or np.isnan(p).any() or (p < 0).any() or (p > 1).any():
            msg = f"probabilities: expected values in [0, 1], got {probabilities!r}"
            raise InvalidArgument(msg)
        try:
            total = rel * p
        except ValueError as err:
            msg = (
                f"probabilities: expected a shape broadcastable with delta {d.shape}, got {p.shape}"
            )
            raise InvalidArgument(msg) from err
    return Bound(
        total=total,
        terms={"log_p": log_p},
        theorem="papers/softmax.md Theorem S.4",
        assumptions=("exact arithmetic: the perturbation is the only error",),
    )


def _is_real(x: Any) -> bool:
    try:
        arr = np.asarray(x)
    except (TypeError, ValueError):
        return False
    return arr.dtype.kind in "fiu" and arr.dtype != np.bool_
