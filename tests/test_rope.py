"""RoPE as a numerical stage (``mhanum.rope``, papers/rope.md): Theorem P.1 against the exact
rotation, against ``transformers``' own RoPE, the gpt-neox#1003 case to the digit, and bad input."""

from __future__ import annotations

import math

import mpmath
import numpy as np
import pytest

from mhanum import InvalidArgument, Numerics
from mhanum.formats import round_to
from mhanum.rope import (
    Rope,
    angles,
    apply_rope,
    exact_inv_freq,
    inv_freq_enclosure,
    reference_rope,
    rope_error,
)

_CTX = mpmath.MPContext()
_CTX.prec = 200

SCALED = {
    "none": {},
    "linear": {"factor": 4.0},
    "dynamic": {"factor": 4.0, "original_max_position": 512},
    "yarn": {"factor": 4.0, "original_max_position": 2048},
    "llama3": {
        "base": 500000.0,
        "factor": 8.0,
        "original_max_position": 8192,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
    },
}


def mp_rotation(ctx: mpmath.MPContext, x: np.ndarray, positions: np.ndarray, rope: Rope) -> list:
    """The exact rotation of ``x`` in mpmath at ``ctx.prec`` (``exact_inv_freq``'s ω, mpmath's
    cos and sin), rows of mpf, written out independently of :mod:`mhanum.rope`'s pairing."""
    omega = exact_inv_freq(rope, int(positions.max()) + 1, prec=ctx.prec)
    k = ctx.mpf(rope.table_scale)
    d, half = rope.dim, rope.dim // 2
    rows = []
    for row, p in enumerate(positions):
        out = [ctx.mpf(float(t)) for t in x[row]]
        for j in range(d):
            if rope.layout == "half":
                partner, sign, i = (j + half, -1, j) if j < half else (j - half, 1, j - half)
            else:
                partner, sign, i = j ^ 1, (-1 if j % 2 == 0 else 1), j // 2
            theta = ctx.mpf(int(p)) * ctx.mpf(omega[i])
            out[j] = k * (
                ctx.mpf(float(x[row, j])) * ctx.cos(theta)
                + sign * ctx.mpf(float(x[row, partner])) * ctx.sin(theta)
            )
        rows.append(out)
    return rows


def _exact_rotation(x: np.ndarray, positions: np.ndarray, rope: Rope) -> np.ndarray:
    """The exact rotation of ``x`` (200-bit mpmath), rounded to float64."""
    return np.array([[float(t) for t in row] for row in mp_rotation(_CTX, x, positions, rope)])


@pytest.mark.parametrize("scaling", sorted(SCALED))
@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_the_emulated_rotation_is_within_theorem_p1_of_the_exact_one(
    scaling: str, fmt: str, layout: str
) -> None:
    """P.1: ``|apply_rope - exact| <= rope_error`` entry by entry, against 200-bit mpmath, at
    positions up to 2^17 (and 2^11 for float16 products), with entries over the exponent range."""
    rng = np.random.default_rng(sorted(SCALED).index(scaling))
    top = 2**11 if fmt == "float16" else 2**17
    positions = np.unique(np.concatenate([[0, 1, 2, top - 1], rng.integers(0, top, 6)]))
    lo, hi = (-24, 14) if fmt == "float16" else (-130, 120)  # subnormals to near overflow
    x = rng.standard_normal((positions.size, 16)) * np.exp2(rng.integers(lo, hi, (1, 16)))
    x = round_to(x, fmt)
    rope = Rope(
        dim=12, layout=layout, scaling=scaling, product_format=fmt, table_format=fmt,
        rotation_format=fmt, **SCALED[scaling],
    )  # fmt: skip
    exact = _exact_rotation(x, positions, rope)
    err = np.abs(apply_rope(x, positions, rope) - exact)
    bound = rope_error(x, positions, rope) + 2.0**-52 * np.abs(exact)
    assert np.all(err <= bound)
    assert np.array_equal(err[:, 12:], np.zeros_like(err[:, 12:]))  # partial: passed unchanged


