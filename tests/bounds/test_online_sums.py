"""``online_sums="running"``: the online softmax's sums carried as one chain over every key.

FlashAttention-2/3 add each block's exponentials into the rescaled running row sum and
accumulate each block's P·V into the rescaled running output, the tensor core's C operand. The
emulation computes exactly that (the C operand bit for bit as the tensor-core model's ``dot``
with ``c``), and Theorem A.1 charges the chain over every key.
"""

from __future__ import annotations

import numpy as np
import pytest

import mhanum as mn
from mhanum import InvalidArgument, Numerics
from mhanum.bounds import attention_bound
from mhanum.emulate import tensorcore
from mhanum.units.tensorcore import get_model


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"online_sums": "tree"}, r"^numerics.online_sums: expected one of"),
        ({"online_sums": "running"}, r"^numerics.softmax: expected 'online\(B\)'"),
        ({"online_sums": "running", "softmax": "online(4)", "summation": "pairwise"},
         r"^numerics.summation: expected 'native' or 'sequential'"),
        ({"online_sums": "running", "softmax": "online(4)", "dot": "bf16x3"},
         r"^numerics.dot: expected no split dot"),
    ],
)  # fmt: skip
def test_bad_combinations_raise_naming_the_field(kw, match):
    with pytest.raises(InvalidArgument, match=match):
        Numerics(**kw)


@pytest.mark.parametrize("model", ["a100-fp16", "h100-bf16"])
def test_the_tensor_core_accumulator_is_the_models_c_operand(model):
    mdl = get_model(model)
    rng = np.random.default_rng(5)
    fmt = mdl.input_format
    a = np.asarray(mn.round_to(rng.standard_normal((3, 40)), fmt), np.float32)
    b = np.asarray(mn.round_to(rng.standard_normal((40, 2)), fmt), np.float32)
    c = rng.standard_normal((3, 2)).astype(np.float32) * 1e3
    out = np.asarray(tensorcore.matmul(a, b, model, c=c))
    for i in range(3):
        for j in range(2):
            assert out[i, j] == mdl.dot(a[i].tolist(), b[:, j].tolist(), float(c[i, j]))


FLASH = {
    "tensor core, folded exp2": Numerics(
        input="bfloat16", accum="float32", softmax="online(16)", prob_format="bfloat16",
        output_format="bfloat16", dot="tensor-core(a100-bf16)", exp_form="exp2-folded",
        online_sums="running",
    ),
    "sequential, float32": Numerics(softmax="online(8)", summation="sequential",
                                    online_sums="running"),
    "native, float16": Numerics(input="float16", accum="float32", softmax="online(8)",
                                online_sums="running", prob_format="float16"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(FLASH))
def test_running_sums_are_bounded_and_differ_from_block_sums(name):
    num = FLASH[name]
    rng = np.random.default_rng(6)
    fmt = num.input
    for scale_up in (1.0, 30.0):
        q = np.asarray(mn.round_to(rng.standard_normal((8, 16)) * scale_up, fmt), np.float64)
        k = np.asarray(mn.round_to(rng.standard_normal((70, 16)), fmt), np.float64)
        v = np.asarray(mn.round_to(rng.standard_normal((70, 4)) * 100, fmt), np.float64)
        mask = rng.random((8, 70)) < 0.9
        exact = np.asarray(mn.reference.attention(q, k, v, mask=mask), np.float64)
        running = np.asarray(mn.attention(q, k, v, mask, numerics=num), np.float64)
        bound = attention_bound(q, k, v, mask, numerics=num)
        assert np.all(np.abs(running - exact) <= bound.total)
        block = num.replace(online_sums="block")
        # the carried chain is at least as long as a block's sum plus one addition per block
        assert np.all(bound.total >= attention_bound(q, k, v, mask, numerics=block).total)
    if name == "sequential, float32":
        # the computation really changed: the carried sums round differently (in bfloat16 the
        # output's rounding may hide it)
        other = np.asarray(mn.attention(q, k, v, mask, numerics=block), np.float64)
        assert np.any(other != running)
