"""Checking records against today's bounds, and the summary table."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from mhanum._errors import InvalidArgument
from mhanum.devices.records import BOUND_REVISION, BOUND_RTOL, Record, check_schema
from mhanum.devices.run import record_bound
from mhanum.inputs import digest, inputs, mask_array
from mhanum.numerics import Numerics

__all__ = ["FAILING", "VERDICTS", "CheckResult", "Verdict", "check", "render_summary", "summarize"]

VERDICTS = ("holds", "stale", "VIOLATED", "inconsistent", "vacuous", "exp-assumption", "skipped")
FAILING = ("VIOLATED", "inconsistent", "exp-assumption")


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The verdict on one record.

    Attributes:
        id: the record's ``id`` (its index when it has none).
        verdict: one of ``holds``, ``VIOLATED``, ``inconsistent``, ``vacuous``, ``exp-assumption``
            (the measured exp is less accurate than assumed), ``skipped`` (nothing measured).
        ratio: the largest ``err/bound`` the record supports (``max`` of its recorded per-entry
            ratio and its max error over the recomputed bound at that entry); NaN if none.
        tightness: recorded max bound over max error; NaN if none.
        reason: why, in words.
    """

    id: int
    verdict: str
    ratio: float
    tightness: float
    reason: str


@dataclasses.dataclass(frozen=True)
class CheckResult:
    """Verdicts of :func:`check` and their summary."""

    verdicts: tuple[Verdict, ...]
    summary: tuple[dict[str, Any], ...]

    @property
    def counts(self) -> dict[str, int]:
        """How many records got each verdict."""
        return {v: sum(x.verdict == v for x in self.verdicts) for v in VERDICTS}

    @property
    def ok(self) -> bool:
        """No violation, inconsistency or failed exp assumption."""
        return not any(v.verdict in FAILING for v in self.verdicts)

    @property
    def exit_code(self) -> int:
        """0 when :attr:`ok`, else 1."""
        return 0 if self.ok else 1

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {
            "ok": self.ok,
            "counts": self.counts,
            "summary": list(self.summary),
            "verdicts": [dataclasses.asdict(v) for v in self.verdicts],
        }

    def render(self) -> str:
        """The summary table and every record whose verdict is not ``holds``, as text."""
        lines = [render_summary(self.summary)]
        for v in self.verdicts:
            if v.verdict not in ("holds", "skipped", "stale"):
                lines.append(f"record {v.id}: {v.verdict}: {v.reason}")
        counts = ", ".join(f"{n} {v}" for v, n in self.counts.items() if n)
        lines.append(f"{len(self.verdicts)} records: {counts}")
        return "\n".join(lines)


def check(records: Sequence[Record]) -> CheckResult:
    """Judge each record by recomputing its bound on this machine.

    For an ``"attention"`` record: regenerate the inputs (:func:`inputs`, :func:`mask_array`)
    from the record's shape, dtype, structure, seed and mask; if their SHA-256 differs from the
    recorded one the record cannot be checked (``inconsistent``). Recompute Theorem A.1 from the
    record's ``model.numerics``; a bound ``inf`` anywhere is ``vacuous``; a recomputed maximum
    more than :data:`BOUND_RTOL` (relative) from the recorded one is ``inconsistent`` for a record
    of the current :data:`BOUND_REVISION`. Otherwise the ratio is the larger of the recorded
    ``max_i err_i/bound_i`` and the recorded maximum error over the recomputed bound at its entry:
    above 1 is ``VIOLATED``, else ``holds``. A record of an earlier revision whose bound changed
    is ``stale`` when both ratios are at most 1: it holds against the bound it was measured with
    (also a theorem) and at its largest error against today's, but the record keeps no per-entry
    errors, so only a new measurement judges every entry against today's bound.

    An ``"exp"`` record is ``exp-assumption`` when its ``max_ulps`` exceeds the smallest
    ``exp_ulps`` assumed by a measured record of the same device (or the record's own
    ``assumed_exp_ulps``), when an exp result below ``2^-126`` is off by more than ``2^-126``,
    or when ``exp(0) != 1``.

    Raises:
        InvalidArgument: for a record of another schema, one missing a field or with a field
            that cannot be read (``"records[i]: ..."``).
    """
    verdicts = []
    for i, record in enumerate(records):
        if not isinstance(record, Mapping):
            msg = f"records[{i}]: expected a dict, got {type(record).__name__}"
            raise InvalidArgument(msg)
        check_schema(record, f"records[{i}]")
        try:
            rid = int(record.get("id", i))
            if record["kind"] == "exp":
                verdicts.append(_check_exp(rid, record, records))
            elif record.get("status") != "measured":
                reason = str(record.get("reason", "not measured"))
                verdicts.append(Verdict(rid, "skipped", math.nan, math.nan, reason))
            else:
                verdicts.append(_check_attention(rid, record))
        except _UNREADABLE as exc:
            raise _unreadable(i, exc) from None
    return CheckResult(tuple(verdicts), summarize(records, verdicts))


