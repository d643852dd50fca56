"""Deterministic attention inputs: the structures and masks that device records and reports use.

:func:`inputs` draws q, k and v from numpy's PCG64 with an explicit seed (never the JAX RNG), so
a record or a report regenerates its inputs on any machine, bit for bit; :func:`mask_array` gives
the boolean masks (True = attend) by name. The Hypothesis strategies of :mod:`mhanum.strategies`
explore; these reproduce.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import numpy as np

from mhanum._errors import InvalidArgument
from mhanum.formats import get_format, round_to

__all__ = [
    "CANCEL_OFFSET",
    "CANCEL_QK",
    "DTYPES",
    "LARGE_NORM_LOGIT",
    "MASKS",
    "OUTLIER_CHANNELS",
    "OUTLIER_FACTOR",
    "OUTLIER_LOGIT",
    "STRUCTURES",
    "check_choice",
    "check_shape",
    "digest",
    "inputs",
    "mask_array",
    "padding_length",
]

STRUCTURES = ("normal", "large_norm", "outlier", "cancel")
MASKS = ("none", "causal", "padding")
DTYPES = ("float32", "bfloat16", "float16")

LARGE_NORM_LOGIT = 40.0
"""``large_norm``: q and k are scaled so that the largest ``|scale·q·k|`` is this."""
OUTLIER_FACTOR = 100.0
"""``outlier``: the outlier channels of q, k and v are this many times larger."""
OUTLIER_CHANNELS = 2
OUTLIER_LOGIT = 20.0
"""``outlier``: q and k are scaled down (together) so that no logit exceeds this."""
CANCEL_OFFSET = 100.0
"""``cancel``: each value row is ``±CANCEL_OFFSET`` (balanced signs) plus N(0, 1) noise."""
CANCEL_QK = 0.1
"""``cancel``: q and k are N(0, CANCEL_QK²), so the probabilities are nearly uniform."""


def check_shape(shape: Sequence[int]) -> tuple[int, int, int, int]:
    dims = tuple(shape)
    if len(dims) != 4 or not all(isinstance(n, int) and n >= 1 for n in dims):
        msg = f"shape: expected (batch, heads, length, d) of positive ints, got {shape!r}"
        raise InvalidArgument(msg)
    b, h, n, d = dims
    return b, h, n, d


def check_choice(value: object, name: str, allowed: Sequence[str]) -> str:
    if value not in allowed:
        msg = f"{name}: expected one of {tuple(allowed)}, got {value!r}"
        raise InvalidArgument(msg)
    return str(value)


def inputs(
    shape: Sequence[int], dtype: str, structure: str, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Deterministic attention inputs ``q, k, v`` of shape ``(batch, heads, length, d)``.

    Generated in float64 by numpy's ``Generator(PCG64(seed))`` (never the JAX RNG, so any machine
    regenerates the same values) and rounded to nearest into ``dtype``:

    * ``"normal"``: q, k, v ~ N(0, 1);
    * ``"large_norm"``: as normal, with q and k scaled by one common factor so that the largest
      logit ``|q·k|/sqrt(d)`` of the float64 values is :data:`LARGE_NORM_LOGIT` (40): the softmax
      is nearly one-hot and the logit errors are amplified by ``exp``;
    * ``"outlier"``: :data:`OUTLIER_CHANNELS` channels (drawn from the same generator) of q, k
      and v are :data:`OUTLIER_FACTOR` (100) times larger, as the outlier features of large
      models; q and k are then scaled by one common factor so that no logit exceeds
      :data:`OUTLIER_LOGIT` (20);
    * ``"cancel"``: q, k ~ N(0, 0.1²) (nearly uniform probabilities) and each row of v is
      ``±100`` (half the keys of each sign, in random order) plus N(0, 1) noise: the outputs
      ``Σ_j p_ij v_j`` cancel to a small fraction of ``Σ_j p_ij |v_j|``.

    Args:
        shape: ``(batch, heads, length, d)``; the same length for queries and keys.
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        structure: one of :data:`STRUCTURES`.
        seed: a nonnegative int.

    Returns:
        ``(q, k, v)``, numpy arrays of ``dtype`` (ml_dtypes for bfloat16), in mhanum's layout.

    Raises:
        InvalidArgument: for an unknown dtype or structure, or a bad shape or seed.

    Examples:
        >>> q, k, v = inputs((1, 2, 8, 4), "bfloat16", "normal", 0)
        >>> q.shape, str(q.dtype)
        ((1, 2, 8, 4), 'bfloat16')
    """
    b, h, n, d = check_shape(shape)
    fmt = get_format(check_choice(dtype, "dtype", DTYPES))
    check_choice(structure, "structure", STRUCTURES)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        msg = f"seed: expected an int >= 0, got {seed!r}"
        raise InvalidArgument(msg)
    rng = np.random.Generator(np.random.PCG64(seed))
    q, k, v = (rng.standard_normal((b, h, n, d)) for _ in range(3))
    if structure == "large_norm":
        c = math.sqrt(LARGE_NORM_LOGIT / _max_logit(q, k))
        q, k = q * c, k * c
    elif structure == "outlier":
        channels = rng.choice(d, size=min(OUTLIER_CHANNELS, d), replace=False)
        for x in (q, k, v):
            x[..., channels] *= OUTLIER_FACTOR
        c = math.sqrt(min(1.0, OUTLIER_LOGIT / _max_logit(q, k)))
        q, k = q * c, k * c
    elif structure == "cancel":
        q, k = q * CANCEL_QK, k * CANCEL_QK
        signs = np.where(np.arange(n) % 2 == 0, 1.0, -1.0)
        order = np.argsort(rng.random((b, h, n)), axis=-1)
        v = CANCEL_OFFSET * signs[order][..., None] + v
    q, k, v = (round_to(x, fmt).astype(fmt.numpy_dtype) for x in (q, k, v))
    return q, k, v


def _max_logit(q: np.ndarray, k: np.ndarray) -> float:
    return float(np.max(np.abs(q @ np.swapaxes(k, -1, -2)))) / math.sqrt(q.shape[-1])


def mask_array(kind: str, length: int) -> np.ndarray | None:
    """The boolean mask (True = attend) of shape ``(1, 1, length, length)``, or ``None``.

    ``"causal"``: key ``j`` attended by query ``i`` iff ``j <= i``. ``"padding"``: the last
    ``length // 4`` keys are padding (key ``j`` attended iff ``j < length - length // 4``), what
    ``jax.nn.dot_product_attention(key_value_seq_lengths=...)`` masks.
    """
    check_choice(kind, "mask", MASKS)
    if kind == "none":
        return None
    if kind == "causal":
        keep = np.tril(np.ones((length, length), bool))
    else:
        keep = np.broadcast_to(np.arange(length) < padding_length(length), (length, length))
    return np.array(keep)[None, None]


def padding_length(length: int) -> int:
    return length - length // 4


def digest(*arrays: np.ndarray) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(str(a.dtype).encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()
