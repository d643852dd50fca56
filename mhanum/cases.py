"""Saved worst cases: ``.npz`` arrays plus JSON metadata, and their bit-for-bit replay.

A gradient case (:func:`save_gradient`, from :func:`mhanum.search.gradient_worst_case`) holds
``q``, ``k``, ``v``, ``d_out`` and the computed ``dq``, ``dk``, ``dv``, ``dbias``; its metadata
has ``"kind": "gradient"`` and the ``backward`` fields, and :func:`replay` re-runs it the same
way (every gradient bit for bit, then Theorem B.1/B.2 against the certified gradients).

A multi-head attention case (:func:`save_mha`, from :func:`mhanum.search.mha_worst_case`) holds
``x_q``, ``x_kv``, the weights (``wq``, ``wk``, ``wv``, ``wo`` and the biases it has) and the
computed ``output``; its metadata has ``"kind": "mha"``, ``num_heads`` and, for a search near a
real layer, ``near`` and ``near_ratio``, and :func:`replay` re-runs the whole layer (the output
bit for bit, then Theorem A.2 against the certified reference).

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
from mhanum.numerics import Backward, Numerics
from mhanum.params import MHAParams
from mhanum.search import (
    GradientWorstCase,
    MHAShape,
    MHAWorstCase,
    Objective,
    Shape,
    WorstCase,
    gradient_evaluation,
    mha_evaluation,
)

__all__ = [
    "Replay",
    "case_paths",
    "load",
    "load_gradient",
    "load_mha",
    "metadata",
    "replay",
    "save",
    "save_gradient",
    "save_mha",
]

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


def saved_case_paths(path: str | Path) -> tuple[Path, Path]:
    """:func:`case_paths` of a case that was saved: both files exist.

    Raises:
        InvalidArgument: naming the file that is missing.
    """
    npz, meta = case_paths(path)
    for p in (npz, meta):
        if not p.exists():
            msg = f"path: expected a saved case, got no file {str(p)!r}"
            raise InvalidArgument(msg)
    return npz, meta


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
    npz, meta = _reserve(target, force=force, unique=unique)
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
        InvalidArgument: for a missing file, metadata that does not describe a case, or a
            gradient or multi-head attention case (:func:`load_gradient`, :func:`load_mha`).
    """
    npz, meta = saved_case_paths(path)
    info = json.loads(meta.read_text())
    other = {"gradient": "load_gradient", "mha": "load_mha"}.get(info.get("kind"))
    if other is not None:
        msg = f"path: expected a single-attention case, got a {info['kind']} case (read it with {other})"
        raise InvalidArgument(msg)
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
        case: the saved case (a :class:`~mhanum.search.GradientWorstCase` for a gradient case,
            a :class:`~mhanum.search.MHAWorstCase` for a multi-head attention case).
        bit_for_bit: whether the recomputed output (every gradient) equals the saved one bit
            for bit.
        error, bound, ratio, dominant_term: re-measured against the certified reference with the
            recomputed bound.
    """

    case: WorstCase | GradientWorstCase | MHAWorstCase
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
        case = self.case
        extra: dict[str, Any] = {}
        if isinstance(case, GradientWorstCase):
            extra = {"backward": case.backward.algorithm}
        elif isinstance(case, MHAWorstCase):
            extra = {"num_heads": case.num_heads}
        return {
            "preset": case.preset,
            "numerics": case.numerics.describe(),
            **extra,
            "bit_for_bit": self.bit_for_bit,
            "error": self.error,
            "bound": self.bound,
            "ratio": self.ratio,
            "saved_ratio": self.case.ratio,
            "dominant_term": self.dominant_term,
            "violation": self.violation,
        }


def _reserve(target: Path, *, force: bool, unique: bool) -> tuple[Path, Path]:
    """The case's two paths, never an existing one unless ``force`` (``unique``: a new stem)."""
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
    return npz, meta


_GRADIENT_ARRAYS = ("q", "k", "v", "d_out")
_GRADIENT_NAMES = ("dq", "dk", "dv", "dbias")


