"""Saved worst cases: ``.npz`` arrays plus JSON metadata, and their bit-for-bit replay.

A case is two files with the same stem: ``<stem>.npz`` holds the float64 arrays ``q``, ``k``,
``v`` and the computed ``output``, and the boolean ``mask`` if the case has one (numeric arrays
only, so :func:`numpy.load` reads it with ``allow_pickle=False``), and ``<stem>.json`` the
metadata::

    {"mhanum_version", "numerics": {field: value}, "preset", "shape": {...}, "seed",
     "objective", "error", "bound", "ratio", "dominant_term", "created", ...}

:func:`replay` recomputes the output with the saved numerics and compares it bit for bit with the
saved one, then re-measures the error against the certified reference and recomputes the bound.
:func:`save` never overwrites an existing case unless ``force=True``.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from mhanum._errors import InvalidArgument
from mhanum.numerics import Numerics
from mhanum.search import Objective, Shape, WorstCase

__all__ = ["Replay", "case_paths", "load", "metadata", "replay", "save"]

_ARRAYS = ("q", "k", "v", "output")


def numerics_dict(num: Numerics) -> dict[str, Any]:
    """``num`` as a JSON-ready mapping of its fields (``-inf`` as the string ``"-inf"``)."""
    fields = dataclasses.asdict(num)
    if fields["mask_value"] == -math.inf:
        fields["mask_value"] = "-inf"
    return fields


def _number(x: float) -> float | str:
    """``x``, or ``"inf"``/``"nan"`` for a non-finite value (strict JSON has no Infinity)."""
    return x if math.isfinite(x) else str(x)


def metadata(case: WorstCase) -> dict[str, Any]:
    """The JSON metadata of a case (see the module docstring; non-finite numbers as strings)."""
    from mhanum._version import __version__

    return {
        "mhanum_version": __version__,
        "numerics": numerics_dict(case.numerics),
        "preset": case.preset,
        "shape": case.shape.as_dict(),
        "seed": case.seed,
        "objective": case.objective,
        "error": _number(case.error),
        "bound": _number(case.bound),
        "ratio": _number(case.ratio),
        "dominant_term": case.dominant_term,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "violation": case.violation,
        "normwise": _number(case.normwise),
        "index": list(case.index),
        "method": case.method,
        "budget": case.budget,
        "evaluations": case.evaluations,
        **({} if case.against is None else {"against": numerics_dict(case.against)}),
        **({} if case.softcap is None else {"softcap": case.softcap}),
        **({} if case.sink is None else {"sink": case.sink}),
        "cheap_ratio": _number(case.cheap_ratio),
        "slack": _number(case.slack),
        "seconds": case.seconds,
        "structure": list(case.structure),
        "masked": case.mask is not None,
    }


def case_paths(path: str | Path) -> tuple[Path, Path]:
    """The ``.npz`` and ``.json`` paths of a case given either (or the stem)."""
    p = Path(path)
    stem = p.with_suffix("") if p.suffix in (".npz", ".json") else p
    return stem.with_name(stem.name + ".npz"), stem.with_name(stem.name + ".json")


def default_name(case: WorstCase) -> str:
    """``<preset or custom>-<objective>-<method>-seed<seed>``, file-name safe."""
    objective = case.objective.replace("/", "-over-")
    return f"{case.preset or 'custom'}-{objective}-{case.method}-seed{case.seed}"


def save(case: WorstCase, path: str | Path, *, force: bool = False, unique: bool = False) -> Path:
    """Write ``case`` to ``<path>.npz`` and ``<path>.json``; a directory gets the default name.

    Args:
        case: the case to save.
        path: the ``.npz`` file, its stem, or an existing directory.
        force: overwrite existing files.
        unique: if the files exist (and not ``force``), save as ``<stem>-1``, ``<stem>-2``, ...
            instead of raising (``mhanum search`` does so for a bound violation, which must not
            be lost).

    Returns:
        The ``.npz`` path.

    Raises:
        InvalidArgument: if either file exists and neither ``force`` nor ``unique`` is set.
    """
    target = Path(path)
    if target.is_dir():
        target = target / default_name(case)
    npz, meta = case_paths(target)
    stem, suffix = npz.with_suffix(""), 0
    while unique and not force and (npz.exists() or meta.exists()):
        suffix += 1
        npz, meta = case_paths(stem.with_name(f"{stem.name}-{suffix}"))
    existing = [str(p) for p in (npz, meta) if p.exists()]
    if existing and not force:
        msg = f"path: expected a new case, got existing {existing} (pass force=True / --force)"
        raise InvalidArgument(msg)
    npz.parent.mkdir(parents=True, exist_ok=True)
    arrays = {name: np.asarray(getattr(case, name), np.float64) for name in _ARRAYS}
    if case.mask is not None:
        arrays["mask"] = np.asarray(case.mask, bool)
    with npz.open("wb") as fh:
        np.savez(fh, **arrays)  # type: ignore[arg-type]
    meta.write_text(json.dumps(metadata(case), indent=2, allow_nan=False) + "\n")
    return npz


def load(path: str | Path) -> WorstCase:
    """Read a case saved by :func:`save` (the arrays with ``allow_pickle=False``).

    Raises:
        InvalidArgument: for a missing file or metadata that does not describe a case.
    """
    npz, meta = case_paths(path)
    for p in (npz, meta):
        if not p.exists():
            msg = f"path: expected a saved case, got no file {str(p)!r}"
            raise InvalidArgument(msg)
    info = json.loads(meta.read_text())
    with np.load(npz, allow_pickle=False) as data:
        arrays = {name: np.array(data[name]) for name in _ARRAYS}
        mask = np.array(data["mask"]) if "mask" in data.files else None
    try:
        num = Numerics(**info["numerics"])
        shape = Shape.of(info["shape"])
        against = Numerics(**info["against"]) if "against" in info else None
    except (KeyError, TypeError) as exc:
        msg = f"path: expected case metadata with numerics and shape, got an error: {exc}"
        raise InvalidArgument(msg) from None
    return WorstCase(
        numerics=num,
        shape=shape,
        q=arrays["q"],
        k=arrays["k"],
        v=arrays["v"],
        output=arrays["output"],
        mask=mask,
        objective=info["objective"],
        error=float(info["error"]),
        bound=float(info["bound"]),
        ratio=float(info["ratio"]),
        normwise=float(info.get("normwise", math.nan)),
        dominant_term=info["dominant_term"],
        index=tuple(info.get("index", ())),
        method=info.get("method", "targeted"),
        seed=int(info["seed"]),
        budget=int(info.get("budget", 0)),
        evaluations=int(info.get("evaluations", 0)),
        cheap_ratio=float(info.get("cheap_ratio", math.nan)),
        slack=float(info.get("slack", math.nan)),
        seconds=float(info.get("seconds", 0.0)),
        structure=tuple(info.get("structure", ())),
        against=against,
        softcap=info.get("softcap"),
        sink=info.get("sink"),
    )


@dataclasses.dataclass(frozen=True)
class Replay:
    """The result of :func:`replay`.

    Attributes:
        case: the saved case.
        bit_for_bit: whether the recomputed output equals the saved one bit for bit.
        error, bound, ratio, dominant_term: re-measured against the certified reference with the
            recomputed bound.
    """

    case: WorstCase
    bit_for_bit: bool
    error: float
    bound: float
    ratio: float
    dominant_term: str

    @property
    def violation(self) -> bool:
        """Whether the re-measured error exceeds the bound."""
        return self.ratio > 1

    @property
    def ok(self) -> bool:
        """Bit-for-bit and within the bound."""
        return self.bit_for_bit and not self.violation

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready summary."""
        return {
            "preset": self.case.preset,
            "numerics": self.case.numerics.describe(),
            "bit_for_bit": self.bit_for_bit,
            "error": self.error,
            "bound": self.bound,
            "ratio": self.ratio,
            "saved_ratio": self.case.ratio,
            "dominant_term": self.dominant_term,
            "violation": self.violation,
        }


def replay(path: str | Path) -> Replay:
    """Re-run a saved case bit for bit and re-check its bound.

    Raises:
        InvalidArgument: as :func:`load`, or if the case is now outside the bound's scope.
    """
    case = load(path)
    objective = Objective(
        case.numerics, case.objective, against=case.against, softcap=case.softcap, sink=case.sink
    )
    ev = objective(case.q, case.k, case.v, case.mask, certified=True)
    if ev is None:
        msg = "path: the saved case is outside the bound's scope (refused or overflowed)"
        raise InvalidArgument(msg)
    same = ev.output.shape == case.output.shape and ev.output.tobytes() == case.output.tobytes()
    return Replay(case, same, ev.error, ev.bound, ev.ratio, ev.dominant_term)