_UNREADABLE = (KeyError, IndexError, TypeError, ValueError, AttributeError)
"""What reading a record's fields raises for a record without one, or with one of another type."""


def _unreadable(i: int, exc: Exception) -> InvalidArgument:
    """The error of ``records[i]``, whose reading raised ``exc``."""
    if isinstance(exc, KeyError):
        return InvalidArgument(
            f"records[{i}]: expected the field {exc.args[0]!r}, got a record without it"
        )
    return InvalidArgument(f"records[{i}]: expected a readable record, got {exc}")


def _check_attention(rid: int, record: Mapping[str, Any]) -> Verdict:
    s = record["shape"]
    shape = (s["batch"], s["heads"], s["length"], s["d"])
    tightness = float(record["tightness"])
    q, k, v = inputs(shape, record["dtype"], record["structure"], record["seed"])
    if digest(q, k, v) != record["inputs_sha256"]:
        reason = "the regenerated inputs differ from the recorded ones (sha256)"
        return Verdict(rid, "inconsistent", math.nan, tightness, reason)
    num = Numerics.from_dict(record["model"]["numerics"])
    data = tuple(np.asarray(x, np.float64) for x in (q, k, v))
    total, _, _, _ = record_bound(
        num, data[0], data[1], data[2], mask_array(record["mask"], shape[2])
    )
    recomputed = float(np.max(total))
    recorded = float(record["bound"]["max"])
    err = record["errors"]
    if not math.isfinite(recomputed):
        return Verdict(rid, "vacuous", math.nan, tightness, "the bound is inf for some entry")
    changed = not abs(recorded - recomputed) <= BOUND_RTOL * abs(recomputed)
    revision = int(record["bound"].get("revision", 1))
    if changed and revision >= BOUND_REVISION:
        reason = f"recorded bound {recorded!r}, recomputed {recomputed!r}"
        return Verdict(rid, "inconsistent", math.nan, tightness, reason)
    at = tuple(err["argmax_abs"])
    at_bound = float(total[at]) if at else 0.0
    max_abs = float(err["max_abs"])
    at_ratio = 0.0 if max_abs == 0 else (max_abs / at_bound if at_bound > 0 else math.inf)
    ratio = max(float(record["ratio"]), at_ratio)
    if ratio > 1:
        reason = f"error/bound = {ratio:.4g} > 1 (max error {max_abs:.4g} at {list(at)})"
        return Verdict(rid, "VIOLATED", ratio, tightness, reason)
    if changed:
        reason = (
            f"bound revision {revision} < {BOUND_REVISION}: recorded bound {recorded:.4g}, today "
            f"{recomputed:.4g}; holds against the recorded bound ({float(record['ratio']):.4g}) "
            f"and at the largest error against today's ({at_ratio:.4g}); re-measure to judge "
            "every entry"
        )
        return Verdict(rid, "stale", ratio, tightness, reason)
    return Verdict(rid, "holds", ratio, tightness, f"error/bound = {ratio:.4g}")


