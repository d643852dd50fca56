"""Theorem A.5: how far two reduction schedules of the same attention can be apart.

Two kernels that compute the same attention with different numerics (block sizes, split counts,
summation orders, online or safe softmax, a batch-size-dependent tiling, another accumulation
format) give outputs ``â`` and ``b̂`` that differ although neither is wrong. Both lie near the one
exact value ``o``, so ``|â - b̂| <= |â - o| + |o - b̂|``: the sum of their Theorem A.1 bounds,
entry by entry. A difference above it is not rounding: one of the two computes something else.

Theorem A.5' sharpens it where the two schedules compute the same logits bit for bit (they differ
only after the scores: in the softmax algorithm, its block size, the formats of the softmax, the
probabilities or the output): both then lie near the exact attention of those *computed* logits,
and the logits' own error, most of the bound in float32 and bfloat16, cancels.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mhanum._errors import InvalidArgument
from mhanum.bounds._result import Bound, where_smaller
from mhanum.bounds.factors import compound, evaluation_rounding
from mhanum.bounds.forward import attention_bound
from mhanum.bounds.forward.known_rounding import coarser_probabilities
from mhanum.bounds.softmax import division_error
from mhanum.numerics import Numerics, resolve

__all__ = ["schedule_difference", "shares_logits"]

# The fields the computed logits depend on (the scores' dot, formats, scale, bias and mask).
_LOGIT_FIELDS = ("input", "accum", "summation", "dot", "operand_format", "score_format",
                 "scale", "scale_format", "mask_mode", "mask_value")  # fmt: skip


def shares_logits(a: Numerics | str, b: Numerics | str) -> bool:
    """Whether two schedules compute the same logits bit for bit (Theorem A.5').

    They do where every field the logits depend on agrees (the inputs' and the accumulation
    format, the summation order, the dot unit, the operand, score and scale formats, the scale's
    placement and the mask's application), the order is deterministic (not ``"native"``: XLA
    may order one dot differently in two programs), the exponential is ``"exp"`` (the folded
    exp2 rounds its argument per schedule) and neither splits the keys.

    Examples:
        >>> shares_logits(Numerics(summation="sequential", softmax="online(64)"),
        ...               Numerics(summation="sequential", softmax="online(128)"))
        True
        >>> shares_logits(Numerics(softmax="online(64)"), Numerics(softmax="online(128)"))
        False
    """
    a, b = resolve(a), resolve(b)
    if any(getattr(a, f) != getattr(b, f) for f in _LOGIT_FIELDS):
        return False
    return (
        not a.order.carried
        and a.exp_form == b.exp_form == "exp"
        and a.kv_splits is None
        and b.kv_splits is None
    )


def schedule_difference(
    q: Any,
    k: Any,
    v: Any,
    mask: Any = None,
    *,
    numerics_a: Numerics | str,
    numerics_b: Numerics | str,
    bias: Any = None,
    scale: float | None = None,
    sink: Any = None,
    probability: float | None = None,
    softcap: float | None = None,
    rope: Any = None,
    positions: Any = None,
) -> Bound:
    """Theorem A.5: a componentwise bound on ``|attention(..., numerics_a) - attention(...,
    numerics_b)|``.

    ``|â - b̂| <= A_a + A_b`` with ``A_a``, ``A_b`` Theorem A.1 for each schedule around the same
    exact attention (papers/attention.md, A.5). Where the two compute the same logits
    (:func:`shares_logits`), Theorem A.5': each ``A`` is taken around the exact attention of the
    computed logits instead: A.1 without its ``logits``, ``evaluation`` and ``mask`` terms, with
    the output's rounding at its plain bound (which covers the rounding by itself); ``Bound.
    theorem`` is then ``"A.5'"``. A.5' evaluates its sides without A.1's known roundings
    (steps 3k, 6k and 6r), which it cannot take apart; A.5 is taken wherever it is smaller
    (one term ``A.5`` there), with those steps where the probabilities are stored in a coarser
    format than the softmax computes them in (not with ``probability``, whose two
    alternatives would each need their share of the failure probability). The terms are A.1's,
    prefixed ``a.`` and ``b.``;
    ``Bound.reasons`` joins both sides' (an entry infinite on either side is infinite). Equal
    deterministic schedules compute equal values; the bound does not assume it.

    Args:
        q, k, v, mask, bias, scale, sink, softcap: as for :func:`attention_bound` (the same inputs for
            both schedules).
        rope, positions: as for :func:`attention_bound`: both schedules rotate ``q`` and ``k``
            as the :class:`mhanum.rope.Rope` states, and each side's A.1 is around the exact
            attention of the exactly rotated inputs. Their rotations need not agree (a kernel's
            ``cos`` within its ulps), so A.5' (which assumes equal computed logits) is not
            taken: ``Bound.theorem`` is ``"A.5"``.
        numerics_a, numerics_b: the two schedules, :class:`Numerics` or preset names.
        probability: with A.3 on each side, each at ``1 - (1 - probability)/2``, so that both
            hold, and the difference bound with them, with at least this probability.

    Returns:
        A :class:`~mhanum.bounds.Bound` shaped like the output, theorem ``"A.5"``.

    Raises:
        InvalidArgument: as :func:`attention_bound` for either schedule.

    Examples:
        >>> import numpy as np
        >>> rng = np.random.default_rng(0)
        >>> q, k, v = (rng.standard_normal((16, 8)) for _ in range(3))
        >>> d = schedule_difference(
        ...     q, k, v, numerics_a="fp32", numerics_b=Numerics(softmax="online(4)"))
        >>> sorted(d.terms)[:2], d.theorem
        (['a.evaluation', 'a.logits'], 'A.5')
    """
    sides = {"a": resolve(numerics_a), "b": resolve(numerics_b)}
    each = None
    if probability is not None:
        ok = isinstance(probability, (int, float, np.floating)) and not isinstance(
            probability, bool
        )
        if not ok or not (0 < probability < 1):
            msg = f"probability: expected a number in (0, 1), got {probability!r}"
            raise InvalidArgument(msg)
        each = 1 - (1 - float(probability)) / 2
    shared = rope is None and shares_logits(sides["a"], sides["b"])
    bounds = {
        name: attention_bound(
            q,
            k,
            v,
            mask,
            bias=bias,
            numerics=num,
            scale=scale,
            sink=sink,
            probability=each,
            softcap=softcap,
            rope=rope,
            positions=positions,
            known_rounding=not shared,  # A.5' takes the logits term apart
        )
        for name, num in sides.items()
    }
    per_side = {
        name: _around_computed_logits(b, sides[name], np.shape(k)[-2] + 1, v)
        if shared
        else dict(b.terms)
        for name, b in bounds.items()
    }
    terms = {f"{name}.{t}": x for name, side in per_side.items() for t, x in side.items()}
    totals = [
        sum(np.asarray(x, np.float64) for x in per_side[name].values())
        if shared
        else np.asarray(bounds[name].total, np.float64)
        for name in ("a", "b")
    ]
    total = totals[0] + totals[1]
    if shared and probability is None:
        # A.5 itself where it is smaller than A.5' (term "A.5"): on the sides' bounds as they
        # are, or with A.1's known roundings (steps 3k, 6k, 6r) where those may help
        plain = [np.asarray(b.total, np.float64) for b in bounds.values()]
        if _known_may_help(sides):
            plain = [
                np.asarray(attention_bound(
                    q, k, v, mask, bias=bias, numerics=num, scale=scale, sink=sink,
                    softcap=softcap,
                ).total, np.float64)
                for num in sides.values()
            ]  # fmt: skip
        terms, _ = where_smaller(terms, plain[0] + plain[1], "A.5")
        total = sum(terms.values())
    reasons = tuple(dict.fromkeys(r for b in bounds.values() for r in b.reasons))
    fail = sum(1 - b.probability for b in bounds.values())
    assumptions = tuple(dict.fromkeys(a for b in bounds.values() for a in b.assumptions))
    return Bound(
        total,
        terms,
        "A.5'" if shared else "A.5",
        assumptions,
        bounds["a"].source,
        max(0.0, 1.0 - fail) if probability is not None else 1.0,
        reasons=reasons,
        lam=None if probability is None else max(b.lam or 0.0 for b in bounds.values()),
    )


def _known_may_help(sides: dict[str, Numerics]) -> bool:
    """Whether A.1's known roundings (steps 3k, 6k and 6r: probabilities stored in a coarser
    format than the softmax computes them in) may make A.5 smaller than A.5', which takes the
    logits term apart and so evaluates its sides without them."""
    return any(coarser_probabilities(n) for n in sides.values())


def _around_computed_logits(bound: Bound, num: Numerics, keys: int, v: Any) -> dict[str, Any]:
    """Theorem A.5': A.1's terms around the exact attention of the computed logits.

    ``logits`` carries ``κ(1 + ε)L`` (``κ`` the output's rounding factor, ``ε`` the evaluation's)
    with ``L`` the distance between the exact attentions of the computed and the exact logits:
    ``L`` goes, ``(κ(1 + ε) - 1)L`` stays (it covers ``u_o L`` of the last rounding, whose
    argument is bounded through the exact attention); ``evaluation`` and ``mask`` (the target's
    own distances) go; the output's rounding takes its plain bound, which holds by itself.
    Step W's ``magnitudes`` (``|ô| + |o|``, ``|o|`` possibly through the exact attention's
    float64 value) takes the largest ``|v_jl|`` for ``|o|``: the exact attention of the computed
    logits is a convex combination of the values too (a sink's value is 0).
    """
    soft = num.format_of("softmax").u
    online = num.softmax_kind == "online"
    div = division_error(num.div_ulps, soft) if online else 0.0
    # κ(1 + ε) - 1 in log space (a float64 output's u = 2^-53 is lost to 1 + u), with the
    # evaluation factor of at least as many keys as A.1 summed over (a sink's one more)
    c = compound(num.format_of("output").u, div, evaluation_rounding(keys))
    kept = {n: t for n, t in bound.terms.items() if n not in ("logits", "evaluation", "mask")}
    with np.errstate(invalid="ignore"):
        if "logits" in bound.terms:
            logits = np.asarray(bound.terms["logits"], np.float64)
            # L - L/(κ(1 + ε)) = L·c/(1 + c), rounded up: subtracting less than L is safe
            kept["logits"] = logits * (c / (1 + c)) * (1 + 2.0**-50)
        kept["output"] = np.asarray(bound.parts["output"]["rounding"], np.float64)
        if "magnitudes" in kept:
            mag = np.asarray(kept["magnitudes"], np.float64)
            v_top = np.abs(np.asarray(v, np.float64)).max(axis=-2, keepdims=True)
            kept["magnitudes"] = np.where(mag > 0, (mag + v_top) * (1 + 2.0**-52), 0.0)
    return kept
