"""Shared checks of an adapter path: reference, bound, model, masked keys, fully-masked rows."""

from __future__ import annotations

from typing import Any

import numpy as np

import mhanum as mn
from mhanum.adapters import _common as C
from mhanum.adapters.compare import _bounded_target

D_MODEL, HEADS, BATCH, LENGTH = 16, 4, 2, 6  # d_k = 4: 1/sqrt(d_k) is exact
MASKS = ("none", "causal", "padding", "empty-row")


def inputs(seed: int = 0) -> tuple[np.ndarray, mn.MHAParams]:
    """float32 inputs ``(B, L, E)`` and float32-valued weights."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((BATCH, LENGTH, D_MODEL)).astype(np.float32)
    return x, C.float32_params(mn.MHAParams.random(D_MODEL, seed=seed), HEADS)


def mask_of(kind: str) -> np.ndarray | None:
    """``(B, L, L)`` masks, True = attend; ``empty-row`` has one fully-masked query row."""
    if kind == "none":
        return None
    m = np.ones((BATCH, LENGTH, LENGTH), bool)
    if kind == "causal":
        return m & np.tril(np.ones((LENGTH, LENGTH), bool))
    m[1, :, 3:] = False  # padding: keys 3.. of batch entry 1 are padding
    if kind == "empty-row":
        m[0, 2, :] = False
    return m


def check_path(adapter: Any, layer: Any, path: str, kind: str, **run_kwargs: Any) -> None:
    """:func:`check_output` on the fixed inputs with a mask of the given kind."""
    x, params = inputs()
    check_output(adapter, layer, params, path, x, mask_of(kind), **run_kwargs)


def check_output(
    adapter: Any,
    layer: Any,
    params: mn.MHAParams,
    path: str,
    x: np.ndarray,
    mask: np.ndarray | None,
    **run_kwargs: Any,
) -> None:
    """The path's output is within mhanum's bound of the reference (with the path's fully-masked
    semantics), within twice the bound of mhanum's model of it, and NaN exactly where the model
    says."""
    model = adapter.model(path)
    out = adapter.run(layer, x, x, mask, path=path, **run_kwargs)
    assert out.shape == x.shape
    assert out.dtype == np.float32
    ref = C.reference(params, x, x, HEADS, mask, model.fully_masked)
    pred = C.predict(model, params, x, x, HEADS, mask)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    np.testing.assert_array_equal(np.isnan(pred), np.isnan(ref))
    rows = C.fully_masked_rows(mask)
    keep = ~np.isnan(ref)
    if rows is not None and rows.any():
        if model.fully_masked == "zero":
            np.testing.assert_array_equal(out[rows], np.broadcast_to(params.bo, out[rows].shape))
        if model.fully_masked != _bounded_target(model.numerics):
            # A row with no key that Theorem A.2 does not describe (-inf masking, or a zero
            # row after a finite constant): the path's own answer, pinned above and by NaN.
            keep &= ~(rows[..., None] & np.ones_like(ref, bool))
    m4 = None if mask is None else mask[:, None]
    bound = mn.bounds.mha_bound(
        x.astype(np.float64), x.astype(np.float64), params, HEADS, mask=m4, numerics=model.numerics
    )
    total = np.asarray(bound.total)
    err = np.abs(out.astype(np.float64) - ref)
    assert np.all(err[keep] <= total[keep]), float(np.max(err[keep] / total[keep]))
    assert np.all(np.abs(out.astype(np.float64) - pred)[keep] <= 2 * total[keep])


def check_masked_key_ignored(adapter: Any, layer: Any, path: str, **run_kwargs: Any) -> None:
    """A key masked for every query gets weight 0: changing its input changes no output bit."""
    x, _ = inputs()
    mask = mask_of("padding")
    out = adapter.run(layer, x, x, mask, path=path, **run_kwargs)
    x2 = x.copy()
    x2[1, 4] = 3.0 * x2[1, 0]  # key 4 of batch entry 1 is padding
    out2 = adapter.run(layer, x, x2, mask, path=path, **run_kwargs)
    np.testing.assert_array_equal(out, out2)


def check_roundtrip(adapter: Any) -> Any:
    """``extract(load(p))`` is ``p`` (float32 values); returns the layer."""
    _, params = inputs()
    layer = adapter.load(params, HEADS)
    got = adapter.extract(layer)
    for name in ("wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo"):
        np.testing.assert_array_equal(getattr(got, name), getattr(params, name))
    return layer
