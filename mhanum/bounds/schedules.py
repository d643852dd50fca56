"""Theorem A.5: how far two reduction schedules of the same attention can be apart.

Two kernels that compute the same attention with different numerics (block sizes, split counts,
summation orders, online or safe softmax, a batch-size-dependent tiling, another accumulation
format) give outputs ``â`` and ``b̂`` that differ although neither is wrong. Both lie near the one
exact value ``o``, so ``|â - b̂| <= |â - o| + |o - b̂|``: the sum of their Theorem A.1 bounds,
entry by entry. A difference above it is not rounding: one of the two computes something else.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mhanum._errors import InvalidArgument
from mhanum.bounds._result import Bound
from mhanum.bounds.attention import attention_bound
from mhanum.numerics import Numerics, resolve

__all__ = ["schedule_difference"]


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
) -> Bound:
    """Theorem A.5: a componentwise bound on ``|attention(..., numerics_a) - attention(...,
    numerics_b)|``.

    ``|â - b̂| <= A_a + A_b`` with ``A_a``, ``A_b`` Theorem A.1 for each schedule around the same
    exact attention (papers/attention.md, A.5). The terms are A.1's, prefixed ``a.`` and ``b.``;
    ``Bound.reasons`` joins both sides' (an entry infinite on either side is infinite). Equal
    deterministic schedules compute equal values; the bound does not assume it.

    Args:
        q, k, v, mask, bias, scale, sink, softcap: as for :func:`attention_bound` (the same inputs for
            both schedules).
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
        )
        for name, num in sides.items()
    }
    terms = {f"{name}.{t}": x for name, b in bounds.items() for t, x in b.terms.items()}
    total = np.asarray(bounds["a"].total, np.float64) + np.asarray(bounds["b"].total, np.float64)
    reasons = tuple(dict.fromkeys(r for b in bounds.values() for r in b.reasons))
    fail = sum(1 - b.probability for b in bounds.values())
    assumptions = tuple(dict.fromkeys(a for b in bounds.values() for a in b.assumptions))
    return Bound(
        total,
        terms,
        "A.5",
        assumptions,
        bounds["a"].source,
        max(0.0, 1.0 - fail) if probability is not None else 1.0,
        reasons=reasons,
        lam=None if probability is None else max(b.lam or 0.0 for b in bounds.values()),
    )
