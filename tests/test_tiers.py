"""tests/tiers.py: the slow tier's list reads durations as pytest prints them, keeps the tests of a
minimal install fast, and names only tests that still exist (a renamed test would otherwise fall
out of the slow tier without a word)."""

from __future__ import annotations

from tests import tiers

DURATIONS = """\
============================= slowest durations =============================
2.50s call     tests/test_a.py::test_x[fp16]
0.60s setup    tests/test_a.py::test_x[fp16]
2.90s call     tests/test_a.py::test_y
9.00s call     tests/test_import.py::test_z
0.01s teardown tests/test_a.py::test_y
"""


def test_a_tests_phases_add_up_and_the_minimal_installs_tests_stay_fast():
    found = tiers.slow_ids(DURATIONS.splitlines())
    assert [n for _, n in found] == ["tests/test_a.py::test_x[fp16]"]
    assert found[0][0] == 2.50 + 0.60  # over the 3 s threshold; test_y's 2.90 + 0.01 is not


def test_every_listed_test_is_still_defined():
    listed = tiers.read()
    assert listed, "tests/slow.txt lists no test"
    missing = sorted(n for n in listed if not tiers.defined(n))
    assert not missing, f"tests/slow.txt names tests that no longer exist: {missing[:5]}"


def test_a_renamed_or_moved_test_is_not_defined():
    here = "tests/test_tiers.py::"
    assert tiers.defined(here + "test_a_renamed_or_moved_test_is_not_defined")
    assert tiers.defined(here + "test_every_listed_test_is_still_defined[param]")
    assert not tiers.defined(here + "test_no_such_test")
    assert not tiers.defined("tests/no_such_file.py::test_a_renamed_or_moved_test_is_not_defined")
    assert not tiers.defined(here + "SomeClass::test_a_renamed_or_moved_test_is_not_defined")
