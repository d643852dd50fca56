"""SHA-256 digests of the input arrays of a saved case (:mod:`mhanum.cases`, search journals)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

import numpy as np

__all__ = ["array_digest", "digest_problem", "inputs_digest"]


def array_digest(a: np.ndarray) -> str:
    """SHA-256 (hex) of an array exactly: its dtype (``dtype.str``, with the byte order), its
    shape and its bytes in C order."""
    h = hashlib.sha256()
    h.update(json.dumps([a.dtype.str, list(a.shape)]).encode())
    h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def inputs_digest(arrays: Mapping[str, np.ndarray | None]) -> dict[str, str]:
    """:func:`array_digest` of each array, by name (``None``, an absent one, left out)."""
    return {name: array_digest(a) for name, a in arrays.items() if a is not None}


def digest_problem(
    arrays: Mapping[str, np.ndarray | None], digest: Mapping[str, str]
) -> str | None:
    """What is wrong with ``arrays`` (``None``: absent) against the digest saved with them, in
    words starting with the array's name; ``None`` if they match it."""
    for name in [*arrays, *(n for n in digest if n not in arrays)]:
        a = arrays.get(name)
        if a is None and name in digest:
            return f"{name} is missing (the digest saved with the case has it)"
        if a is not None and name not in digest:
            return f"{name} is not in the digest saved with the case (added since)"
        if a is not None and array_digest(a) != digest[name]:
            return f"{name} does not match the digest saved with the case (edited or corrupt)"
    return None