def save_gradient(
    case: GradientWorstCase, path: str | Path, *, force: bool = False, unique: bool = False
) -> Path:
    """Write a gradient case to ``<path>.npz`` and ``<path>.json`` (a directory gets the name
    ``<preset>-gradient-<algorithm>-seed<seed>``); ``force`` and ``unique`` as for :func:`save`.

    Raises:
        InvalidArgument: if either file exists and neither ``force`` nor ``unique`` is set.
    """
    from mhanum._version import __version__

    target = Path(path)
    if target.is_dir():
        name = f"{case.preset or 'custom'}-gradient-{case.backward.algorithm}-seed{case.seed}"
        target = target / name
    npz, meta = _reserve(target, force=force, unique=unique)
    arrays = {name: np.asarray(getattr(case, name), np.float64) for name in _GRADIENT_ARRAYS}
    arrays |= dict(zip(_GRADIENT_NAMES, case.gradients, strict=True))
    if case.mask is not None:
        arrays["mask"] = np.asarray(case.mask, bool)
    with npz.open("wb") as fh:
        np.savez(fh, **arrays)  # type: ignore[arg-type]
    backward = dataclasses.asdict(case.backward)
    if backward["dq_order"] is not None:
        backward["dq_order"] = list(backward["dq_order"])
    info = {
        "kind": "gradient",
        "mhanum_version": __version__,
        "numerics": numerics_dict(case.numerics),
        "backward": backward,
        "preset": case.preset,
        "shape": case.shape.as_dict(),
        "seed": case.seed,
        "gradient": case.gradient,
        "index": list(case.index),
        "error": _number(case.error),
        "bound": _number(case.bound),
        "ratio": _number(case.ratio),
        "dominant_term": case.dominant_term,
        "violation": case.violation,
        "budget": case.budget,
        "evaluations": case.evaluations,
        "seconds": case.seconds,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "masked": case.mask is not None,
        **({} if case.softcap is None else {"softcap": case.softcap}),
    }
    meta.write_text(json.dumps(info, indent=2, allow_nan=False) + "\n")
    return npz


def load_gradient(path: str | Path) -> GradientWorstCase:
    """Read a gradient case saved by :func:`save_gradient` (arrays with ``allow_pickle=False``).

    Raises:
        InvalidArgument: for a missing file or metadata that does not describe a gradient case.
    """
    npz, meta = saved_case_paths(path)
    info = json.loads(meta.read_text())
    try:
        num = Numerics(**info["numerics"])
        backward = info["backward"]
        if backward.get("dq_order") is not None:
            backward["dq_order"] = tuple(backward["dq_order"])
        bw = Backward(**backward)
        shape = Shape.of(info["shape"])
        with np.load(npz, allow_pickle=False) as data:
            arrays = {name: np.array(data[name]) for name in _GRADIENT_ARRAYS + _GRADIENT_NAMES}
            mask = np.array(data["mask"]) if "mask" in data.files else None
    except (KeyError, TypeError) as exc:
        msg = f"path: expected gradient-case metadata and arrays, got an error: {exc}"
        raise InvalidArgument(msg) from None
    return GradientWorstCase(
        numerics=num, backward=bw, shape=shape, q=arrays["q"], k=arrays["k"], v=arrays["v"],
        d_out=arrays["d_out"], mask=mask, gradient=info["gradient"],
        index=tuple(info["index"]), error=float(info["error"]), bound=float(info["bound"]),
        ratio=float(info["ratio"]), dominant_term=info["dominant_term"],
        evaluations=int(info["evaluations"]), budget=int(info["budget"]), seed=int(info["seed"]),
        seconds=float(info["seconds"]),
        gradients=tuple(arrays[name] for name in _GRADIENT_NAMES),
        softcap=info.get("softcap"),
    )  # fmt: skip


def _kind(path: str | Path) -> str | None:
    """The ``kind`` of a saved case's metadata (``None``: a single-attention case)."""
    meta = case_paths(path)[1]
    if not meta.exists():
        return None
    kind = json.loads(meta.read_text()).get("kind")
    return kind if isinstance(kind, str) else None


_MHA_ARRAYS = ("x_q", "x_kv", "output")
_PARAMS = tuple(f.name for f in dataclasses.fields(MHAParams))


