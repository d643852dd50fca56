"""``attention_bound(..., input_rounding=)``: the rounding of float64 inputs into the input
format taken exactly (two certified references, as ``mha_bound`` does) or bounded (step 1)."""

from __future__ import annotations

import numpy as np
import pytest

import mhanum as mn
from mhanum import InvalidArgument, reference
from mhanum.bounds import attention_bound
from mhanum.bounds.forward.operands import read_by_the_dot
from mhanum.formats import round_to
from mhanum.masks import causal as causal_band
from mhanum.rope import Rope


def _inputs(seed: int, n: int = 32, d: int = 16) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((n, d)).astype(np.float32).astype(np.float64) for _ in range(3)]


@pytest.mark.parametrize("preset", ["bf16-fp32acc", "fp16-fp32acc", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
def test_the_exact_rounding_is_the_references_difference_and_holds(preset, causal):
    """The term is ``|o(q̂, k̂, v̂) - o(q, k, v)|`` to within float64 (closed form: two
    certified references); the bound holds on the emulation, which reads the rounded inputs,
    and is below the bounded form at the median (the inputs' rounding enters with its signs)."""
    num = mn.Numerics.preset(preset)
    fmt = num.format_of("input")
    _the_term_is_the_difference_and_the_bound_holds(num, causal, lambda x, _: round_to(x, fmt))


OPERAND_ROUNDINGS = {
    "tf32": mn.Numerics.preset("tf32"),
    "tf32-q": mn.Numerics.preset("tf32").replace(scale="q"),
    "tf32-qk": mn.Numerics.preset("tf32").replace(scale="qk"),
    "bf16x1": mn.Numerics.preset("fp32").replace(dot="bf16x1"),
    "fp32-bf16-operands": mn.Numerics.preset("fp32").replace(operand_format="bfloat16"),
}


@pytest.mark.parametrize("name", OPERAND_ROUNDINGS)
@pytest.mark.parametrize("causal", [False, True])
def test_the_operands_read_enters_with_its_signs_and_holds(name, causal):
    """Step 1k: float32 inputs (nothing rounds into the input format) read by dots through an
    operand format; the term is the references' difference for the operands as the dots read
    them (``q`` with the scale on the scores, ``k`` unless it is on ``q`` and ``k``, ``v``)."""
    num = OPERAND_ROUNDINGS[name]

    def read(x: np.ndarray, which: str) -> np.ndarray:
        direct = which == "v" or (which == "k" and num.scale != "qk") or num.scale == "scores"
        return read_by_the_dot(x, num) if direct else x

    _the_term_is_the_difference_and_the_bound_holds(num, causal, read)


def _the_term_is_the_difference_and_the_bound_holds(num, causal, read):
    q, k, v = _inputs(1)
    mask = causal_band() if causal else None
    exact = attention_bound(q, k, v, mask, numerics=num, input_rounding="exact")
    bounded = attention_bound(q, k, v, mask, numerics=num)
    rounded = [read(x, which) for x, which in zip((q, k, v), "qkv", strict=True)]
    keep = np.tril(np.ones((32, 32), bool)) if causal else None
    shift = np.abs(
        reference.attention(*rounded, mask=keep) - reference.attention(q, k, v, mask=keep)
    )
    term = exact.terms["input_rounding"]
    assert np.all(term >= shift)
    assert np.all(term <= shift * (1 + 2.0**-40) + 2.0**-50 * np.abs(v).max())
    out = np.asarray(mn.attention(q, k, v, keep, numerics=num), np.float64)
    err = np.abs(out - np.asarray(reference.attention(q, k, v, mask=keep), np.float64))
    assert np.all(err <= exact.total)
    assert np.median(exact.total) < np.median(bounded.total)


def test_inputs_already_in_the_format_are_bounded_as_before():
    num = mn.Numerics.preset("bf16-fp32acc")
    q, k, v = (round_to(x, "bfloat16") for x in _inputs(2))
    a = attention_bound(q, k, v, numerics=num, input_rounding="exact")
    b = attention_bound(q, k, v, numerics=num)
    assert "input_rounding" not in a.terms
    np.testing.assert_array_equal(a.total, b.total)


def test_the_probabilistic_bound_keeps_its_probability():
    num = mn.Numerics.preset("bf16-fp32acc")
    q, k, v = _inputs(3)
    a = attention_bound(q, k, v, numerics=num, probability=0.99, input_rounding="auto")
    assert "input_rounding" in a.terms
    assert a.probability >= 0.99


def test_bad_values_and_stages_before_the_dots():
    q, k, v = _inputs(4, n=4, d=4)
    with pytest.raises(InvalidArgument, match="input_rounding: expected one of"):
        attention_bound(q, k, v, numerics="bf16-fp32acc", input_rounding="yes")
    rope = Rope(dim=4)
    a = attention_bound(q, k, v, numerics="bf16-fp32acc", rope=rope, input_rounding="exact")
    assert "input_rounding" not in a.terms  # (a rotation stands between: bounded)
