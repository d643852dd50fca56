"""mhanum.search with a rotary embedding: the search rotates q and k as the kernel does, measures
against the exact attention of the exactly rotated inputs, bounds with ``attention_bound(...,
rope=)``, catches a bound that forgets the rope, and records the rope and its positions."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from mhanum import InvalidArgument, Numerics, cases, cli, reference
from mhanum import search as ms
from mhanum.bounds import Bound, attention_bound
from mhanum.emulate.attention import attention
from mhanum.rope import Rope

SHAPE = {"q_len": 2, "kv_len": 4, "d_k": 8}
# a Llama-3-like base, a bfloat16 table, positions past 2^12 (float32 positions hold them)
BF16_TABLE = Rope(dim=8, base=500000.0, table_format="bfloat16")
PAST_4096 = (np.array([5002, 5003]), np.arange(5000, 5004))


def _bound_without_rope(q, k, v, mask=None, *, rope=None, positions=None, **kw) -> Bound:
    """A deliberately wrong bound, for the tests only: Theorem A.1 of the same inputs with the
    rope left out, so that neither the tables' errors nor the rotation's roundings count."""
    return attention_bound(q, k, v, mask, **kw)


@pytest.mark.parametrize(
    ("numerics", "rope"),
    [("fp32", BF16_TABLE), ("bf16-fp32acc", dataclasses.replace(BF16_TABLE, dim=4))],
)
@pytest.mark.parametrize("search", [ms.worst_case, ms.random_search])
def test_a_search_with_a_bfloat16_table_past_4096_stays_within_the_rope_bound(
    search, numerics, rope
):
    case = search(numerics, SHAPE, budget=8, seed=3, rope=rope, positions=PAST_4096)
    assert np.isfinite(case.bound)
    assert 0 < case.ratio <= 1
    assert not case.violation
    assert case.rope == rope
    assert case.positions == ((5002, 5003), (5000, 5001, 5002, 5003))
    # the float64 stand-in rotated with the rope's float64 copy: Lemma W.1's slack is tiny
    assert case.slack <= ms.SLACK_LIMIT
    assert abs(case.cheap_ratio - case.ratio) <= case.slack
    emulated = np.asarray(
        attention(case.q, case.k, case.v, numerics=case.numerics, rope=rope, positions=PAST_4096),
        np.float64,
    )
    assert np.array_equal(emulated, case.output)
    exact = reference.attention(case.q, case.k, case.v, rope=rope, positions=PAST_4096)
    assert case.error == abs(emulated[case.index] - exact[case.index])
    bound = attention_bound(
        case.q, case.k, case.v, numerics=case.numerics, rope=rope, positions=PAST_4096
    )
    assert case.bound == bound.total[case.index]


def test_a_bound_that_forgets_the_rope_is_caught_as_a_violation():
    found = ms.worst_case(
        "fp32", SHAPE, budget=8, seed=1, rope=BF16_TABLE, positions=PAST_4096,
        bound=_bound_without_rope,
    )  # fmt: skip
    assert found.violation
    assert found.ratio > 1
    # the same inputs are within the bound that counts the rope: the table's error is the cause
    honest = ms.Objective(found.numerics, rope=BF16_TABLE, positions=PAST_4096)
    ev = honest(found.q, found.k, found.v, found.mask, certified=True)
    assert ev is not None
    assert ev.ratio <= 1
    assert ev.error == found.error
    baseline = ms.random_search(
        "fp32", SHAPE, budget=4, rope=BF16_TABLE, positions=PAST_4096, bound=_bound_without_rope
    )
    assert baseline.violation


def test_a_bound_that_forgets_the_rope_holds_without_one():
    # the control: the same wrong bound is Theorem A.1 itself when nothing rotates
    case = ms.random_search("fp32", SHAPE, budget=4, bound=_bound_without_rope)
    assert case.ratio <= 1
    assert case.rope is None
    assert case.positions is None
    # a record without a rope is written as before ropes were searched (and reads back alike)
    assert {"rope", "positions"}.isdisjoint(case.record())


def test_the_record_round_trips_with_the_rope_and_its_positions(tmp_path):
    rope = Rope(
        dim=4, base=500000.0, layout="interleaved", scaling="yarn", factor=4.0,
        original_max_position=4096, table_format="bfloat16",
    )  # fmt: skip
    # positions by default: the keys 0..3 and the queries the last 2 of them
    case = ms.random_search("fp32", SHAPE, budget=2, seed=0, rope=rope)
    assert case.positions == ((2, 3), (0, 1, 2, 3))
    record = json.loads(json.dumps(case.record()))
    assert record["rope"] == rope.to_dict()
    assert record["rope"]["table_format"] == "bfloat16"
    assert record["positions"] == [[2, 3], [0, 1, 2, 3]]
    back = ms.WorstCase.from_record(record)
    assert back.record() == record
    assert (back.rope, back.positions) == (case.rope, case.positions)
    assert case.summary()["rope"] == rope.to_dict()
    assert "rope" not in dataclasses.replace(case, rope=None, positions=None).summary()
    loaded = cases.load(cases.save(case, tmp_path))
    assert (loaded.rope, loaded.positions) == (rope, case.positions)


def test_a_saved_case_replays_with_its_rope(tmp_path):
    """``cases.replay`` re-runs the case with its rope: the same output, bit for bit, and the
    same certified error and ratio (without the rope the output would differ)."""
    rope = Rope(dim=4, base=500000.0, table_format="bfloat16")
    case = ms.worst_case(
        "fp32",
        SHAPE,
        budget=4,
        seed=1,
        rope=rope,
        positions=(np.arange(5002, 5004), np.arange(5000, 5004)),
    )
    replay = cases.replay(cases.save(case, tmp_path))
    assert replay.bit_for_bit
    assert (replay.error, replay.ratio) == (case.error, case.ratio)


def test_a_rope_reads_back_from_its_dict():
    rope = Rope(dim=8, scaling="llama3", factor=8.0, original_max_position=8192,
                inv_freq_format="bfloat16", trig_ulps=1.0)  # fmt: skip
    written = rope.to_dict()
    assert json.loads(json.dumps(written)) == written
    assert Rope.from_dict(written) == rope
    assert Rope.from_dict({"dim": 8}) == Rope(dim=8)
    with pytest.raises(InvalidArgument, match=r"^rope: expected keys from .*, got \['theta'\]"):
        Rope.from_dict({"dim": 8, "theta": 10000.0})
    with pytest.raises(InvalidArgument, match=r"^rope: expected a mapping"):
        Rope.from_dict([("dim", 8)])
    with pytest.raises(InvalidArgument, match=r"^rope\.table_format: expected one of"):
        Rope.from_dict({"dim": 8, "table_format": "float12"})


@pytest.mark.parametrize(
    ("numerics", "kwargs", "message"),
    [
        ("fp32", {"rope": "llama"}, r"^rope: expected a mhanum.rope.Rope or None, got str"),
        ("fp32", {"positions": PAST_4096}, r"^positions: expected only with rope="),
        (
            "fp32",
            {"rope": Rope(dim=8, rotation_format="bfloat16")},
            (
                r"^rope\.rotation_format: expected a format that holds the search's input "
                r"format \(float32\) exactly .*, got bfloat16"
            ),
        ),
        (
            "bf16-fp32acc",
            {"rope": Rope(dim=8, rotation_format="float16")},
            r"^rope.rotation_format: .* \(bfloat16\) exactly .*, got float16",
        ),
        (
            "fp32",
            {"rope": BF16_TABLE, "positions": (np.arange(3), np.arange(4))},
            r"^positions: expected 2 positions of the queries, got 3",
        ),
        ("fp32", {"rope": BF16_TABLE, "positions": np.arange(4)}, r"^positions: expected a pair"),
        ("fp32", {"rope": Rope(dim=10)}, r"^rope: expected a rotary dimension of at most d_k"),
        (
            "fp32",
            {"rope": Rope(dim=8, position_format="bfloat16"), "positions": PAST_4096},
            r"^positions: expected positions up to 256",
        ),
    ],
)
@pytest.mark.parametrize("search", [ms.worst_case, ms.random_search])
def test_bad_rope_arguments_raise_naming_them(search, numerics, kwargs, message):
    with pytest.raises(InvalidArgument, match=message):
        search(numerics, SHAPE, budget=2, **kwargs)


def test_the_objective_checks_its_rope_too():
    with pytest.raises(InvalidArgument, match=r"^rope.rotation_format: .* \(float32\)"):
        ms.Objective(Numerics.preset("fp32"), rope=Rope(dim=8, rotation_format="float16"))
    with pytest.raises(InvalidArgument, match=r"^positions: expected only with rope="):
        ms.Objective(Numerics.preset("fp32"), positions=PAST_4096)


def test_cli_searches_with_a_rope(tmp_path, capsys):
    argv = ["search", "--q-len", "2", "--kv-len", "4", "--d-k", "8", "--budget", "4"]
    rope_options = ["--rope-dim", "8", "--rope-base", "500000", "--rope-table-format", "bfloat16"]
    code = cli.main(
        [*argv, *rope_options, "--position-offset", "5000", "-o", str(tmp_path), "--json"]
    )
    assert code == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["rope"] == Rope(dim=8, base=500000.0, table_format="bfloat16").to_dict()
    case = cases.load(shown["case"])
    assert case.positions == ((5002, 5003), (5000, 5001, 5002, 5003))
    assert case.rope.rotation_format.name == "float32"  # the input format of fp32


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--rope-base", "500000"], "--rope-dim: expected a rotary dimension with the RoPE's"),
        (["--position-offset", "7"], "--rope-dim: expected a rotary dimension"),
        (["--rope-dim", "7"], "--rope-dim: expected an even rotary dimension, got 7"),
        (["--rope-dim", "8", "--rope-base", "1"], "--rope-base: expected a base above 1"),
        (["--rope-dim", "8", "--runs", "2"], "--rope-dim: expected none of --runs"),
        (["--rope-dim", "8", "--mha"], "--mha: expected none of --rope-dim"),
        (["--rope-dim", "8", "--backward", "flash2"], "--backward: expected none of --rope-dim"),
    ],
)
def test_cli_refuses_rope_options_naming_them(options, message, tmp_path, capsys):
    argv = ["search", "--q-len", "2", "--kv-len", "4", "--d-k", "8", "--budget", "2"]
    assert cli.main([*argv, *options, "-o", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


def test_two_schedules_with_a_rope_differ_within_theorem_a5():
    """With ``against=`` both schedules rotate, and the search's difference is bounded by
    ``schedule_difference(..., rope=)`` (Theorem A.5 around the exact attention of the exactly
    rotated inputs): the confirmed ratio is at most 1 and equals the recomputed one."""
    from mhanum.bounds import schedule_difference

    case = ms.worst_case(
        "fp32", SHAPE, budget=6, seed=2, rope=BF16_TABLE, positions=PAST_4096,
        against="bf16-fp32acc", objective="difference/bound",
    )  # fmt: skip
    assert case.rope == BF16_TABLE
    assert 0 < case.ratio <= 1
    kw = {"rope": BF16_TABLE, "positions": case.positions}
    a, b = (np.asarray(attention(case.q, case.k, case.v, numerics=n, **kw), np.float64)
            for n in ("fp32", "bf16-fp32acc"))  # fmt: skip
    d = schedule_difference(
        case.q, case.k, case.v, numerics_a="fp32", numerics_b="bf16-fp32acc", **kw
    )
    assert case.ratio == float(np.max(np.abs(a - b) / d.total))