def test_the_float64_reference_is_within_its_certified_error() -> None:
    """Lemma P.3: ``reference_rope``'s float64 rotation is within its error of the exact one."""
    rng = np.random.default_rng(1)
    positions = np.array([0, 1, 1857, 65_535, 131_071])
    x = rng.standard_normal((5, 16)) * 1e3
    for scaling in sorted(SCALED):
        rope = Rope(dim=16, scaling=scaling, **SCALED[scaling])
        ref, ref_err = reference_rope(x, positions, rope)
        exact = _exact_rotation(x, positions, rope)
        assert np.all(np.abs(ref - exact) <= ref_err + 2.0**-53 * np.abs(exact))


def test_gpt_neox_1003_to_the_digit() -> None:
    """EleutherAI/gpt-neox#1003: seqlen 2048, dim 32, base 10000, the angles in float16:
    ``emb[1857, 1]`` is 1045 against 1044.2678, and cos is off by 0.7819 at worst."""
    half = Rope(
        dim=32, inv_freq_format="float16", position_format="float16", product_format="float16",
        trig_format="float32", table_format="float16", rotation_format="float16",
    )  # fmt: skip
    full = Rope(dim=32)
    positions = np.arange(2048)
    assert angles(half, positions)[1857, 1] == 1045.0
    assert f"{angles(full, positions)[1857, 1]:.4f}" == "1044.2678"
    # the cos_half (fp16 angles, cos in float32 of them, as torch's half cos) against
    # cos_float (float32 throughout)
    cos_half = round_to(np.cos(angles(half, positions)), "float32")
    cos_half = round_to(cos_half, "float16")
    cos_float = round_to(np.cos(angles(full, positions)), "float32")
    assert f"{np.max(np.abs(cos_half - cos_float)):.4f}" == "0.7819"
    # and Theorem P.1 covers the float16 kernel's rotation of every entry
    x = np.ones((2048, 32))
    exact, ref_err = reference_rope(x, positions, full)
    err = np.abs(apply_rope(x, positions, half) - exact)
    assert np.all(err <= rope_error(x, positions, half) + ref_err)
    assert err.max() > 1.0  # the bug is real: a rotated entry off by more than 1


@pytest.mark.slow
def test_the_enclosure_contains_transformers_inverse_frequencies() -> None:
    """Lemma P.2 against the real thing: ``transformers``' float32 ``inv_freq`` for every
    scaling lies in :func:`inv_freq_enclosure`."""
    torch = pytest.importorskip(
        "torch", reason="torch is not installed: pip install -e .[frameworks]"
    )
    transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    names = {"linear": "linear", "dynamic": "dynamic", "yarn": "yarn", "llama3": "llama3"}
    for scaling, name in names.items():
        extra = SCALED[scaling]
        params = {"rope_type": name, "rope_theta": extra.get("base", 10000.0), "factor": 4.0}
        params["factor"] = extra["factor"]
        for key, hf_key in (
            (
                "original_max_position",
                "original_max_position_embeddings" if scaling != "dynamic" else "",
            ),
            ("low_freq_factor", "low_freq_factor"),
            ("high_freq_factor", "high_freq_factor"),
        ):
            if key in extra and hf_key:
                params[hf_key] = extra[key]
        # dynamic NTK reads M from max_position_embeddings; yarn and llama3 want it above the
        # original context
        m = extra.get("original_max_position", 2048)
        cfg = transformers.LlamaConfig(
            hidden_size=128, num_attention_heads=2, head_dim=64,
            max_position_embeddings=m if scaling == "dynamic" else 2 * m,
            rope_parameters=params,
        )  # fmt: skip
        seq_len = 3000
        inv, _ = ROPE_INIT_FUNCTIONS[name](cfg, torch.device("cpu"), seq_len=seq_len)
        lo, hi = inv_freq_enclosure(Rope(dim=64, scaling=scaling, **extra), seq_len)
        got = inv.double().numpy()
        assert np.all((lo <= got) & (got <= hi)), scaling


