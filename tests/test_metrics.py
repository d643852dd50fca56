"""mhanum.measure: each metric against hand-computed values; NaN is never hidden."""

from __future__ import annotations

import math

import mpmath
import numpy as np
import pytest

from mhanum import InvalidArgument, metrics


def test_metrics_on_a_hand_computed_case():
    ref = np.array([[1.0, -2.0], [0.5, 4.0]])
    comp = np.array([[1.0 + 2.0**-20, -2.0], [0.5, 4.0 - 2.0**-18]])
    e = metrics.errors(comp, ref, fmt="float32")
    assert e.max_abs == 2.0**-18
    assert e.argmax_abs == (1, 1)
    assert e.max_rel == 2.0**-20  # both relative errors are 2**-20
    assert e.normwise_max == 2.0**-18 / 4.0
    assert e.normwise_fro == math.sqrt(2.0**-40 + 2.0**-36) / math.sqrt(1 + 4 + 0.25 + 16)
    assert e.max_ulps == 8.0  # 2**-20 at 1.0 is 8 ulps of float32 (ulp 2**-23), likewise at 4.0
    assert e.n_compared == 4
    assert e.n_nonfinite == 0
    assert e.n_undefined == 0


def test_zero_reference_entries():
    e = metrics.errors(np.array([0.0, 1.0]), np.array([0.0, 1.0]))
    assert e.max_rel == 0.0
    e = metrics.errors(np.array([1e-30, 1.0]), np.array([0.0, 1.0]))
    assert e.max_rel == math.inf
    assert e.max_abs == 1e-30


def test_nan_in_the_computed_output_is_reported_not_hidden():
    e = metrics.errors(np.array([1.0, np.nan, 2.0]), np.array([1.0, 1.0, 2.0]), fmt="float32")
    assert e.n_nonfinite == 1
    assert e.argmax_abs == (1,)
    assert e.max_abs == e.max_rel == e.normwise_max == e.max_ulps == math.inf
    assert "1 non-finite computed" in str(e)


@pytest.mark.parametrize("computed", [1.0, np.inf, -np.inf])
@pytest.mark.parametrize("mpf", [False, True], ids=["float64", "mpf"])
def test_an_infinite_reference_is_reported_as_infinite_not_nan(computed, mpf):
    ref = np.array([np.inf, 2.0])
    if mpf:
        ref = np.array([mpmath.mpf("1e400"), mpmath.mpf(2)], dtype=object)
    e = metrics.errors(np.array([computed, 2.0]), ref, fmt="float32")
    assert e.n_nonfinite == 1
    assert e.argmax_abs == (0,)
    fields = (e.max_abs, e.max_rel, e.normwise_max, e.normwise_fro, e.max_ulps)
    assert all(f == math.inf for f in fields)


def test_undefined_reference_entries_are_excluded_and_counted():
    e = metrics.errors(np.array([np.nan, 1.0]), np.array([np.nan, 1.0]))
    assert e.n_undefined == 1
    assert e.n_nonfinite == 0
    assert e.max_abs == 0.0
    assert e.n_compared == 1


def test_mpf_reference_gives_exact_differences():
    ctx = mpmath.MPContext()
    ctx.prec = 200
    third = ctx.mpf(1) / 3
    computed = np.array([float(third)])
    exact = float(abs(ctx.mpf(float(third)) - third))
    e = metrics.errors(computed, np.array([third], dtype=object), fmt="float64")
    assert e.max_abs == exact > 0
    assert metrics.errors(computed, np.array([float(third)])).max_abs == 0.0  # float64 ref hides it


def test_format_is_inferred_from_the_dtype():
    assert metrics.errors(np.float16([1.0]), np.array([1.0])).fmt == "float16"
    assert metrics.errors(np.array([1.0]), np.array([1.0])).fmt == "float64"


def test_shape_mismatch_raises():
    with pytest.raises(InvalidArgument, match=r"reference: expected shape \(2,\)"):
        metrics.errors(np.zeros(2), np.zeros(3))


def test_the_old_name_warns_and_gives_the_same_functions():
    """``mhanum.measure`` (renamed: ``mhanum measure`` runs devices) still imports, with a
    DeprecationWarning naming ``mhanum.metrics``, and gives the same objects."""
    import importlib
    import sys

    import mhanum
    from mhanum import metrics

    sys.modules.pop("mhanum.measure", None)
    vars(mhanum).pop("measure", None)  # (hasattr would import it)
    with pytest.warns(DeprecationWarning, match="mhanum.measure is deprecated: .*mhanum.metrics"):
        old = importlib.import_module("mhanum.measure")
    assert old.errors is metrics.errors
    assert old.Errors is metrics.Errors
