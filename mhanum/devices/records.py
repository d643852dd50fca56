"""Records on disk: one JSON object per line, with a schema version."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeAlias

from mhanum._errors import InvalidArgument

__all__ = [
    "BOUND_REVISION",
    "BOUND_RTOL",
    "SCHEMA",
    "Record",
    "check_schema",
    "read_records",
    "write_records",
]

SCHEMA = "mhanum.devices/1"
"""The schema version written in every record; :func:`read_records` refuses any other."""

Record: TypeAlias = dict[str, Any]
"""One measurement as a JSON object (see ``docs/devices.md`` for its fields)."""

BOUND_RTOL = 1e-9
"""A recomputed bound farther than this (relative) from the recorded one: "inconsistent"."""
BOUND_REVISION = 3
"""The revision of Theorem A.1's evaluation that records are written with. A record of an
earlier revision (no ``bound.revision``: 1) whose bound differs from today's is ``stale``, not
``inconsistent``: see :func:`check`. Revision 2: per-key logit errors (Lemma 4), weighted softmax
sum errors and telescoped online rescalings (papers/attention.md). Revision 3: exact per-key
extremes (Lemma 4), the float64 evaluation error in the logits, range proved on the values
(papers/attention.md, R), division modelled as a product with the reciprocal."""


def write_records(
    path: str | os.PathLike[str], records: Iterable[Record], *, force: bool = False
) -> Path:
    """Write records as JSON lines (one object per line); never overwrite without ``force``.

    Non-finite floats are written as Python's ``json`` writes them (``Infinity``, ``NaN``).

    Raises:
        InvalidArgument: if ``path`` exists and ``force`` is false, or a record is not a dict.
    """
    p = Path(path)
    if p.exists() and not force:
        msg = f"out: expected a new file, got existing {str(p)!r} (pass force=True / --force to overwrite)"
        raise InvalidArgument(msg)
    lines = []
    for i, r in enumerate(records):
        if not isinstance(r, dict):
            msg = f"records[{i}]: expected a dict, got {type(r).__name__}"
            raise InvalidArgument(msg)
        lines.append(json.dumps(r, sort_keys=True))
    p.write_text("".join(line + "\n" for line in lines))
    return p


def read_records(path: str | os.PathLike[str]) -> list[Record]:
    """Read records written by :func:`write_records` (from any machine).

    Raises:
        InvalidArgument: ``"<file>: <what is wrong>"``, for a missing or unreadable file, a line
            that is not a JSON object, or a record of another schema version than
            :data:`SCHEMA`.
    """
    p = Path(path)
    try:
        text = p.read_bytes().decode("utf-8")
    except OSError as exc:
        msg = f"{p}: expected a readable records file, got {exc.strerror or exc}"
        raise InvalidArgument(msg) from None
    except UnicodeDecodeError as exc:
        msg = f"{p}: expected UTF-8 JSON lines, got a byte that is not UTF-8 (at {exc.start})"
        raise InvalidArgument(msg) from None
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            msg = f"{p}: line {number}: expected JSON, got an error: {exc}"
            raise InvalidArgument(msg) from None
        if not isinstance(record, dict):
            msg = f"{p}: line {number}: expected a JSON object, got {type(record).__name__}"
            raise InvalidArgument(msg)
        check_schema(record, f"{p}: line {number}")
        records.append(record)
    return records


def check_schema(record: Mapping[str, Any], where: str) -> None:
    """Refuse a record of another schema than :data:`SCHEMA`; ``where`` starts the message."""
    if record.get("schema") != SCHEMA:
        msg = (
            f"{where}: expected schema {SCHEMA!r}, got {record.get('schema')!r} (written by "
            "another mhanum version?)"
        )
        raise InvalidArgument(msg)
