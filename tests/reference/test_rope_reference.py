"""The certified reference of rotated inputs (``reference.attention(..., rope=)``,
papers/rope.md, P.4): the exact rotation as Arb balls, checked against 200-bit mpmath, against
the relative-position invariance of the exact scores, against a naive mpmath attention of the
exact rotation, and with Lemma P.3's float64 rotation inside its certified distance."""

from __future__ import annotations

import flint
import mpmath
import numpy as np
import pytest

from mhanum import InvalidArgument, reference
from mhanum.reference._rope import arb_rotation
from mhanum.rope import Rope, reference_rope
from tests.test_rope import SCALED, mp_rotation

POSITIONS = np.array([0, 1, 7, 1857, 65_535, 131_071])


def _balls(x: np.ndarray, positions: np.ndarray, rope: Rope, prec: int) -> np.ndarray:
    saved = flint.ctx.prec
    flint.ctx.prec = prec
    try:
        return arb_rotation(x, positions, rope, flint)
    finally:
        flint.ctx.prec = saved


@pytest.mark.parametrize("scaling", sorted(SCALED))
@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_the_balls_enclose_the_exact_rotation(scaling: str, layout: str) -> None:
    """Each ball of ``arb_rotation`` at 256 bits is within ``2^-200`` (relative to the entries'
    size) of mpmath's rotation at 400 bits, at positions up to 2^17 with entries over 2^±60."""
    rng = np.random.default_rng(len(scaling) + len(layout))
    x = rng.standard_normal((POSITIONS.size, 14)) * np.exp2(rng.integers(-60, 60, (1, 14)))
    rope = Rope(dim=12, layout=layout, scaling=scaling, **SCALED[scaling])
    balls = _balls(x, POSITIONS, rope, 256)
    ctx = mpmath.MPContext()
    ctx.prec = 400
    exact = mp_rotation(ctx, x, POSITIONS, rope)
    size = np.abs(x).max()
    for (row, j), ball in np.ndenumerate(balls):
        mid, rad = ball.mid().man_exp(), ball.rad()
        distance = abs(ctx.mpf((int(mid[0]), int(mid[1]))) - exact[row][j])
        assert float(rad) <= 2.0**-200 * size
        assert distance <= 2.0**-200 * size + ctx.mpf(float(rad.upper()))
    assert all(ball.is_exact() for ball in balls[:, 12:].ravel())  # past rope.dim: unchanged