@pytest.mark.slow
def test_the_bound_holds_for_transformers_rope_and_is_not_vacuous() -> None:
    """P.1 against ``transformers``' ``LlamaRotaryEmbedding`` and ``apply_rotary_pos_emb`` in
    float32, bfloat16 and float16 (tables in the model's dtype): never exceeded, and within a
    factor 40 of the measured error at the median."""
    torch = pytest.importorskip(
        "torch", reason="torch is not installed: pip install -e .[frameworks]"
    )
    transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")
    from transformers.models.llama.modeling_llama import (
        LlamaRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    rng = np.random.default_rng(0)
    positions = np.arange(4096)
    cfg = transformers.LlamaConfig(
        hidden_size=128, num_attention_heads=2, head_dim=64, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )  # fmt: skip
    emb = LlamaRotaryEmbedding(cfg)
    for dtype, fmt in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16"),
                       (torch.float16, "float16")):  # fmt: skip
        x = round_to(rng.standard_normal((4096, 64)), fmt)
        xt = torch.tensor(x, dtype=dtype)[None, None]
        cos, sin = emb(xt, torch.tensor(positions)[None])
        got = apply_rotary_pos_emb(xt, xt, cos, sin)[0][0, 0].double().numpy()
        rope = Rope(dim=64, table_format=fmt, rotation_format=fmt)
        ref, ref_err = reference_rope(x, positions, rope)
        bound = rope_error(x, positions, rope) + ref_err
        err = np.abs(got - ref)
        assert np.all(err <= bound), fmt
        hit = err > 0
        assert np.median(bound[hit] / err[hit]) <= 40, fmt


@pytest.mark.parametrize(
    ("preset", "fmt"),
    [("fp32", "float32"), ("bf16-fp32acc", "bfloat16"), ("fp16-fp32acc", "float16")],
)
@pytest.mark.parametrize("base", [1e4, 5e5])
def test_attention_with_rope_is_within_theorem_a1_with_p1(
    preset: str, fmt: str, base: float
) -> None:
    """``attention_bound(..., rope=)``: the emulated kernel (rotation as the Rope states, then
    the attention's numerics) is within the bound of the exact attention of the exactly
    rotated inputs, at positions past 2^12 and for a decoding step (one query, the last
    position); against the certified reference of the exact rotation (``rope=``)."""
    import mhanum
    from mhanum import reference
    from mhanum.bounds import attention_bound

    rng = np.random.default_rng(int(base) % 97)
    q, k, v = (round_to(rng.standard_normal((32, 16)), fmt) for _ in range(3))
    rope = Rope(dim=16, base=base, table_format=fmt, rotation_format=fmt)
    cases = [
        ((np.arange(4096, 4128), np.arange(4096, 4128)), q),
        (None, q[-1:]),  # a decoding step: the query is the last key's position
    ]
    for positions, queries in cases:
        out = mhanum.attention(queries, k, v, numerics=preset, rope=rope, positions=positions)
        b = attention_bound(queries, k, v, numerics=preset, rope=rope, positions=positions)
        exact = reference.attention(queries, k, v, rope=rope, positions=positions)
        err = np.abs(np.asarray(out, np.float64) - exact)
        assert np.all(err <= b.total + 2.0**-52 * np.abs(exact))


def test_rope_arguments_are_checked_with_the_problem() -> None:
    from mhanum.problem import AttentionProblem

    x = np.ones((4, 8))
    with pytest.raises(InvalidArgument, match=r"rope: expected a mhanum\.rope\.Rope, got dict"):
        AttentionProblem.of(x, x, x, rope={"dim": 8})
    with pytest.raises(
        InvalidArgument, match="rope: expected a rotary dimension of at most d_k = 8"
    ):
        AttentionProblem.of(x, x, x, rope=Rope(dim=16))
    with pytest.raises(InvalidArgument, match="positions: expected only with rope="):
        AttentionProblem.of(x, x, x, positions=np.arange(4))
    with pytest.raises(
        InvalidArgument, match="positions: expected 4 positions of the queries, got 3"
    ):
        AttentionProblem.of(x, x, x, rope=Rope(dim=8), positions=np.arange(3))
    with pytest.raises(InvalidArgument, match=r"positions: expected a pair \(queries', keys'\)"):
        AttentionProblem.of(x[:2], x, x, rope=Rope(dim=8), positions=np.arange(2))
    p = AttentionProblem.of(x[:1], x, x, rope=Rope(dim=8))
    assert p.positions is not None
    assert p.positions[0].tolist() == [3]
    assert p.positions[1].tolist() == [0, 1, 2, 3]


