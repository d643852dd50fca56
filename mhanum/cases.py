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
     "objective", "error", "bound", "ratio", "dominant_term", "created", "inputs_sha256", ...}

``numerics`` (and ``against``, a gradient case's ``backward``) is what
:meth:`~mhanum.Numerics.to_dict` (:meth:`~mhanum.numerics.Backward.to_dict`) writes, read back by
``from_dict``, which also reads a case saved by an earlier version.

``inputs_sha256`` maps the name of every input array of the case (``q``, ``k``, ``v``, ``mask``;
``d_out`` of a gradient case; ``x_q``, ``x_kv`` and the weights of a multi-head attention case)
to :func:`array_digest` of it as saved. Reading a case checks every input against it and refuses
one that differs (an edit or a corruption would otherwise replay as a different case); a case
saved before the digest existed has none and reads unchecked (:attr:`Replay.digest_checked`).

:func:`replay` recomputes the output with the saved numerics and compares it bit for bit with the
saved one, then re-measures the error against the certified reference and recomputes the bound.
:func:`save` never overwrites an existing case unless ``force=True``. A file that cannot be read
as a case (missing, corrupt, an array or field missing, an input that does not match its digest)
raises :class:`~mhanum.InvalidArgument` with the message ``"<file>: <what is wrong>"``.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from mhanum._digest import array_digest, digest_problem, inputs_digest
from mhanum._errors import InvalidArgument
from mhanum.search import (
    GradientWorstCase,
    MHAWorstCase,
    Objective,
    WorstCase,
    gradient_evaluation,
    mha_evaluation,
)

AnyCase = WorstCase | GradientWorstCase | MHAWorstCase

__all__ = [
    "Replay",
    "array_digest",
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


def _number(x: float) -> float | str:
    """``x``, or ``"inf"``/``"nan"`` for a non-finite value (strict JSON has no Infinity)."""
    return x if math.isfinite(x) else str(x)


def metadata(case: AnyCase) -> dict[str, Any]:
    """The JSON metadata of a case of any kind (see the module docstring): its fields as
    :meth:`~mhanum.search.WorstCase.fields` writes them (those that are ``None`` left out,
    non-finite numbers as strings), with the version, preset, time, digest and ``kind``."""
    from mhanum._version import __version__

    fields = {
        name: _number(value) if isinstance(value, float) else value
        for name, value in case.fields().items()
        if value is not None
    }
    return (
        ({} if case.KIND is None else {"kind": case.KIND})
        | {"mhanum_version": __version__, "preset": case.preset}
        | fields
        | {
            "violation": case.violation,
            "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "masked": case.mask is not None,
            "inputs_sha256": inputs_digest(case.input_arrays()),
        }
    )


_WRITERS = {WorstCase: "save", GradientWorstCase: "save_gradient", MHAWorstCase: "save_mha"}
"""The function that writes each kind of case."""


def _check_kind(case: object, kind: type) -> None:
    """Refuse a ``case`` that is not a ``kind``, naming the function that writes what it is."""
    if not isinstance(case, kind):
        writer = next((name for cls, name in _WRITERS.items() if isinstance(case, cls)), None)
        hint = f" (write it with {writer})" if writer else ""
        msg = f"case: expected a {kind.__name__}, got {type(case).__name__}{hint}"
        raise InvalidArgument(msg)


def _write(case: AnyCase, target: Path, *, force: bool, unique: bool) -> Path:
    """Write ``case``'s arrays to ``<target>.npz`` and its :func:`metadata` to ``.json``."""
    npz, meta = _reserve(target, force=force, unique=unique)
    arrays = {name: a for name, a in case.arrays().items() if a is not None}
    with npz.open("wb") as fh:
        np.savez(fh, **arrays)  # type: ignore[arg-type]
    meta.write_text(json.dumps(metadata(case), indent=2, allow_nan=False) + "\n")
    return npz


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
            msg = f"{p}: no file (a saved case is a .npz and a .json file of one name)"
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
        InvalidArgument: if ``case`` is not a :class:`mhanum.search.WorstCase`, or either file
            exists and neither ``force`` nor ``unique`` is set.
    """
    _check_kind(case, WorstCase)
    target = Path(path)
    if target.is_dir():
        target = target / default_name(case)
    return _write(case, target, force=force, unique=unique)


_KINDS = {None: "load", "gradient": "load_gradient", "mha": "load_mha"}
"""The ``kind`` of a case's metadata (``None``: absent, a single-attention case) and its reader."""

_TYPES: dict[str | None, type[AnyCase]] = {
    None: WorstCase,
    "gradient": GradientWorstCase,
    "mha": MHAWorstCase,
}
"""The case type of each ``kind``."""

_NPZ_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")  # a zip file's first bytes (an empty one's)

_UNREADABLE = (KeyError, IndexError, TypeError, ValueError, AttributeError)
"""What building a case from its metadata raises for a field missing or of another type."""


@dataclasses.dataclass(frozen=True)
class _Saved:
    """A saved case as read from its two files, its inputs checked against their digest."""

    npz: Path
    meta: Path
    info: dict[str, Any]
    arrays: dict[str, np.ndarray]
    digest_checked: bool

    @property
    def kind(self) -> str | None:
        kind = self.info.get("kind")
        return kind if isinstance(kind, str) else None

    def array(self, name: str) -> np.ndarray:
        """The array ``name``, or an error naming the ``.npz`` file."""
        if name not in self.arrays:
            held = ", ".join(sorted(self.arrays)) or "nothing"
            msg = f"{self.npz}: expected the array {name!r}, got an archive without it ({held})"
            raise InvalidArgument(msg)
        return self.arrays[name]

    def optional(self, name: str) -> np.ndarray | None:
        return self.arrays.get(name)


def _read_metadata(meta: Path) -> dict[str, Any]:
    try:
        info = json.loads(meta.read_bytes())
    except OSError as exc:
        msg = f"{meta}: expected a readable file, got {exc.strerror or exc}"
        raise InvalidArgument(msg) from None
    except ValueError as exc:  # not UTF-8, or not JSON
        msg = f"{meta}: expected the JSON metadata of a case, got {type(exc).__name__}: {exc}"
        raise InvalidArgument(msg) from None
    if not isinstance(info, dict):
        msg = f"{meta}: expected the JSON object of a case's metadata, got {type(info).__name__}"
        raise InvalidArgument(msg)
    if info.get("kind") not in _KINDS:
        msg = f"{meta}: expected the kind 'gradient', 'mha' or none, got {info.get('kind')!r}"
        raise InvalidArgument(msg)
    return info


def _read_arrays(npz: Path) -> dict[str, np.ndarray]:
    try:
        with npz.open("rb") as fh:  # this file object closes even when numpy fails to read it
            if fh.read(4) in _NPZ_MAGIC:
                fh.seek(0)
                with np.load(fh, allow_pickle=False) as data:
                    return {name: np.array(data[name]) for name in data.files}
    except OSError as exc:
        msg = f"{npz}: expected a readable file, got {exc.strerror or exc}"
        raise InvalidArgument(msg) from None
    except (ValueError, EOFError, zipfile.BadZipFile) as exc:
        msg = f"{npz}: expected a NumPy .npz archive of numeric arrays, got a corrupt one ({exc})"
        raise InvalidArgument(msg) from None
    msg = f"{npz}: expected a NumPy .npz archive (a zip file), got another kind of file"
    raise InvalidArgument(msg)


def _check_digest(saved: _Saved) -> bool:
    """Whether the case has a digest; refuses an input that does not match it."""
    digest = saved.info.get("inputs_sha256")
    if digest is None:
        return False
    if not (isinstance(digest, dict) and all(isinstance(v, str) for v in digest.values())):
        msg = (
            f"{saved.meta}: expected inputs_sha256 to map array names to digests, got "
            f"{digest!r:.80}"
        )
        raise InvalidArgument(msg)
    inputs = _TYPES[saved.kind].INPUTS
    problem = digest_problem({n: saved.arrays.get(n) for n in inputs}, digest)
    if problem is not None:
        msg = f"{saved.npz}: {problem}"
        raise InvalidArgument(msg)
    return True


def _read(path: str | Path) -> _Saved:
    """Both files of a saved case, read and checked (see the module docstring)."""
    npz, meta = saved_case_paths(path)
    info = _read_metadata(meta)
    saved = _Saved(npz, meta, info, _read_arrays(npz), digest_checked=False)
    return dataclasses.replace(saved, digest_checked=_check_digest(saved))


def _bad_metadata(saved: _Saved, what: str, exc: Exception) -> InvalidArgument:
    """The error of metadata that does not describe a case of ``what``."""
    if isinstance(exc, KeyError):
        problem = f"got metadata without the field {exc.args[0]!r}"
    else:
        problem = f"got {exc}"
    return InvalidArgument(f"{saved.meta}: expected the metadata of {what}, {problem}")


def load(path: str | Path) -> WorstCase:
    """Read a case saved by :func:`save` (the arrays with ``allow_pickle=False``).

    Raises:
        InvalidArgument: ``"<file>: <what is wrong>"``, for a missing or corrupt file, a missing
            array or field, an input that does not match the digest saved with the case, or a
            gradient or multi-head attention case (:func:`load_gradient`, :func:`load_mha`).
    """
    case: WorstCase = _case(_read(path), None)
    return case


_WHAT = {None: "a single-attention case", "gradient": "a gradient case",
         "mha": "a multi-head attention case"}  # fmt: skip


def _case(saved: _Saved, kind: str | None) -> Any:
    """The case of ``kind`` that ``saved`` holds.

    Raises:
        InvalidArgument: for a case of another kind, a missing array or field.
    """
    if saved.kind != kind:
        msg = (
            f"{saved.meta}: expected {_WHAT[kind]}, got {_WHAT[saved.kind]} (read it with "
            f"{_KINDS[saved.kind]})"
        )
        raise InvalidArgument(msg)
    cls = _TYPES[kind]
    arrays = {
        name: saved.optional(name) if name in cls.OPTIONAL else saved.array(name)
        for name in cls.array_names()
    }
    try:
        return cls.from_parts(saved.info, arrays)
    except _UNREADABLE as exc:
        raise _bad_metadata(saved, _WHAT[kind], exc) from None


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
        digest_checked: whether the case's inputs were checked against the digest saved with
            it (``False``: a case saved before cases carried one).
    """

    case: WorstCase | GradientWorstCase | MHAWorstCase
    bit_for_bit: bool
    error: float
    bound: float
    ratio: float
    dominant_term: str
    digest_checked: bool = False

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
            "digest_checked": self.digest_checked,
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


def save_gradient(
    case: GradientWorstCase, path: str | Path, *, force: bool = False, unique: bool = False
) -> Path:
    """Write a gradient case to ``<path>.npz`` and ``<path>.json`` (a directory gets the name
    ``<preset>-gradient-<algorithm>-seed<seed>``); ``force`` and ``unique`` as for :func:`save`.

    Raises:
        InvalidArgument: if ``case`` is not a :class:`mhanum.search.GradientWorstCase`, or
            either file exists and neither ``force`` nor ``unique`` is set.
    """
    _check_kind(case, GradientWorstCase)
    target = Path(path)
    if target.is_dir():
        name = f"{case.preset or 'custom'}-gradient-{case.backward.algorithm}-seed{case.seed}"
        target = target / name
    return _write(case, target, force=force, unique=unique)


def load_gradient(path: str | Path) -> GradientWorstCase:
    """Read a gradient case saved by :func:`save_gradient` (arrays with ``allow_pickle=False``).

    Raises:
        InvalidArgument: ``"<file>: <what is wrong>"``, as for :func:`load`.
    """
    case: GradientWorstCase = _case(_read(path), "gradient")
    return case


def save_mha(
    case: MHAWorstCase, path: str | Path, *, force: bool = False, unique: bool = False
) -> Path:
    """Write a multi-head attention case to ``<path>.npz`` and ``<path>.json`` (a directory gets
    the name ``<preset>-mha<heads>-seed<seed>``, with ``-near`` for a search near a real layer);
    ``force`` and ``unique`` as for :func:`save`.

    Raises:
        InvalidArgument: if ``case`` is not a :class:`mhanum.search.MHAWorstCase`, or either
            file exists and neither ``force`` nor ``unique`` is set.
    """
    _check_kind(case, MHAWorstCase)
    target = Path(path)
    if target.is_dir():
        near = "" if case.near is None else "-near"
        target = target / f"{case.preset or 'custom'}-mha{case.num_heads}{near}-seed{case.seed}"
    return _write(case, target, force=force, unique=unique)


def load_mha(path: str | Path) -> MHAWorstCase:
    """Read a multi-head attention case saved by :func:`save_mha` (arrays with
    ``allow_pickle=False``).

    Raises:
        InvalidArgument: ``"<file>: <what is wrong>"``, as for :func:`load`.
    """
    case: MHAWorstCase = _case(_read(path), "mha")
    return case


def replay(path: str | Path) -> Replay:
    """Re-run a saved case bit for bit and re-check its bound (a gradient case: every gradient,
    and Theorem B.1/B.2 against the certified gradients; a multi-head attention case: the
    layer's output, and Theorem A.2 against the certified layer output).

    The inputs are checked against the digest saved with the case first
    (:attr:`Replay.digest_checked`).

    Raises:
        InvalidArgument: as :func:`load`, or if the case is now outside the bound's scope.
    """
    saved = _read(path)
    outside = f"{saved.npz}: the saved case is outside the bound's scope (refused or overflowed)"
    checked = saved.digest_checked
    if saved.kind == "mha":
        mcase: MHAWorstCase = _case(saved, "mha")
        measured = mha_evaluation(
            mcase.x_q, mcase.x_kv, mcase.params, mcase.num_heads, mcase.mask, mcase.numerics
        )
        if measured is None:
            raise InvalidArgument(outside)
        out, m = measured.output, measured
        same = out.shape == mcase.output.shape and out.tobytes() == mcase.output.tobytes()
        return Replay(mcase, same, m.error, m.bound, m.ratio, m.dominant_term, checked)
    if saved.kind == "gradient":
        gcase: GradientWorstCase = _case(saved, "gradient")
        found = gradient_evaluation(
            gcase.q, gcase.k, gcase.v, gcase.d_out, gcase.mask, gcase.numerics, gcase.backward,
            gcase.softcap,
        )  # fmt: skip
        if found is None:
            raise InvalidArgument(outside)
        ratio, _, _, error, bound, dominant, grads = found
        same = len(grads) == len(gcase.gradients) and all(
            a.shape == b.shape and a.tobytes() == b.tobytes()
            for a, b in zip(grads, gcase.gradients, strict=True)
        )
        return Replay(gcase, same, error, bound, ratio, dominant, checked)
    case: WorstCase = _case(saved, None)
    objective = Objective(
        case.numerics, case.objective, against=case.against, softcap=case.softcap, sink=case.sink,
        rope=case.rope, positions=case.positions,
    )  # fmt: skip
    ev = objective(case.q, case.k, case.v, case.mask, certified=True)
    if ev is None:
        raise InvalidArgument(outside)
    same = ev.output.shape == case.output.shape and ev.output.tobytes() == case.output.tobytes()
    return Replay(case, same, ev.error, ev.bound, ev.ratio, ev.dominant_term, checked)
