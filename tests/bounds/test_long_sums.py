"""Sums too long for γ_n: bounded through ``(1 + u)^h - 1`` (Corollary R.1'), never refused.

bfloat16 accumulation over 256 or more terms has ``n·u >= 1``: ``γ_n`` is infinite, and the
bounds used to refuse such inputs. Each term still reaches the sum through at most ``h``
roundings ``1 + δ`` with no division, so ``(1 + u)^h - 1`` bounds it for every ``h``. The bounds
are finite, or infinite with a reason, and they cover the measured error, also on inputs whose
roundings all go one way (positive terms).
"""

from __future__ import annotations

import numpy as np
import pytest

import mhanum as mn
from mhanum.bounds import attention_bound, mha_bound

BF16 = mn.Numerics.preset("bf16")


def _bf16(x: np.ndarray) -> np.ndarray:
    return np.asarray(mn.round_to(x, "bfloat16"), np.float64)


@pytest.mark.parametrize("kind", ["normal", "positive"])
@pytest.mark.parametrize(("keys", "d"), [(8, 256), (8, 512), (300, 64)])
def test_long_bfloat16_sums_are_bounded_and_covered(keys, d, kind):
    rng = np.random.default_rng(keys + d)
    draw = (lambda s: rng.uniform(0.0, 0.2, s)) if kind == "positive" else rng.standard_normal
    q, k, v = _bf16(draw((4, d))), _bf16(draw((keys, d))), _bf16(draw((keys, 16)))
    if kind == "normal":
        q = q / np.sqrt(d)
    bound = attention_bound(q, k, v, numerics=BF16)
    out = np.asarray(mn.attention(q, k, v, numerics=BF16), np.float64)
    err = np.abs(out - np.asarray(mn.reference.attention(q, k, v), np.float64))
    assert np.all(err <= bound.total)
    if not np.all(np.isfinite(bound.total)):
        assert bound.reasons  # infinite only with the reason
    if (keys, d, kind) == (8, 256, "normal"):
        # small logit errors and a sum of 8 terms: a finite bound (the case used to be refused)
        assert np.all(np.isfinite(bound.total))


def test_mha_with_a_bfloat16_projection_of_512_terms_is_bounded():
    params = mn.MHAParams.random(512, seed=1)
    x = _bf16(np.random.default_rng(1).standard_normal((1, 8, 512)))
    bound = mha_bound(x, x, params, 8, numerics=BF16)
    out = np.asarray(mn.multi_head_attention(x, x, params, 8, numerics=BF16), np.float64)
    exact = np.asarray(mn.reference.multi_head_attention(x, x, params, 8), np.float64)
    assert np.all(np.abs(out - exact) <= bound.total)
    assert np.all(np.isfinite(bound.total)) or bound.reasons
