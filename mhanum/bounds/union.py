"""The union bound of the probabilistic variants (Theorem A.3, papers/attention.md): the
failure probability of ``N`` events each within ``λ`` (Azuma-Hoeffding per event), and the ``λ``
that states a given probability, over one class of events or two (A.3's product chains and
the per-entry martingales of Theorems A.3', A.3'', A.3e and A.3‴, each class with its own
``λ``)."""

from __future__ import annotations

import math

import numpy as np

from mhanum._errors import InvalidArgument
from mhanum.bounds.factors import check_lam
from mhanum.numerics import Numerics

__all__ = [
    "ENTRIES_SHARE",
    "check_probability",
    "lam_or_probability",
    "lam_split",
    "lams_for",
    "split_failure",
    "union_failure",
]


def union_failure(lam: float, chains: int, num: Numerics) -> float:
    """The union bound's failure probability ``N·2exp(-λ²(1-u)²/2)`` over ``N`` chains."""
    u = max(num.format_of(r).u for r in ("accum", "softmax"))
    return chains * 2 * math.exp(-((lam * (1 - u)) ** 2) / 2)


ENTRIES_SHARE = 0.1
"""The share of a stated failure probability that :func:`lam_split` gives the entries' events."""


def check_probability(probability: object) -> float:
    """``probability``, checked: a number in ``(0, 1)``."""
    ok = isinstance(probability, (int, float, np.floating)) and not isinstance(probability, bool)
    if not ok or not (0 < float(probability) < 1):  # type: ignore[arg-type]
        msg = f"probability: expected a number in (0, 1), got {probability!r}"
        raise InvalidArgument(msg)
    return float(probability)  # type: ignore[arg-type]


def lam_split(probability: float, chains: int, entries: int, num: Numerics) -> tuple[float, float]:
    """``(λ_c, λ_e)`` for ``probability`` over two classes of events: ``chains`` (A.3's product
    chains) and ``entries`` (one martingale per output entry, Theorem A.3‴), solved on
    :data:`ENTRIES_SHARE` of the failure probability for the entries and the rest for the
    chains, ``λ_e`` then raised by float64 spacings until the stated probability
    ``1 - union_failure(λ_c, chains) - union_failure(λ_e, entries)`` is at least
    ``probability``. The entries are few beside the chains (``L d_out`` against ``L d²``), so
    their ``λ`` on a tenth of the failure is about an eighth below the common one, while the
    chains' grows by 0.2%."""
    failure = 1 - check_probability(probability)
    lam_c = lam_or_probability(None, 1 - failure * (1 - ENTRIES_SHARE), chains, num)
    lam_e = lam_or_probability(None, 1 - failure * ENTRIES_SHARE, entries, num)
    assert lam_c is not None
    assert lam_e is not None
    while 1.0 - split_failure((lam_c, lam_e), (chains, entries), num) < probability:
        lam_e = math.nextafter(lam_e, math.inf)
    return lam_c, lam_e


def split_failure(lams: tuple[float, float], counts: tuple[int, int], num: Numerics) -> float:
    """The union bound's failure probability over two classes of events, each with its ``λ``."""
    return union_failure(lams[0], counts[0], num) + union_failure(lams[1], counts[1], num)


def lam_or_probability(
    lam: float | None, probability: float | None, chains: int, num: Numerics
) -> float | None:
    """The ``λ`` of the probabilistic variant: ``lam`` as given, or the ``λ`` that solves the
    union bound over ``chains`` events for ``probability`` (raised by float64 spacings until
    the stated probability, evaluated as :class:`Bound` states it, is at least ``probability``)."""
    if probability is None:
        return None if lam is None else check_lam(lam, "lam")
    if lam is not None:
        msg = (
            "lam, probability: expected one of them (or neither), got "
            f"lam={lam!r} and probability={probability!r}"
        )
        raise InvalidArgument(msg)
    probability = check_probability(probability)
    u = max(num.format_of(r).u for r in ("accum", "softmax"))
    found = math.sqrt(2 * math.log(2 * chains / (1 - probability))) / (1 - u)
    while 1.0 - union_failure(found, chains, num) < probability:  # the formula's own rounding
        found = math.nextafter(found, math.inf)
    return found


def lams_for(
    lam: float | None, probability: float | None, counts: tuple[int, int], num: Numerics
) -> tuple[float | None, float | None, float | None]:
    """``(λ_c, λ_e, failure)`` for ``counts = (chains, entries)``: with ``lam`` (or neither)
    one ``λ`` for every event (``failure`` ``None``: the union over them all, as
    :class:`~mhanum.bounds.Bound` states it); with ``probability`` and some ``entries``, the
    chains' ``λ`` and the entries' ``λ_e``, each on its share of the failure probability
    (:func:`lam_split`), and the failure they state together; one ``λ`` where the split's
    ``λ_e`` would not be below it (entries about as many as chains: small problems). The
    choice reads the counts only."""
    chains, entries = counts
    found = lam_or_probability(lam, probability, chains + entries, num)
    if probability is None or not entries:
        return found, found, None
    assert found is not None
    found_c, found_e = lam_split(probability, chains, entries, num)
    if found_e >= found:
        return found, found, None
    return found_c, found_e, split_failure((found_c, found_e), counts, num)
