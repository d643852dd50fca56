"""mhanum.cases: saved cases replay bit for bit, re-check their bound, and are never overwritten."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from mhanum import InvalidArgument, Numerics, cases, cli
from mhanum import search as ms

SHAPE = {"q_len": 2, "kv_len": 8, "d_k": 4, "d_v": 3}
CONTRACT = {
    "mhanum_version", "numerics", "preset", "shape", "seed", "objective", "error", "bound",
    "ratio", "dominant_term", "created",
}  # fmt: skip


@pytest.fixture(scope="module")
def found():
    """A targeted and a random case of different numerics (the search runs once per module)."""
    return [
        ms.worst_case("bf16-fp32acc", SHAPE, budget=12, seed=2),
        ms.random_search(Numerics(input="float16", summation="pairwise"), SHAPE, budget=6, seed=4),
        ms.worst_case(Numerics(summation="sequential", softmax="online(4)"), SHAPE, budget=12),
        ms.worst_case("fp16-fp32acc", SHAPE | {"batch": 2}, budget=10, mask="padding"),
    ]


def test_every_returned_case_replays_bit_for_bit_from_its_file(found, tmp_path):
    for case in found:
        path = cases.save(case, tmp_path)
        result = cases.replay(path)
        assert result.bit_for_bit
        assert result.ok
        assert result.ratio == pytest.approx(case.ratio, rel=1e-12)
        assert result.dominant_term == case.dominant_term


def test_the_json_metadata_keeps_the_contract(found, tmp_path):
    case = found[1]
    npz = cases.save(case, tmp_path / "half")
    meta = json.loads(npz.with_suffix(".json").read_text())
    assert set(meta) >= CONTRACT
    assert meta["preset"] is None
    assert meta["numerics"]["summation"] == "pairwise"
    assert meta["numerics"]["mask_value"] == "-inf"
    assert Numerics(**meta["numerics"]) == case.numerics
    assert meta["shape"] == ms.Shape.of(SHAPE).as_dict()
    assert meta["ratio"] == case.ratio
    assert meta["objective"] == "error/bound"
    assert json.loads(json.dumps(meta)) == meta  # plain JSON: no NaN, Infinity or objects
    assert found[0].preset == "bf16-fp32acc"


def test_arrays_load_without_pickle(found, tmp_path):
    npz = cases.save(found[0], tmp_path / "case.npz")
    with np.load(npz, allow_pickle=False) as data:
        assert sorted(data.files) == ["k", "output", "q", "v"]
        assert data["q"].dtype == np.float64
        assert data["q"].tobytes() == found[0].q.tobytes()
    loaded = cases.load(npz)
    assert loaded.numerics == found[0].numerics
    assert loaded.output.tobytes() == found[0].output.tobytes()
    assert loaded.structure == found[0].structure


def test_a_masked_case_keeps_its_mask(found, tmp_path):
    npz = cases.save(found[3], tmp_path)
    with np.load(npz, allow_pickle=False) as data:
        assert data["mask"].dtype == bool
    loaded = cases.load(npz)
    assert loaded.mask is not None
    assert (loaded.mask == found[3].mask).all()
    assert cases.load(cases.save(found[0], tmp_path)).mask is None


def test_never_overwrites_without_force(found, tmp_path):
    npz = cases.save(found[0], tmp_path / "one")
    before = npz.read_bytes()
    with pytest.raises(InvalidArgument, match="force"):
        cases.save(found[2], tmp_path / "one")
    assert npz.read_bytes() == before
    cases.save(found[2], tmp_path / "one", force=True)
    assert cases.load(npz).numerics == found[2].numerics


def test_unique_saves_beside_an_existing_case(found, tmp_path):
    first = cases.save(found[0], tmp_path)
    second = cases.save(found[0], tmp_path, unique=True)
    third = cases.save(found[0], tmp_path, unique=True)
    assert second.name == first.name.replace(".npz", "-1.npz")
    assert third.name == first.name.replace(".npz", "-2.npz")
    assert second.with_suffix(".json").exists()


def test_a_tampered_output_does_not_replay(found, tmp_path):
    npz = cases.save(found[0], tmp_path / "tampered")
    with np.load(npz) as data:
        arrays = dict(data)
    arrays["output"] = np.nextafter(arrays["output"], math.inf)
    np.savez(npz, **arrays)
    assert not cases.replay(npz).bit_for_bit


def test_load_rejects_missing_files(tmp_path):
    with pytest.raises(InvalidArgument, match="no file"):
        cases.load(tmp_path / "absent.npz")


def test_cli_replay(found, tmp_path, capsys):
    npz = cases.save(found[0], tmp_path)
    assert cli.main(["replay", str(npz)]) == 0
    assert "bit for bit" in capsys.readouterr().out
    assert cli.main(["replay", str(npz), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["bit_for_bit"] is True
    assert cli.main(["replay", str(tmp_path / "absent.npz")]) == 2