def _check_exp(rid: int, record: Mapping[str, Any], records: Sequence[Record]) -> Verdict:
    device = record["device"]
    assumed = min(
        (
            Numerics.from_dict(r["model"]["numerics"]).exp_ulps
            for r in records
            if r.get("kind") == "attention"
            and r.get("status") == "measured"
            and r.get("device") == device
        ),
        default=float(record["assumed_exp_ulps"]),
    )
    measured = float(record["max_ulps"])
    problems = []
    if measured > assumed:
        problems.append(f"max {measured:.4g} ulps > assumed exp_ulps {assumed:g}")
    if float(record["max_abs_subnormal_in_eta"]) > 1:
        problems.append("an exp result below 2^-126 is off by more than 2^-126")
    if not record["exp_zero_is_one"]:
        problems.append("exp(0) != 1")
    if problems:
        return Verdict(rid, "exp-assumption", measured, math.nan, "; ".join(problems))
    reason = f"max {measured:.4g} ulps <= assumed exp_ulps {assumed:g} on {device['kind']}"
    return Verdict(rid, "holds", measured, math.nan, reason)


def summarize(
    records: Sequence[Record], verdicts: Sequence[Verdict] | None = None
) -> tuple[dict[str, Any], ...]:
    """One row per device × implementation × precision × model: count, worst ratio, tightness.

    Without ``verdicts`` the recorded ratios are used (as :func:`measure` wrote them).
    """
    # per group: each record's verdict, and its recorded ratio and tightness (NaN: skipped)
    groups: dict[tuple[str, ...], list[tuple[Record, Verdict | None, float, float]]] = {}
    for i, r in enumerate(records):
        if r.get("kind") != "attention":
            continue
        was_measured = r.get("status") == "measured"
        try:
            label = r["model"]["label"] if was_measured else "-"
            key = (r["device"]["kind"], r["implementation"], r["precision"], label)
            ratio = float(r["ratio"]) if was_measured else math.nan
            tightness = float(r["tightness"]) if was_measured else math.nan
        except _UNREADABLE as exc:
            raise _unreadable(i, exc) from None
        verdict = None if verdicts is None else verdicts[i]
        groups.setdefault(key, []).append((r, verdict, ratio, tightness))
    rows = []
    for (device, impl, precision, label), members in groups.items():
        measured = [m for m in members if m[0].get("status") == "measured"]
        ratios = [
            v.ratio if v is not None and not math.isnan(v.ratio) else ratio
            for _, v, ratio, _ in measured
        ]
        tight = [tightness for *_, tightness in measured]
        row: dict[str, Any] = {
            "device": device,
            "implementation": impl,
            "precision": precision,
            "model": label,
            "count": len(measured),
            "skipped": len(members) - len(measured),
            "worst_ratio": max(ratios, default=math.nan),
            "median_tightness": statistics.median(tight) if tight else math.nan,
        }
        if verdicts is not None:
            row["failing"] = sum(v is not None and v.verdict in FAILING for _, v, _, _ in members)
        rows.append(row)
    return tuple(rows)


def render_summary(rows: Sequence[Mapping[str, Any]]) -> str:
    """The summary rows as a plain-text table."""
    has_failing = any("failing" in r for r in rows)
    header = (
        f"{'device':<14} {'implementation':<14} {'precision':<9} {'model':<24} "
        f"{'n':>4} {'skip':>4} {'worst err/bound':>15} {'median bound/err':>16}"
        + (f" {'failing':>7}" if has_failing else "")
    )
    lines = [header]
    for r in rows:
        lines.append(
            f"{r['device'][:14]:<14} {r['implementation']:<14} {r['precision']:<9} "
            f"{r['model'][:24]:<24} {r['count']:>4} {r['skipped']:>4} "
            f"{r['worst_ratio']:>15.4g} {r['median_tightness']:>16.4g}"
            + (f" {r.get('failing', 0):>7}" if has_failing else "")
        )
    return "\n".join(lines)
