"""The grid a report runs: a TOML file, validated key by key against the embedded default."""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
from collections.abc import Callable, Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from mhanum._errors import InvalidArgument
from mhanum.devices import MASKS, STRUCTURES
from mhanum.formats import get_format
from mhanum.numerics import PRESETS, Numerics

__all__ = [
    "Config",
    "HeadsConfig",
    "MaskConstantsConfig",
    "VariantsConfig",
    "default_toml",
    "load_config",
]


@dataclasses.dataclass(frozen=True)
class HeadsConfig:
    """Head partitioning at a fixed model width (the ``[heads]`` table)."""

    d_model: int
    num_heads: tuple[int, ...]
    length: int


@dataclasses.dataclass(frozen=True)
class MaskConstantsConfig:
    """The mask-constant table (the ``[mask_constants]`` table)."""

    formats: tuple[str, ...]
    values: tuple[float | str, ...]
    mode: str
    score_bound: float
    n_keys: int
    leak_tol: float


@dataclasses.dataclass(frozen=True)
class VariantsConfig:
    """Today's attention variants (the ``[variants]`` table)."""

    length: int
    heads: int
    kv_heads: int
    window: int
    sink: float
    softcap: float
    kv_splits: int


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
    """The backward pass (the ``[backward]`` table)."""

    length: int
    algorithms: tuple[str, ...]
    block: int


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything a report computes; see ``mhanum/report/default.toml`` for each key's meaning."""

    seed: int
    samples: int
    structure: str
    presets: tuple[str, ...]
    lengths: tuple[int, ...]
    d_k: int
    masks: tuple[str, ...]
    probability: float
    heads: HeadsConfig
    mask_constants: MaskConstantsConfig
    variants: VariantsConfig
    backward: BackwardConfig

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (``-inf`` mask constants stay floats; ``json`` writes them as ``-Infinity``)."""
        return dataclasses.asdict(self)


def default_toml() -> str:
    """The text of the embedded default grid (``mhanum report --print-default-config``)."""
    return resources.files("mhanum.report").joinpath("default.toml").read_text("utf-8")


def load_config(
    config: Config | Mapping[str, Any] | str | os.PathLike[str] | None = None,
) -> Config:
    """A :class:`Config` from a TOML file, a mapping of its keys, or ``None`` (the default grid).

    Keys missing from the file or mapping take their default values. Every key is validated.

    Raises:
        InvalidArgument: for a file that is not TOML, an unknown key, or a value of the wrong
            type or range; the message names the key (``heads.num_heads``) and what was expected.
    """
    if isinstance(config, Config):
        return config
    defaults = tomllib.loads(default_toml())
    if config is None:
        given: Mapping[str, Any] = {}
    elif isinstance(config, Mapping):
        given = config
    elif isinstance(config, (str, os.PathLike)):
        given = _read_toml(Path(config))
    else:
        msg = f"config: expected a TOML path, a mapping or None, got {type(config).__name__}"
        raise InvalidArgument(msg)
    merged = _merge(defaults, given, "")
    return _parse(merged)


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text("utf-8")
    except OSError as exc:
        msg = f"config: expected a readable TOML file, got {str(path)!r} ({exc.strerror})"
        raise InvalidArgument(msg) from None
    except UnicodeDecodeError as exc:
        msg = (
            f"config: expected a UTF-8 TOML file, got {str(path)!r} (byte {exc.start} is not UTF-8)"
        )
        raise InvalidArgument(msg) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        msg = f"config: expected TOML, got a syntax error in {str(path)!r}: {exc}"
        raise InvalidArgument(msg) from None


def _merge(defaults: Mapping[str, Any], given: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """``defaults`` updated by ``given``, refusing keys the defaults do not have."""
    merged = dict(defaults)
    for key, value in given.items():
        name = f"{prefix}{key}"
        if key not in defaults:
            known = ", ".join(sorted(defaults))
            msg = f"{name}: expected one of the keys {known}, got the unknown key {key!r}"
            raise InvalidArgument(msg)
        if isinstance(defaults[key], Mapping):
            if not isinstance(value, Mapping):
                msg = f"{name}: expected a table, got {value!r}"
                raise InvalidArgument(msg)
            merged[key] = _merge(defaults[key], value, f"{name}.")
        else:
            merged[key] = value
    return merged


def _int(value: object, name: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        msg = f"{name}: expected an integer >= {low}, got {value!r}"
        raise InvalidArgument(msg)
    return value


def _ints(value: object, name: str, low: int) -> tuple[int, ...]:
    items = _list(value, name, f"a non-empty list of distinct integers >= {low}")
    for item in items:
        _int(item, name, low)
    return tuple(sorted(items))


def _list(value: object, name: str, expected: str) -> list[Any]:
    if not isinstance(value, list) or not value or len(set(map(repr, value))) != len(value):
        msg = f"{name}: expected {expected}, got {value!r}"
        raise InvalidArgument(msg)
    return value


def _choices(value: object, name: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    items = _list(value, name, f"a non-empty list of distinct names from {allowed}")
    for item in items:
        if item not in allowed:
            msg = f"{name}: expected names from {allowed}, got {item!r}"
            raise InvalidArgument(msg)
    return tuple(items)


def _real(value: object, name: str, expected: str, ok: Callable[[float], bool]) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
        msg = f"{name}: expected {expected}, got {value!r}"
        raise InvalidArgument(msg)
    return float(value)


def _mask_value(value: Any, fmt: str, name: str) -> float | str:
    """A constant as :class:`Numerics` accepts it (``"-inf"`` as a string is ``-inf``)."""
    if value == "-inf":
        value = -math.inf
    try:
        Numerics(input="float64", accum="float64", score_format=fmt, mask_value=value)
    except InvalidArgument:
        msg = (
            f"{name}: expected a number <= 0, -inf, 'finfo.min' or 'c*finfo.min' (0 < c <= 1), "
            f"got {value!r}"
        )
        raise InvalidArgument(msg) from None
    return float(value) if isinstance(value, (int, float)) else str(value)


def _parse(m: Mapping[str, Any]) -> Config:
    presets = _choices(m["presets"], "presets", tuple(PRESETS))
    lengths = _ints(m["lengths"], "lengths", 2)
    masks = _choices(m["masks"], "masks", MASKS)
    structure = m["structure"]
    if structure not in STRUCTURES:
        msg = f"structure: expected one of {STRUCTURES}, got {structure!r}"
        raise InvalidArgument(msg)
    probability = _real(m["probability"], "probability", "a number in (0, 1)", lambda p: 0 < p < 1)
    h = m["heads"]
    d_model = _int(h["d_model"], "heads.d_model", 1)
    num_heads = _ints(h["num_heads"], "heads.num_heads", 1)
    for n in num_heads:
        if d_model % n:
            msg = f"heads.num_heads: expected divisors of heads.d_model = {d_model}, got {n}"
            raise InvalidArgument(msg)
    heads = HeadsConfig(d_model, num_heads, _int(h["length"], "heads.length", 2))
    c = m["mask_constants"]
    formats = tuple(
        get_format(f, argname="mask_constants.formats").name
        for f in _list(c["formats"], "mask_constants.formats", "a non-empty list of formats")
    )
    values = tuple(
        _mask_value(v, formats[0], "mask_constants.values")
        for v in _list(c["values"], "mask_constants.values", "a non-empty list of constants")
    )
    if c["mode"] not in ("fill", "add"):
        msg = f"mask_constants.mode: expected 'fill' or 'add', got {c['mode']!r}"
        raise InvalidArgument(msg)
    constants = MaskConstantsConfig(
        formats,
        values,
        c["mode"],
        _real(
            c["score_bound"],
            "mask_constants.score_bound",
            "a finite number >= 0",
            lambda b: math.isfinite(b) and b >= 0,
        ),
        _int(c["n_keys"], "mask_constants.n_keys", 1),
        _real(c["leak_tol"], "mask_constants.leak_tol", "a number in [0, 1)", lambda t: 0 <= t < 1),
    )
    vt = m["variants"]
    n_heads = _int(vt["heads"], "variants.heads", 1)
    kv_heads = _int(vt["kv_heads"], "variants.kv_heads", 1)
    if n_heads % kv_heads:
        msg = f"variants.kv_heads: expected a divisor of variants.heads = {n_heads}, got {kv_heads}"
        raise InvalidArgument(msg)
    variants = VariantsConfig(
        _int(vt["length"], "variants.length", 2),
        n_heads,
        kv_heads,
        _int(vt["window"], "variants.window", 1),
        _real(vt["sink"], "variants.sink", "a finite number", math.isfinite),
        _real(
            vt["softcap"],
            "variants.softcap",
            "a finite number > 0",
            lambda c: math.isfinite(c) and c > 0,
        ),
        _int(vt["kv_splits"], "variants.kv_splits", 1),
    )
    bt = m["backward"]
    backward = BackwardConfig(
        _int(bt["length"], "backward.length", 1),
        _choices(bt["algorithms"], "backward.algorithms", ("textbook", "flash2")),
        _int(bt["block"], "backward.block", 1),
    )
    return Config(
        seed=_int(m["seed"], "seed", 0),
        samples=_int(m["samples"], "samples", 1),
        structure=structure,
        presets=presets,
        lengths=lengths,
        d_k=_int(m["d_k"], "d_k", 1),
        masks=masks,
        probability=probability,
        heads=heads,
        mask_constants=constants,
        variants=variants,
        backward=backward,
    )
