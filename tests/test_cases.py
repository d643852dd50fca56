"""mhanum.cases: saved cases replay bit for bit, re-check their bound, and are never overwritten."""

from __future__ import annotations

import json
import math
import re

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
    assert meta["numerics"] == case.numerics.to_dict()
    assert Numerics.from_dict(meta["numerics"]) == case.numerics
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


@pytest.mark.parametrize(
    ("writer", "message"),
    [
        (
            cases.save_gradient,
            "case: expected a GradientWorstCase, got WorstCase (write it with save)",
        ),
        (cases.save_mha, "case: expected a MHAWorstCase, got WorstCase (write it with save)"),
    ],
)
def test_a_case_of_another_kind_is_refused_and_nothing_is_written(found, tmp_path, writer, message):
    with pytest.raises(InvalidArgument, match="^" + re.escape(message)):
        writer(found[0], tmp_path / "other")
    with pytest.raises(InvalidArgument, match=r"^case: expected a WorstCase, got str$"):
        cases.save("case", tmp_path / "other")
    assert list(tmp_path.iterdir()) == []


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


def _edit(npz, name, change):
    """Rewrite one array of a saved case's ``.npz`` (``change(a)``; ``None`` removes it)."""
    with np.load(npz) as data:
        arrays = dict(data)
    if change is None:
        del arrays[name]
    else:
        arrays[name] = change(arrays.get(name))
    np.savez(npz, **arrays)


def _one_ulp_up(a):
    a = a.copy()
    a.flat[0] = np.nextafter(a.flat[0], math.inf)
    return a


def test_an_input_changed_by_one_ulp_is_refused_naming_the_file_and_the_array(
    found, tmp_path, capsys
):
    npz = cases.save(found[0], tmp_path / "case")
    _edit(npz, "q", _one_ulp_up)
    message = f"{npz}: q does not match the digest saved with the case (edited or corrupt)"
    assert cli.main(["replay", str(npz)]) == 2
    assert capsys.readouterr().err == f"mhanum replay: {message}\n"
    with pytest.raises(InvalidArgument) as info:
        cases.replay(npz)
    assert str(info.value) == message
    with pytest.raises(InvalidArgument, match="q does not match"):
        cases.load(npz)
    meta = json.loads(npz.with_suffix(".json").read_text())
    assert set(meta["inputs_sha256"]) == {"q", "k", "v"}


def test_a_mask_is_digested_and_a_mask_added_or_removed_is_refused(found, tmp_path):
    masked = cases.save(found[3], tmp_path / "masked")
    assert "mask" in json.loads(masked.with_suffix(".json").read_text())["inputs_sha256"]
    _edit(masked, "mask", lambda m: ~m)
    with pytest.raises(InvalidArgument, match=r"masked.npz: mask does not match the digest"):
        cases.replay(masked)
    _edit(masked, "mask", None)
    with pytest.raises(InvalidArgument, match=r"masked.npz: mask is missing"):
        cases.replay(masked)
    plain = cases.save(found[0], tmp_path / "plain")
    _edit(plain, "mask", lambda _: np.ones((1, 1, 2, 8), bool))
    with pytest.raises(InvalidArgument, match=r"plain.npz: mask is not in the digest"):
        cases.replay(plain)


def test_gradient_and_mha_cases_digest_their_inputs(tmp_path):
    small = {"q_len": 2, "kv_len": 4, "d_k": 4}
    gradient = ms.gradient_worst_case("fp32", small, backward="textbook", budget=2)
    npz = cases.save_gradient(gradient, tmp_path / "gradient")
    digest = json.loads(npz.with_suffix(".json").read_text())["inputs_sha256"]
    assert set(digest) == {"q", "k", "v", "d_out"}
    assert cases.replay(npz).digest_checked
    _edit(npz, "d_out", _one_ulp_up)
    with pytest.raises(InvalidArgument, match=r"gradient.npz: d_out does not match the digest"):
        cases.replay(npz)
    mha = ms.mha_worst_case("fp32", {"q_len": 2, "d_model": 4}, num_heads=2, budget=2)
    npz = cases.save_mha(mha, tmp_path / "mha")
    digest = json.loads(npz.with_suffix(".json").read_text())["inputs_sha256"]
    assert {"x_q", "x_kv", "wq", "wk", "wv", "wo"} <= set(digest)
    assert cases.replay(npz).digest_checked
    _edit(npz, "wo", _one_ulp_up)
    with pytest.raises(InvalidArgument, match=r"mha.npz: wo does not match the digest"):
        cases.load_mha(npz)


def test_a_case_saved_without_a_digest_replays_and_says_so(found, tmp_path, capsys):
    npz = cases.save(found[0], tmp_path / "old")
    meta = npz.with_suffix(".json")
    info = json.loads(meta.read_text())
    del info["inputs_sha256"]
    meta.write_text(json.dumps(info))
    result = cases.replay(npz)
    assert result.ok
    assert not result.digest_checked
    assert cli.main(["replay", str(npz)]) == 0
    out = capsys.readouterr().out
    assert "bit for bit" in out
    assert "carries no input digest" in out
    assert cli.main(["replay", str(npz), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["digest_checked"] is False


def _truncated(path):
    path.write_bytes(path.read_bytes()[:200])


def _json_edit(change):
    def edit(path):
        info = json.loads(path.read_text())
        path.write_text(json.dumps(change(info)))

    return edit


UNREADABLE_CASES = {
    "npz not an archive": (".npz", lambda p: p.write_bytes(b"garbage" * 10), "another kind"),
    "npz cut short": (".npz", _truncated, "a corrupt one"),
    "npz without k": (".npz", lambda p: _edit(p, "k", None), "k is missing"),
    "npz without output": (".npz", lambda p: _edit(p, "output", None), "array 'output'"),
    "json not JSON": (".json", lambda p: p.write_text("{not json"), "JSONDecodeError"),
    "json not UTF-8": (".json", lambda p: p.write_bytes(b"\xff\xfe{"), "JSON metadata"),
    "json a list": (".json", lambda p: p.write_text("[1, 2]"), "got list"),
    "json without numerics": (
        ".json",
        _json_edit(lambda i: {k: v for k, v in i.items() if k != "numerics"}),
        "without the field 'numerics'",
    ),
    "json with a bad field": (".json", _json_edit(lambda i: i | {"error": "abc"}), "abc"),
    "json of another kind": (".json", _json_edit(lambda i: i | {"kind": "x"}), "kind"),
    "json missing": (".json", lambda p: p.unlink(), "no file"),
}


@pytest.mark.parametrize("name", list(UNREADABLE_CASES))
def test_an_unreadable_case_is_one_line_naming_the_file(found, tmp_path, capsys, name):
    suffix, spoil, what = UNREADABLE_CASES[name]
    npz = cases.save(found[0], tmp_path / "case")
    bad = npz.with_suffix(suffix)
    spoil(bad)
    with pytest.raises(InvalidArgument, match=f"^{bad}: "):
        cases.replay(npz)
    assert cli.main(["replay", str(npz)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mhanum replay: {bad}: ")
    assert what in err
    assert err.count("\n") == 1
