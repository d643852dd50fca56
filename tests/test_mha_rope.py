"""RoPE in multi-head attention: every head's projected queries and keys rotated (papers/rope.md,
Corollary P.6), emulated, certified (``reference.multi_head_attention(..., rope=)``, Arb balls)
and bounded (``mha_bound(..., rope=)``), tested against each other."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import mhanum
from mhanum import InvalidArgument, MHAParams, reference
from mhanum.bounds import mha_bound
from mhanum.problem import MHAProblem
from mhanum.rope import Rope

jax.config.update("jax_enable_x64", True)

POSITIONS = np.arange(4090, 4096)  # past 2^12
CASES = {
    "plain": {},
    "sink": {"sink": np.array([0.3, -0.2, 0.1, 0.0])},
    "gqa-causal": {"num_kv_heads": 2, "mask": np.tril(np.ones((6, 6), bool))},
}


def _layer(case: str) -> MHAParams:
    kv = 16 if "num_kv_heads" in CASES[case] else None
    return MHAParams.random(32, seed=1, kv_width=kv)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("base", [1e4, 5e5])
@pytest.mark.parametrize(
    ("preset", "fmt"),
    [("fp32", "float32"), ("bf16-fp32acc", "bfloat16"), ("fp16-fp32acc", "float16")],
)
def test_the_emulated_layer_is_within_the_bound_of_the_exactly_rotated_one(
    preset: str, fmt: str, base: float, case: str
) -> None:
    """``|multi_head_attention(rope=) - reference(rope=)| <= mha_bound(rope=)``: tables and
    rotation in the preset's format, positions past 2^12, with a sink, GQA and a causal mask."""
    rng = np.random.default_rng(int(base) % 89 + len(case))
    x = rng.standard_normal((2, 6, 32))
    params, kw = _layer(case), CASES[case]
    rope = Rope(dim=8, base=base, table_format=fmt, rotation_format=fmt)
    out = mhanum.multi_head_attention(
        x, x, params, 4, numerics=preset, rope=rope, positions=POSITIONS, **kw
    )
    b = mha_bound(x, x, params, 4, numerics=preset, rope=rope, positions=POSITIONS, **kw)
    exact = reference.multi_head_attention(x, x, params, 4, rope=rope, positions=POSITIONS, **kw)
    err = np.abs(np.asarray(out, np.float64) - exact)
    assert np.all(err <= b.total)


def test_the_rotation_is_charged_where_it_dominates() -> None:
    """A kernel whose tables are bfloat16 under float32 attention: its error exceeds the bound
    that leaves the rotation out (so the rotation's term is needed), and stays within the
    bound with it."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((6, 32)) * 4
    params = MHAParams.random(32, seed=3)
    rope = Rope(dim=8, base=5e5, table_format="bfloat16")
    out = mhanum.multi_head_attention(
        x, x, params, 4, numerics="fp32", rope=rope, positions=POSITIONS
    )
    exact = reference.multi_head_attention(x, x, params, 4, rope=rope, positions=POSITIONS)
    err = np.abs(np.asarray(out, np.float64) - exact)
    with_rope = mha_bound(x, x, params, 4, numerics="fp32", rope=rope, positions=POSITIONS)
    without = mha_bound(x, x, params, 4, numerics="fp32")
    assert np.all(err <= with_rope.total)
    assert np.max(err / without.total) > 1


def test_at_position_zero_the_layer_is_the_unrotated_one() -> None:
    """``θ = 0`` rotates nothing: the emulation and the reference with a rope at position 0
    equal those without, bit for bit."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((5, 16))
    params = MHAParams.random(16, seed=0)
    zero = np.zeros(5, np.int64)
    rope = Rope(dim=8, table_format="bfloat16", rotation_format="bfloat16")
    kw = {"sink": np.array([0.1, 0.2])}
    for numerics in ("bf16-fp32acc", "fp32"):
        r = rope if numerics != "fp32" else Rope(dim=8)
        a = mhanum.multi_head_attention(x, x, params, 2, numerics=numerics, **kw)
        b = mhanum.multi_head_attention(
            x, x, params, 2, numerics=numerics, rope=r, positions=zero, **kw
        )
        assert np.array_equal(np.asarray(a), np.asarray(b))
    a = reference.multi_head_attention(x, x, params, 2, **kw)
    assert np.array_equal(
        a, reference.multi_head_attention(x, x, params, 2, rope=rope, positions=zero, **kw)
    )


