"""Parametrized grids whose every cell compiles programs of its own: the full run takes every
cell, the fast run a covering set of them."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import pytest


def _values(value: Any) -> tuple[Any, ...]:
    return value if isinstance(value, tuple) else (value,)


def covering_grid(*axes: Sequence[Any]) -> list[Any]:
    """Every cell of the product of ``axes``, as ``pytest.param``s of the cell's values (an axis
    of tuples gives several parameters), all but a covering set marked ``slow``.

    The fast run's cells are the ``i``-th value of every axis at once (each axis cycled), for
    ``i`` up to the longest axis: every value of every axis appears in the fast run, in as few
    cells as the longest axis has values. An axis of pairs (order, softmax) puts every pair
    there.

    >>> cells = covering_grid(["a", "b", "c"], [1, 2])
    >>> [(c.values, bool(c.marks)) for c in cells]  # doctest: +NORMALIZE_WHITESPACE
    [(('a', 1), False), (('a', 2), True), (('b', 1), True), (('b', 2), False),
     (('c', 1), False), (('c', 2), True)]
    """
    longest = max(len(axis) for axis in axes)
    fast = {tuple(axis[i % len(axis)] for axis in axes) for i in range(longest)}
    return [
        pytest.param(
            *itertools.chain.from_iterable(_values(v) for v in cell),
            marks=() if cell in fast else pytest.mark.slow,
        )
        for cell in itertools.product(*axes)
    ]
