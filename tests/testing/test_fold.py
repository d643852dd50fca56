"""How an oracle folds its candidates' bounds into one tolerance (``mhanum.testing.oracle``)."""

from __future__ import annotations

import numpy as np
import pytest

from mhanum import InvalidArgument
from mhanum.testing.oracle import first_largest, fold_candidates


@pytest.mark.parametrize("seed", range(4))
def test_first_largest_is_argmax_over_the_stack_without_stacking(seed):
    """:func:`first_largest` against ``np.argmax`` and ``np.max`` over the stacked arrays: ties
    (few distinct values), infinities, NaN (the first NaN wins, as in argmax) and a scalar
    broadcast to the shape."""
    rng = np.random.default_rng(seed)
    shape = (7, 5)
    arrays = [rng.integers(0, 3, shape).astype(np.float64) for _ in range(5)]
    arrays[1][0, 0] = np.inf
    arrays[2][rng.random(shape) < 0.2] = np.nan
    arrays[4][rng.random(shape) < 0.2] = np.nan
    arrays.append(np.float64(1.5))
    stack = np.stack([np.broadcast_to(a, shape) for a in arrays])
    largest, which = first_largest(arrays, shape)
    np.testing.assert_array_equal(which, np.argmax(stack, axis=0))
    np.testing.assert_array_equal(largest, np.max(stack, axis=0))


def test_the_fold_names_the_governing_candidates_largest_term_and_its_reasons():
    """:func:`fold_candidates` on two candidates whose totals cross: each element takes the
    larger total, the largest term of the candidate that gives it, and that candidate's
    reasons where it is infinite."""
    shape = (2, 2)
    a = (np.array([[1.0, 4.0], [np.inf, 0.0]]), {"x": 1.0, "y": [[0.0, 3.0], [0.0, 0.0]]}, ["a"])
    b = (np.array([[2.0, 3.0], [1.0, 1.0]]), {"z": [[2.0, 0.0], [0.0, 1.0]]}, [])
    tol, term, reason = fold_candidates([a, b], shape)
    np.testing.assert_array_equal(tol, [[2.0, 4.0], [np.inf, 1.0]])
    assert term.tolist() == [["z", "y"], ["x", "z"]]
    assert reason.tolist() == [["", ""], ["a", ""]]


def test_a_fold_of_nothing_is_refused_naming_the_argument():
    with pytest.raises(InvalidArgument, match="arrays: expected at least one array, got none"):
        first_largest([], (2,))
    with pytest.raises(InvalidArgument, match="arrays: expected at least one array"):
        fold_candidates([], (2,))
