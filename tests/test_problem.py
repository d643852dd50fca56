"""The attention problem is checked once, the same way, wherever it enters (one head or a layer).

Every entry point that takes q, k, v and their companions builds one
:class:`mhanum.problem.AttentionProblem`: a bad argument is refused with the same message by the
emulation, the reference and the forward and backward bounds, and one shape rule holds for all
(the batch is that of the inputs; a mask, bias or sink never enlarges it). A backward pass
names d_out among the inputs whose batch dimensions must broadcast.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import mhanum as mn
from mhanum.problem import AttentionProblem

Q, K, V = np.zeros((2, 3)), np.zeros((4, 3)), np.zeros((4, 2))
G = np.ones((2, 2))

ENTRY_POINTS: dict[str, Callable[..., Any]] = {
    "attention": lambda q, k, v, **kw: mn.attention(q, k, v, numerics="fp32", **kw),
    "reference.attention": lambda q, k, v, **kw: mn.reference.attention(q, k, v, **kw),
    "attention_bound": lambda q, k, v, **kw: mn.bounds.attention_bound(q, k, v, **kw),
    "attention_grad": lambda q, k, v, **kw: mn.attention_grad(q, k, v, G, numerics="fp32", **kw),
    "reference.attention_grad": lambda q, k, v, **kw: mn.reference.attention_grad(q, k, v, G, **kw),
    "attention_grad_bound": lambda q, k, v, **kw: mn.bounds.attention_grad_bound(q, k, v, G, **kw),
    "problem": lambda q, k, v, **kw: AttentionProblem.of(q, k, v, **kw),
}

BAD: list[tuple[dict[str, Any], str]] = [
    ({"q": np.zeros((2, 3), np.int32)}, "q: expected a floating-point array, got dtype int32"),
    ({"q": np.zeros(3)}, "q: expected an array with at least 2 dimensions, got shape (3,)"),
    ({"k": np.zeros((4, 2))}, "k: expected last dimension d_k = 3 (from q), got shape (4, 2)"),
    ({"v": np.zeros((5, 2))}, "v: expected 4 keys (Lk, from k) in dimension -2, got shape (5, 2)"),
    ({"q": np.full((2, 3), np.nan)}, "q: expected finite values, got nan at index (0, 0)"),
    ({"q": np.zeros((2, 2, 3)), "k": np.zeros((3, 4, 3))}, "q, k, v[, d_out]: expected broadcas"),
    ({"mask": np.ones((2, 4))}, "mask: expected a boolean array (True = attend), got dtype"),
    ({"mask": np.ones((3, 2, 4), bool)}, "mask: expected a shape broadcastable to (2, 4), got"),
    ({"mask": "causal"}, "mask: expected None, a boolean array or a mhanum.masks.Band, got str"),
    ({"bias": np.full((2, 4), np.inf)}, "bias: expected finite values or -inf, got inf"),
    ({"bias": np.zeros((3, 2, 4))}, "bias: expected a shape broadcastable to (2, 4), got"),
    ({"sink": np.zeros(3)}, "sink: expected one logit per batch element or head"),
    ({"sink": math.nan}, "sink: expected finite logits"),
    ({"scale": math.inf}, "scale: expected None or a finite real number, got inf"),
    ({"softcap": -1.0}, "softcap: expected a finite number > 0"),
    ({"q": np.zeros((0, 3))}, "k: expected at least one query, one key and d_k >= 1, got q (0, 3)"),
    ({"q": np.zeros((0, 2, 3))}, "q, k, v[, d_out]: expected batch dimensions of at least 1, got"),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD, ids=[m.split(":")[0] for _, m in BAD])
@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_a_bad_argument_is_refused_with_one_message_everywhere(
    entry: str, kwargs: dict[str, Any], message: str
) -> None:
    args = {"q": Q, "k": K, "v": V} | kwargs
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    pattern = "^" + re.escape(message).replace(re.escape("[, d_out]"), "(, d_out)?")
    with pytest.raises(mn.InvalidArgument, match=pattern):
        ENTRY_POINTS[entry](q, k, v, **args)


def test_the_problem_reads_its_shapes_once() -> None:
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((3, 1, 2, 4)), rng.standard_normal((5, 4)), np.ones((5, 6))
    p = AttentionProblem.of(q, k, v, mask=mn.masks.causal(3), sink=np.zeros((3, 1)), d_out=None)
    assert (p.batch, p.scores, p.output, p.d_k) == ((3, 1), (3, 1, 2, 5), (3, 1, 2, 6), 4)
    assert p.scale_value() == 0.5
    with pytest.raises(mn.InvalidArgument, match=r"^scale: expected a scale >= 0"):
        AttentionProblem.of(q, k, v, scale=-1.0).scale_value("qk")


def test_the_numerics_check_what_they_model() -> None:
    p = AttentionProblem.of(Q, K, V, sink=0.0, softcap=30.0, bias=np.zeros((2, 4)))
    folded = mn.Numerics(exp_form="exp2-folded")
    with pytest.raises(mn.InvalidArgument, match=r"^bias: expected None with numerics.exp_form"):
        folded.check_problem(p)
    mn.Numerics.preset("fp32").check_problem(p)  # the default numerics take all of it


PARAMS = mn.MHAParams.random(4, seed=0)
X = np.zeros((3, 4))
D_OUT = np.ones((3, 4))

MHA_ENTRY_POINTS: dict[str, Callable[..., Any]] = {
    "multi_head_attention": lambda x, y, p, h, **kw: mn.multi_head_attention(x, y, p, h, **kw),
    "reference.multi_head_attention": lambda x, y, p, h, **kw: mn.reference.multi_head_attention(
        x, y, p, h, **kw
    ),
    "mha_bound": lambda x, y, p, h, **kw: mn.bounds.mha_bound(x, y, p, h, **kw),
    "mha_grad": lambda x, y, p, h, **kw: mn.mha_grad(x, y, p, h, D_OUT, **kw),
    "reference.mha_grad": lambda x, y, p, h, **kw: mn.reference.mha_grad(x, y, p, h, D_OUT, **kw),
    "mha_grad_bound": lambda x, y, p, h, **kw: mn.bounds.mha_grad_bound(x, y, p, h, D_OUT, **kw),
}

MHA_BAD: list[tuple[dict[str, Any], str]] = [
    ({"params": "weights"}, "params: expected an MHAParams, got str"),
    ({"num_heads": 0}, "num_heads: expected a positive integer, got 0"),
    ({"num_heads": 3}, "num_heads: expected a divisor of H*d_k (wq columns) = 4, got 3"),
    ({"x_q": np.zeros((3, 5))}, "x_q: expected last dimension 4 (from params), got shape (3, 5)"),
    ({"x_kv": np.full((3, 4), np.inf)}, "x_kv: expected finite values"),
    ({"mask": np.ones((3, 3))}, "mask: expected a boolean array (True = attend), got dtype"),
    ({"mask": np.ones((5, 3, 3), bool)}, "mask: expected a shape broadcastable to (2, 3, 3)"),
    ({"bias": np.zeros((5, 3, 3))}, "bias: expected a shape broadcastable to (2, 3, 3)"),
    ({"sink": np.zeros(3)}, "sink: expected one logit per batch element or head"),
    ({"softcap": 0.0}, "softcap: expected a finite number > 0"),
    ({"x_kv": np.zeros((0, 4))}, "x_kv: expected at least one key (dimension -2), got (0, 4)"),
    ({"x_kv": np.zeros((1, 0, 4))}, "x_kv: expected at least one key (dimension -2), got"),
    ({"x_q": np.zeros((0, 3, 4))}, "x_q, x_kv[, d_out]: expected batch dimensions of at least 1"),
]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    MHA_BAD,
    ids=[m.split(":")[0] + str(i) for i, (_, m) in enumerate(MHA_BAD)],
)
@pytest.mark.parametrize("entry", sorted(MHA_ENTRY_POINTS))
def test_a_bad_layer_argument_is_refused_with_one_message_everywhere(
    entry: str, kwargs: dict[str, Any], message: str
) -> None:
    args = {"x_q": X, "x_kv": X, "params": PARAMS, "num_heads": 2} | kwargs
    positional = [args.pop(n) for n in ("x_q", "x_kv", "params", "num_heads")]
    pattern = "^" + re.escape(message).replace(re.escape("[, d_out]"), "(, d_out)?")
    with pytest.raises(mn.InvalidArgument, match=pattern):
        MHA_ENTRY_POINTS[entry](*positional, **args)
