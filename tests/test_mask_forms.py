"""Every public entry point reads a mask the same way, whatever its form.

A mask is normalised once, at the boundary (:func:`mhanum.masks.normalise`): a structured
:class:`~mhanum.masks.Band` (causal, windows, bottom-right aligned), a boolean array, or ``None``.
Equal masks in different forms must give identical results in the emulation, the reference,
every bound (forward and backward), the testing oracle and the search's evaluations: a bound
that read a band as something else than its array would be silently wrong.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import mhanum as mn
from mhanum import masks

LQ, LK, D = 2, 3, 2
D_MODEL, HEADS = 4, 2


def _inputs() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {
        "q": rng.standard_normal((LQ, D)),
        "k": rng.standard_normal((LK, D)),
        "v": rng.standard_normal((LK, D)),
        "g": rng.standard_normal((LQ, D)),
        "x_q": rng.standard_normal((LQ, D_MODEL)),
        "x_kv": rng.standard_normal((LK, D_MODEL)),
        "g_mha": rng.standard_normal((LQ, D_MODEL)),
    }


X = _inputs()
PARAMS = mn.MHAParams.random(D_MODEL, seed=3)
FLASH = mn.Backward("flash2", block_q=1, block_k=1)

# The same mask in every form it can take (Lq = 2 < Lk = 3: the bottom-right alignment matters).
FORMS: dict[str, list[Any]] = {
    "causal bottom-right": [
        masks.causal(1),
        masks.bottom_right(masks.causal(), LQ, LK),
        masks.causal(1).array(LQ, LK),
    ],
    "causal top-left": [masks.causal(), masks.window(None, 0), masks.causal().array(LQ, LK)],
    "window": [masks.window(1, 0, offset=1), masks.window(1, 0, offset=1).array(LQ, LK)],
    "sliding window": [
        masks.sliding_window(2, offset=1),
        masks.sliding_window(2, offset=1).array(LQ, LK),
    ],
    "none": [None, np.ones((LQ, LK), bool), masks.Band(left=None, right=None)],
}


def _arrays(result: Any) -> list[np.ndarray]:
    """Every array a result holds, in a fixed order (Bounds, named tuples, dicts, params)."""
    if result is None or isinstance(result, (str, float, int)):
        return [np.asarray(result, dtype=object)] if result is not None else []
    if isinstance(result, mn.bounds.Bound):
        return _arrays(result.total) + _arrays(dict(result.terms)) + [np.asarray(result.reasons)]
    if isinstance(result, dict):
        return [a for key in sorted(result) for a in _arrays(result[key])]
    if isinstance(result, tuple):
        return [a for item in result for a in _arrays(item)]
    if dataclasses.is_dataclass(result) and not isinstance(result, type):
        return [a for f in dataclasses.fields(result) for a in _arrays(getattr(result, f.name))]
    return [np.asarray(result)]


def _same(a: Any, b: Any) -> None:
    xs, ys = _arrays(a), _arrays(b)
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys, strict=True):
        if x.dtype == object or y.dtype == object:
            assert x.tolist() == y.tolist()
        else:
            np.testing.assert_array_equal(x, y)


def _attention(mask: Any) -> Any:
    return np.asarray(mn.attention(X["q"], X["k"], X["v"], mask, numerics="fp32"))


def _mha(mask: Any) -> Any:
    return np.asarray(
        mn.multi_head_attention(X["x_q"], X["x_kv"], PARAMS, HEADS, mask=mask, numerics="fp32")
    )


ENTRY_POINTS: dict[str, Callable[[Any], Any]] = {
    "attention": _attention,
    "softmax": lambda m: np.asarray(mn.softmax(X["q"] @ X["k"].T, m, numerics="fp32")),
    "multi_head_attention": _mha,
    "attention_grad": lambda m: mn.attention_grad(
        X["q"], X["k"], X["v"], X["g"], m, numerics="fp32"
    ),
    "attention_grad flash2": lambda m: mn.attention_grad(
        X["q"], X["k"], X["v"], X["g"], m, numerics="fp32", backward=FLASH
    ),
    "mha_grad": lambda m: mn.mha_grad(
        X["x_q"], X["x_kv"], PARAMS, HEADS, X["g_mha"], mask=m, numerics="fp32"
    ),
    "reference.attention": lambda m: mn.reference.attention(X["q"], X["k"], X["v"], mask=m),
    "reference.multi_head_attention": lambda m: mn.reference.multi_head_attention(
        X["x_q"], X["x_kv"], PARAMS, HEADS, mask=m
    ),
    "reference.attention_grad": lambda m: mn.reference.attention_grad(
        X["q"], X["k"], X["v"], X["g"], mask=m, digits=17
    ),
    "reference.mha_grad": lambda m: mn.reference.mha_grad(
        X["x_q"], X["x_kv"], PARAMS, HEADS, X["g_mha"], mask=m, digits=17
    ),
    "attention_bound": lambda m: mn.bounds.attention_bound(
        X["q"], X["k"], X["v"], m, numerics="bf16-fp32acc"
    ),
    "attention_bound sink": lambda m: mn.bounds.attention_bound(
        X["q"], X["k"], X["v"], m, numerics="fp32", sink=0.5
    ),
    "attention_bound_along": lambda m: mn.bounds.attention_bound_along(
        X["q"], X["k"], X["v"], X["g"], m, numerics="fp32"
    ),
    "mha_bound": lambda m: mn.bounds.mha_bound(
        X["x_q"], X["x_kv"], PARAMS, HEADS, mask=m, numerics="fp32"
    ),
    "schedule_difference": lambda m: mn.bounds.schedule_difference(
        X["q"], X["k"], X["v"], m, numerics_a="fp32", numerics_b="bf16-fp32acc"
    ),
    "attention_grad_bound": lambda m: mn.bounds.attention_grad_bound(
        X["q"], X["k"], X["v"], X["g"], m, numerics="fp32"
    ),
    "attention_grad_bound sink": lambda m: mn.bounds.attention_grad_bound(
        X["q"], X["k"], X["v"], X["g"], m, numerics="fp32", sink=0.5
    ),
    "attention_grad_bound flash2": lambda m: mn.bounds.attention_grad_bound(
        X["q"], X["k"], X["v"], X["g"], m, numerics="fp32", backward=FLASH
    ),
    "dq_order_difference": lambda m: mn.bounds.dq_order_difference(
        X["q"], X["k"], X["v"], X["g"], m, numerics="fp32", backward=FLASH
    ),
    "mha_grad_bound": lambda m: mn.bounds.mha_grad_bound(
        X["x_q"], X["x_kv"], PARAMS, HEADS, X["g_mha"], mask=m, numerics="fp32"
    ),
    "mha_grad_bound flash2": lambda m: mn.bounds.mha_grad_bound(
        X["x_q"], X["x_kv"], PARAMS, HEADS, X["g_mha"], mask=m, numerics="fp32", backward=FLASH
    ),
    "testing.attention_oracle": lambda m: mn.testing.attention_oracle(
        X["q"].astype(np.float32),
        X["k"].astype(np.float32),
        X["v"].astype(np.float32),
        mask=m,
        kernel="jax-xla",
    ),
    "testing.mha_oracle": lambda m: mn.testing.mha_oracle(
        X["x_q"].astype(np.float32), X["x_kv"].astype(np.float32), PARAMS, HEADS, mask=m
    ),
    "search.gradient_evaluation": lambda m: mn.search.gradient_evaluation(
        X["q"], X["k"], X["v"], X["g"], m, mn.Numerics.preset("fp32"), FLASH
    ),
    "search.mha_evaluation": lambda m: mn.search.mha_evaluation(
        X["x_q"], X["x_kv"], PARAMS, HEADS, m, mn.Numerics.preset("bf16-fp32acc")
    ),
}


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_equal_masks_give_identical_results(entry: str, form: str) -> None:
    run = ENTRY_POINTS[entry]
    first, *others = FORMS[form]
    expected = run(first)
    for mask in others:
        _same(run(mask), expected)


def test_a_band_masks_the_backward_bound_as_its_array() -> None:
    """The smallest case where a band was read as 'attend everything' by the FlashAttention-2
    backward bound: the bound must be the masked problem's, and hold on the masked gradients."""
    band = masks.causal(1)
    exact = mn.reference.attention_grad(X["q"], X["k"], X["v"], X["g"], mask=band, digits=17)
    computed = mn.attention_grad(
        X["q"], X["k"], X["v"], X["g"], band, numerics="fp32", backward=FLASH
    )
    bound = mn.bounds.attention_grad_bound(
        X["q"], X["k"], X["v"], X["g"], band, numerics="fp32", backward=FLASH
    )
    for name in ("dq", "dk", "dv", "dbias"):
        err = np.abs(np.asarray(getattr(computed, name), np.float64) - getattr(exact, name))
        assert (err <= getattr(bound, name).total).all(), name
    # a masked key's dbias is exactly 0, and so is its bound
    assert (bound.dbias.total[~band.array(LQ, LK)] == 0).all()


@pytest.mark.parametrize(
    ("mask", "expected"),
    [
        (np.ones((LQ, LK), np.float32), "mask: expected a boolean array"),
        (np.ones((LQ, LK + 1), bool), "mask: expected a shape broadcastable to ("),
        ("causal", "mask: expected None, a boolean array or a mhanum.masks.Band"),
    ],
)
def test_a_bad_mask_is_refused_by_name_everywhere(mask: Any, expected: str) -> None:
    for entry in ("attention", "attention_grad_bound", "reference.attention", "mha_grad_bound"):
        with pytest.raises(mn.InvalidArgument, match=r"^" + _escape(expected)):
            ENTRY_POINTS[entry](mask)


def _escape(text: str) -> str:
    import re

    return re.escape(text)