@pytest.mark.parametrize("scaling", sorted(SCALED))
def test_lemma_p3_the_float64_rotation_is_within_its_distance(scaling: str) -> None:
    """Lemma P.3 against the balls: ``|reference_rope - exact| <= g`` entry by entry, the whole
    ball inside; the distance is not vacuous (the worst ratio above 1/100)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((POSITIONS.size, 16)) * 1e3
    rope = Rope(dim=16, scaling=scaling, **SCALED[scaling])
    x64, g = reference_rope(x, POSITIONS, rope)
    balls = _balls(x, POSITIONS, rope, 200)
    worst = 0.0
    for index, ball in np.ndenumerate(balls):
        far = abs(ball - flint.arb(float(x64[index])))
        assert far.upper() <= flint.arb(float(g[index]))
        worst = max(worst, float(far.mid()) / g[index])
    assert worst > 0.01


@pytest.mark.parametrize("scaling", ["none", "linear", "yarn", "llama3"])
def test_the_exact_scores_depend_on_relative_positions_only(scaling: str) -> None:
    """``(R_m q)·(R_n k) = q·R_{n-m} k`` for the exact rotation: the certified outputs at
    positions ``P`` and ``P + 2^16`` are equal to the bit (the float64 rotation's are not); also
    with a soft-cap and a sink. ``dynamic`` scaling is left out: its base depends on the
    largest position."""
    rng = np.random.default_rng(5)
    q, k, v = (
        rng.standard_normal((2, 3, 8)),
        rng.standard_normal((5, 8)),
        rng.standard_normal((5, 4)),
    )
    rope = Rope(dim=8, scaling=scaling, **{**SCALED[scaling], "base": 500000.0})
    near = (np.arange(2, 5), np.arange(5))
    far = (near[0] + 2**16, near[1] + 2**16)
    extra = {"softcap": 3.0, "sink": np.array([0.5, -1.0])}
    for kw in ({}, extra):
        out = reference.attention(q, k, v, rope=rope, positions=near, **kw)
        assert np.array_equal(out, reference.attention(q, k, v, rope=rope, positions=far, **kw))
    float64 = [reference_rope(q, p[0], rope)[0] for p in (near, far)]
    assert not np.array_equal(float64[0], float64[1])


def test_at_position_zero_the_rotation_is_the_identity() -> None:
    """``θ = 0``: ``cos θ = 1``, ``sin θ = 0`` exactly, so the reference with a rope at position 0
    is the reference of the unrotated inputs, bit for bit (with a mask, a bias and a sink)."""
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((2, 4, 8)) for _ in range(3))
    kw = {
        "mask": np.tril(np.ones((4, 4), bool)),
        "bias": rng.standard_normal((4, 4)),
        "sink": np.array([0.25, 2.0]),
    }
    zeros = (np.zeros(4, np.int64), np.zeros(4, np.int64))
    out = reference.attention(q, k, v, rope=Rope(dim=6), positions=zeros, **kw)
    assert np.array_equal(out, reference.attention(q, k, v, **kw))


def test_the_reference_agrees_with_a_naive_attention_of_the_exact_rotation() -> None:
    """Independent of Arb: mpmath's rotation (400 bits) and a naive softmax; the certified 30
    digits agree to ``10^-28`` relative, and the float64 values are those rounded."""
    rng = np.random.default_rng(11)
    q, k, v = rng.standard_normal((3, 8)), rng.standard_normal((4, 8)), rng.standard_normal((4, 2))
    rope = Rope(dim=8, base=500000.0, layout="interleaved", **SCALED["yarn"])
    positions = (np.array([4097, 4098, 4099]), np.array([4096, 4097, 4098, 4099]))
    out, mp = reference.attention(
        q, k, v, rope=rope, positions=positions, digits=30, return_mpf=True
    )
    ctx = mpmath.MPContext()
    ctx.prec = 400
    qr, kr = mp_rotation(ctx, q, positions[0], rope), mp_rotation(ctx, k, positions[1], rope)
    scale = 1 / ctx.sqrt(8)
    for i in range(3):
        logits = [
            scale * ctx.fsum(a * b for a, b in zip(qr[i], kr[j], strict=True)) for j in range(4)
        ]
        weights = [ctx.exp(s - max(logits)) for s in logits]
        for c in range(2):
            exact = ctx.fsum(w * float(v[j, c]) for j, w in enumerate(weights)) / ctx.fsum(weights)
            assert abs(ctx.mpf(mp[i, c]) - exact) <= ctx.mpf(10) ** -28 * abs(exact)
            assert out[i, c] == float(exact)


def test_an_output_whose_values_are_zero_is_exactly_zero() -> None:
    """Proved 0 with no test of the irrational logits: the column of ``v`` is 0 over the keys;
    a column that cancels with two equal rotated keys (same key, same position) is certified 0
    by its enclosure."""
    rng = np.random.default_rng(13)
    q, k = rng.standard_normal((2, 4)), rng.standard_normal((1, 4)).repeat(2, axis=0)
    v = np.array([[0.0, 1.0], [0.0, -1.0]])
    positions = (np.array([3, 9]), np.array([5, 5]))
    out = reference.attention(q, k, v, rope=Rope(dim=4), positions=positions)
    assert np.array_equal(out, np.zeros((2, 2)))


@pytest.mark.parametrize("backend", ["dd", "exact", "mpmath"])
def test_backends_without_balls_refuse_a_rope(backend: str) -> None:
    x = np.ones((2, 4))
    with pytest.raises(InvalidArgument, match=f"backend: '{backend}' does not take rope="):
        reference.attention(x, x, x, rope=Rope(dim=4), backend=backend)


def test_positions_are_read_as_the_problem_reads_them() -> None:
    x = np.ones((2, 4))
    with pytest.raises(InvalidArgument, match="positions: expected only with rope="):
        reference.attention(x, x, x, positions=np.arange(2))
    with pytest.raises(InvalidArgument, match="positions: expected non-negative"):
        reference.attention(x, x, x, rope=Rope(dim=4), positions=np.array([-1, 0]))
    with pytest.raises(InvalidArgument, match="rope: expected a rotary dimension of at most"):
        reference.attention(x, x, x, rope=Rope(dim=6))