def test_the_papers_figure_script_keeps_the_bound() -> None:
    """``papers/rope_figure.py`` asserts P.4 at every position it draws (here up to 4096)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "papers" / "rope_figure.py"
    spec = importlib.util.spec_from_file_location("rope_figure", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--max-position", "4096"]) == 0


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: Rope(dim=7), "rope.dim: expected an even rotary dimension, got 7"),
        (lambda: Rope(dim=0), "rope.dim"),
        (lambda: Rope(dim=8, scaling="ntk-by-parts"), "rope.scaling: expected one of"),
        (lambda: Rope(dim=8, scaling="yarn", factor=4.0), "rope.original_max_position"),
        (
            lambda: Rope(dim=2, scaling="dynamic", original_max_position=8),
            r"rope.dim: expected at least 4 with scaling 'dynamic' \(its base's exponent",
        ),
        (lambda: Rope(dim=8, base=1.0), "rope.base: expected a base above 1"),
        (lambda: Rope(dim=8, factor=math.nan), "rope.factor: expected a finite positive"),
        (lambda: Rope(dim=8, table_format="float12"), "rope.table_format"),
        (lambda: Rope(dim=8, layout="gptj"), "rope.layout: expected 'half' or 'interleaved'"),
        (lambda: rope_error(np.ones((2, 8)), [0, -1], Rope(dim=8)), "positions: expected non-neg"),
        (
            lambda: rope_error(np.ones((2, 8)), [0, 1.5], Rope(dim=8)),
            "positions: expected integers",
        ),
        (
            lambda: rope_error(np.ones((2, 8)), [0, 300], Rope(dim=8, position_format="bfloat16")),
            "positions: expected positions up to 256, which bfloat16 represents exactly",
        ),
        (
            lambda: rope_error(np.ones((2, 8)), np.array([0, 2**63], np.uint64), Rope(dim=8)),
            r"positions: expected positions up to 1\.67772e\+07, .*, got 9223372036854775808$",
        ),
        (
            lambda: rope_error(np.ones((2, 8)), [0.0, 1e20], Rope(dim=8)),
            r"positions: expected positions up to .*, got 100000000000000000000$",
        ),
        (
            lambda: rope_error(np.ones((3, 8)), [0, 1], Rope(dim=8)),
            r"x: expected shape \(\.\.\., 2",
        ),
        (
            lambda: apply_rope(
                np.full((2, 8), 0.1), [0, 1], Rope(dim=8, rotation_format="bfloat16")
            ),
            "x: expected values of rope.rotation_format",
        ),
        (lambda: apply_rope(np.full((2, 8), np.nan), [0, 1], Rope(dim=8)), "x: expected finite"),
    ],
)
def test_bad_input_is_refused_by_name(make, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        make()


def test_two_schedules_with_rope_differ_within_theorem_a5() -> None:
    """``schedule_difference(..., rope=)``: two schedules that rotate as the Rope states differ
    within A.5 (each side's A.1 with the rotated entries' errors, around the exact attention of
    the exactly rotated inputs); A.5' is not taken, and the bound exceeds the one without the
    rope (bfloat16 tables at positions past 2^12)."""
    import mhanum
    from mhanum.bounds import schedule_difference

    rng = np.random.default_rng(17)
    q, k, v = (round_to(rng.standard_normal((24, 16)), "bfloat16") for _ in range(3))
    rope = Rope(dim=16, base=5e5, table_format="bfloat16", rotation_format="bfloat16")
    positions = (np.arange(5000, 5024), np.arange(5000, 5024))
    schedules = {
        "numerics_a": "bf16-fp32acc",
        "numerics_b": Numerics(
            input="bfloat16", accum="float32", softmax="online(8)", output_format="bfloat16"
        ),
    }
    kw = {"rope": rope, "positions": positions}
    a, b = (mhanum.attention(q, k, v, numerics=n, **kw) for n in schedules.values())
    d = schedule_difference(q, k, v, **schedules, **kw)
    assert d.theorem == "A.5"
    gap = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
    assert gap.max() > 0
    assert np.all(gap <= d.total)
    assert np.all(d.total >= schedule_difference(q, k, v, **schedules).total)


@pytest.mark.parametrize(("preset", "fmt"), [("fp32", "float32"), ("bf16-fp32acc", "bfloat16")])
def test_the_a_priori_bound_with_rope_covers_every_input_of_those_norms(preset, fmt) -> None:
    """Corollary P.7 in Theorem A.4: inputs of the stated row norms, rotated by a kernel with
    bfloat16 tables at positions past 2^12, err within ``attention_bound_a_priori(rope=)`` of the
    exact attention of the exactly rotated inputs (the certified reference), for rows at the
    norm and rows far below it; the bound exceeds the one without the rope."""
    import mhanum
    from mhanum import reference
    from mhanum.bounds import attention_bound_a_priori

    rng = np.random.default_rng(23)
    rope = Rope(dim=16, base=5e5, table_format="bfloat16", rotation_format=fmt)
    positions = (np.arange(5000, 5012), np.arange(5000, 5012))
    norm = 6.0
    kw = {"q_norm": norm, "k_norm": norm, "v_max": 2.0, "numerics": preset}
    bound = attention_bound_a_priori(12, 12, 16, rope=rope, positions=positions, **kw)
    assert np.all(bound.total > attention_bound_a_priori(12, 12, 16, **kw).total)
    for shrink in (1.0, 1e-3):
        q, k = (rng.standard_normal((12, 16)) for _ in range(2))
        q, k = (norm * shrink * x / np.linalg.norm(x, axis=-1, keepdims=True) * (1 - 2**-20)
                for x in (q, k))  # fmt: skip
        q, k = (round_to(x, fmt) for x in (q, k))
        v = round_to(rng.uniform(-2, 2, (12, 16)), fmt)
        out = mhanum.attention(q, k, v, numerics=preset, rope=rope, positions=positions)
        exact = reference.attention(q, k, v, rope=rope, positions=positions)
        err = np.abs(np.asarray(out, np.float64) - exact)
        assert np.all(err <= bound.total)
    with pytest.raises(InvalidArgument, match=r"rope\.rotation_format: expected a format that"):
        attention_bound_a_priori(
            12, 12, 16, rope=Rope(dim=16, rotation_format="bfloat16"), **{**kw, "numerics": "fp32"}
        )
    with pytest.raises(InvalidArgument, match="positions: expected only with rope="):
        attention_bound_a_priori(12, 12, 16, positions=np.arange(12), **kw)


def test_a_rotation_that_may_overflow_its_format_is_unbounded_with_its_reason() -> None:
    """Range (R) at the edge of float16: a pair near 60,000 rotates to up to √2 of it, past
    65,504 at some angles; P.1 is inf there, and so is the attention's bound, with a reason,
    single-head and multi-head (the rotation stored in the float16 storage format)."""
    import mhanum
    from mhanum.bounds import attention_bound, mha_bound

    rope = Rope(dim=4, table_format="float16", rotation_format="float16", product_format="float16")
    x = np.array([[60000.0] * 4, [1.0] * 4])
    positions = np.array([3, 4])  # at 3 radians |cos| + |sin| is 1.13: 60,000 may reach 67,900
    err = rope_error(x, positions, rope)
    assert np.isinf(err[0, [0, 2]]).all()
    assert np.isfinite(err[1]).all()
    b = attention_bound(x, x, x, numerics="fp16-fp32acc", rope=rope, positions=positions)
    assert np.isinf(b.total).any()
    assert b.reasons
    params = mhanum.MHAParams(wq=np.eye(4) * 2, wk=np.eye(4), wv=np.eye(4), wo=np.eye(4))
    y = mha_bound(x / 2, x / 2, params, 1, numerics="fp16-fp32acc", rope=rope, positions=positions)
    assert np.isinf(y.total).any()
    assert y.reasons