def save_mha(
    case: MHAWorstCase, path: str | Path, *, force: bool = False, unique: bool = False
) -> Path:
    """Write a multi-head attention case to ``<path>.npz`` and ``<path>.json`` (a directory gets
    the name ``<preset>-mha<heads>-seed<seed>``, with ``-near`` for a search near a real layer);
    ``force`` and ``unique`` as for :func:`save`.

    Raises:
        InvalidArgument: if either file exists and neither ``force`` nor ``unique`` is set.
    """
    from mhanum._version import __version__

    target = Path(path)
    if target.is_dir():
        near = "" if case.near is None else "-near"
        target = target / f"{case.preset or 'custom'}-mha{case.num_heads}{near}-seed{case.seed}"
    npz, meta = _reserve(target, force=force, unique=unique)
    arrays = {name: np.asarray(getattr(case, name), np.float64) for name in _MHA_ARRAYS}
    for name in _PARAMS:
        w = getattr(case.params, name)
        if w is not None:
            arrays[name] = np.asarray(w, np.float64)
    if case.mask is not None:
        arrays["mask"] = np.asarray(case.mask, bool)
    with npz.open("wb") as fh:
        np.savez(fh, **arrays)  # type: ignore[arg-type]
    info = {
        "kind": "mha",
        "mhanum_version": __version__,
        "numerics": numerics_dict(case.numerics),
        "preset": case.preset,
        "shape": case.shape.as_dict(),
        "num_heads": case.num_heads,
        "seed": case.seed,
        "index": list(case.index),
        "error": _number(case.error),
        "bound": _number(case.bound),
        "ratio": _number(case.ratio),
        "normwise": _number(case.normwise),
        "dominant_term": case.dominant_term,
        "violation": case.violation,
        "budget": case.budget,
        "evaluations": case.evaluations,
        "uncertified": case.uncertified,
        "out_of_scope": case.out_of_scope,
        "structure": list(case.structure),
        "near": case.near,
        "near_ratio": None if case.near_ratio is None else _number(case.near_ratio),
        "seconds": case.seconds,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "masked": case.mask is not None,
    }
    meta.write_text(json.dumps(info, indent=2, allow_nan=False) + "\n")
    return npz


def load_mha(path: str | Path) -> MHAWorstCase:
    """Read a multi-head attention case saved by :func:`save_mha` (arrays with
    ``allow_pickle=False``).

    Raises:
        InvalidArgument: for a missing file or metadata that does not describe such a case.
    """
    npz, meta = saved_case_paths(path)
    info = json.loads(meta.read_text())
    try:
        if info.get("kind") != "mha":
            msg = f"kind {info.get('kind')!r} is not 'mha'"
            raise KeyError(msg)
        num = Numerics(**info["numerics"])
        shape = MHAShape.of(info["shape"])
        with np.load(npz, allow_pickle=False) as data:
            arrays = {name: np.array(data[name]) for name in _MHA_ARRAYS}
            params = MHAParams(**{n: np.array(data[n]) for n in _PARAMS if n in data.files})
            mask = np.array(data["mask"]) if "mask" in data.files else None
        near_ratio = info.get("near_ratio")
        return MHAWorstCase(
            numerics=num, shape=shape, num_heads=int(info["num_heads"]), params=params,
            mask=mask, error=float(info["error"]), bound=float(info["bound"]),
            ratio=float(info["ratio"]), normwise=float(info["normwise"]),
            dominant_term=info["dominant_term"], index=tuple(info["index"]),
            seed=int(info["seed"]), budget=int(info["budget"]),
            evaluations=int(info["evaluations"]), seconds=float(info["seconds"]),
            uncertified=int(info["uncertified"]), out_of_scope=int(info["out_of_scope"]),
            structure=tuple(info["structure"]), near=info.get("near"),
            near_ratio=None if near_ratio is None else float(near_ratio), **arrays,
        )  # fmt: skip
    except (KeyError, TypeError) as exc:
        msg = f"path: expected multi-head attention case metadata and arrays, got an error: {exc}"
        raise InvalidArgument(msg) from None


def replay(path: str | Path) -> Replay:
    """Re-run a saved case bit for bit and re-check its bound (a gradient case: every gradient,
    and Theorem B.1/B.2 against the certified gradients; a multi-head attention case: the
    layer's output, and Theorem A.2 against the certified layer output).

    Raises:
        InvalidArgument: as :func:`load`, or if the case is now outside the bound's scope.
    """
    kind = _kind(path)
    if kind == "mha":
        mcase = load_mha(path)
        measured = mha_evaluation(
            mcase.x_q, mcase.x_kv, mcase.params, mcase.num_heads, mcase.mask, mcase.numerics
        )
        if measured is None:
            msg = "path: the saved case is outside the bound's scope (refused or overflowed)"
            raise InvalidArgument(msg)
        out, m = measured.output, measured
        same = out.shape == mcase.output.shape and out.tobytes() == mcase.output.tobytes()
        return Replay(mcase, same, m.error, m.bound, m.ratio, m.dominant_term)
    if kind == "gradient":
        gcase = load_gradient(path)
        found = gradient_evaluation(
            gcase.q, gcase.k, gcase.v, gcase.d_out, gcase.mask, gcase.numerics, gcase.backward,
            gcase.softcap,
        )  # fmt: skip
        if found is None:
            msg = "path: the saved case is outside the bound's scope (refused or overflowed)"
            raise InvalidArgument(msg)
        ratio, _, _, error, bound, dominant, grads = found
        same = len(grads) == len(gcase.gradients) and all(
            a.shape == b.shape and a.tobytes() == b.tobytes()
            for a, b in zip(grads, gcase.gradients, strict=True)
        )
        return Replay(gcase, same, error, bound, ratio, dominant)
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