def test_the_certified_layer_depends_on_relative_positions_only() -> None:
    """The exact rotation's scores depend on ``n - m`` only: the certified layer at positions
    ``P`` and ``P + 2^16`` is equal to the bit."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((5, 16))
    params = MHAParams.random(16, seed=6)
    rope = Rope(dim=6, base=5e5)
    near = reference.multi_head_attention(x, x, params, 2, rope=rope, positions=np.arange(5) + 9)
    far = reference.multi_head_attention(
        x, x, params, 2, rope=rope, positions=np.arange(5) + 2**16 + 9
    )
    assert np.array_equal(near, far)


def test_rope_arguments_are_checked() -> None:
    x = np.ones((4, 16))
    params = MHAParams.random(16, seed=0)
    narrow = Rope(dim=8, rotation_format="bfloat16")
    with pytest.raises(
        InvalidArgument, match=r"rope.rotation_format: expected a format that holds"
    ):
        mhanum.multi_head_attention(x, x, params, 2, numerics="fp32", rope=narrow)
    with pytest.raises(
        InvalidArgument, match=r"rope.rotation_format: expected a format that holds"
    ):
        mha_bound(x, x, params, 2, numerics="fp32", rope=narrow)
    with pytest.raises(InvalidArgument, match="rope: expected a rotary dimension of at most"):
        mha_bound(x, x, params, 2, numerics="fp32", rope=Rope(dim=10))
    with pytest.raises(InvalidArgument, match="positions: expected only with rope="):
        mhanum.multi_head_attention(x, x, params, 2, positions=np.arange(4))
    with pytest.raises(InvalidArgument, match="backend: 'exact' does not take rope="):
        reference.multi_head_attention(x, x, params, 2, rope=Rope(dim=8), backend="exact")
    with pytest.raises(InvalidArgument, match="rope: expected None for the gradients"):
        MHAProblem.of(x, x, params, 2, rope=Rope(dim=8), d_out=np.ones((4, 16)))


@pytest.mark.parametrize("preset", ["fp32", "bf16-fp32acc"])
def test_the_a_priori_layer_bound_with_rope_covers_the_layer(preset):
    """Corollary P.7 entrywise in A.4 for multi-head attention: the emulated layer with bfloat16
    tables past position 2^12 is within ``mha_bound_a_priori(..., rope=)`` (from ``max |x|``
    and the weights alone) of the certified layer, with grouped keys; the bound is at least
    the one without the rope, and above it in fp32 (in bf16 both reach the magnitudes' cap at
    this size)."""
    from mhanum.bounds import mha_bound_a_priori

    rng = np.random.default_rng(29)
    x = rng.uniform(-1, 1, (2, 6, 32))
    params = MHAParams.random(32, seed=3, kv_width=16)
    fmt = "bfloat16" if preset.startswith("bf16") else "float32"
    rope = Rope(dim=8, base=5e5, table_format="bfloat16", rotation_format=fmt)
    kw = {"num_kv_heads": 2, "rope": rope, "positions": POSITIONS}
    bound = mha_bound_a_priori(params, 4, 6, 6, x_max=1.0, numerics=preset, **kw)
    plain = mha_bound_a_priori(params, 4, 6, 6, x_max=1.0, numerics=preset, num_kv_heads=2)
    assert np.all(bound.total >= plain.total)
    assert preset != "fp32" or np.all(bound.total > plain.total)
    out = mhanum.multi_head_attention(x, x, params, 4, numerics=preset, **kw)
    exact = reference.multi_head_attention(x, x, params, 4, **kw)
    assert np.all(np.abs(np.asarray(out, np.float64) - exact) <= bound.total)
