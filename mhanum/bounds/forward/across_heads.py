"""Theorem A.3‴ across the heads (papers/attention.md): the heads' shares
(:mod:`mhanum.bounds.forward.stored`) taken through the output projection's weights with their
signs, one martingale per entry of the layer's output, in its forms; and the helpers that
gather the heads' parts into the layer's shape."""

from __future__ import annotations

from typing import Any

import numpy as np

from mhanum._types import NumpyArray
from mhanum.bounds.forward.head import HeadResult
from mhanum.bounds.forward.stage import STORED_DOTS, STORED_PARTS, STORED_PV
from mhanum.bounds.projections import Linear

__all__ = ["across_heads", "gather", "head_sum", "merge_heads", "shared"]


def merge_heads(x: np.ndarray) -> np.ndarray:
    """``(..., H, L, d)`` to ``(..., L, H·d)``."""
    x = np.swapaxes(x, -2, -3)
    return x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])


def gather(results: dict[Any, HeadResult], pick: Any, shape: tuple[int, ...]) -> np.ndarray:
    """``pick`` of every head's result, as ``(..., Lq, H·d)``."""
    return merge_heads(np.stack([pick(r) for r in results.values()]).reshape(shape))


def head_sum(results: dict[Any, HeadResult], name: str, shape: tuple[int, ...]) -> np.ndarray:
    """The heads' part ``name`` (``(Lq, d_out)`` each) summed over the heads, per batch entry."""
    parts = [r[3][name] for r in results.values()]
    outer, rows = shape[:-3], shape[-2]
    if not outer:
        return np.sum(parts, axis=0)
    return np.stack(parts).reshape(*outer, shape[-3], rows, -1).sum(axis=-3)


def shared(logits: dict[str, Any], before: np.ndarray, after: np.ndarray) -> dict[str, Any]:
    """The logits term's parts (``Bound.parts``) scaled as the term went from ``before`` to
    ``after``."""
    with np.errstate(invalid="ignore", divide="ignore"):
        share = np.where(before > 0, after / before, 0.0)
    return {n: np.where(np.isfinite(share), share * x, x) for n, x in logits.items()}


def across_heads(
    terms: dict[str, Any],
    logits: dict[str, Any],
    heads: tuple[dict[Any, HeadResult], tuple[int, ...], Any, Any],
    lam: float,
    group: int,
) -> None:
    """Theorem A.3‴ (papers/attention.md): the projections', the scores' and the
    probabilities' roundings as one martingale per output entry through the weights, across
    the heads, with the rest of each head's logits, operands and probabilities' terms through
    ``|ŵ|`` as in (c):
    ``κ(R|ŵ| + λ(Σ_h V_q + g Σ_h V_kv)^½ + S) + (κ - 1) F|ŵ|`` (``R``, ``F``, ``V``, ``S`` the
    heads' parts ``rest``, ``first``, ``var_q``/``var_kv`` and ``second``, :mod:`stored`; a
    key/value head's roundings reach ``g`` query heads, so its squares count ``g`` times).
    Where smaller, it replaces ``attention.logits`` + ``attention.operands`` +
    ``attention.probability_rounding`` (the probabilities' roundings join the martingale where
    A.3'' takes them), shared in their proportion. ``heads[3]`` is ``(read, own)``: with an
    operand format, the output projection's read of the head outputs (``read``, from
    ``mha._read_by_the_projection``) joins the martingale too, and its charge leaves
    ``output_projection``; so do the output projection's own roundings, its dot's, bias's and
    storage's (``own``, from ``mha._projection_roundings``: what ``output_projection`` keeps,
    and their squared increments). Where the heads carry
    their ``P·V`` roundings' parts (:func:`stored.stored_pv`), those join it as well, as a
    form that replaces ``attention.pv`` too: ``V`` gains ``Σ_l spread_l² ŵ_lm²``, ``S`` the
    rest ``(fixed + (scale_out - 1) det)|ŵ|`` and ``F`` their bound ``(det + fixed)|ŵ|``. The
    heads' ``QKᵀ`` dots' martingale (A.3', in ``R`` through ``|ŵ|`` on its own event) may go
    through ``ŵ`` with its signs instead (:func:`_dots_signed`). The choice among the terms as
    they are and the forms weighs every term it moves, and depends on the inputs only: one
    event per entry."""
    results, shape, out, (read, own) = heads
    rest_name, first_name, var_q, var_kv, second = STORED_PARTS
    rest = gather(results, lambda r: r[3][rest_name], shape)
    first = gather(results, lambda r: r[3][first_name], shape)
    var = head_sum(results, var_q, shape) + group * head_sum(results, var_kv, shape)
    charges = _projection_charges(terms["output_projection"], read, own)
    with np.errstate(invalid="ignore", over="ignore"):
        r_w, s_sum = rest @ out.slope, head_sum(results, second, shape)
        f_w = first @ out.slope
        parts = [(r_w + s_sum, var, f_w)]
    names: tuple[str, ...] = (
        "attention.logits",
        "attention.operands",
        "attention.probability_rounding",
    )
    # the QKᵀ dots' martingale with the weights' signs (A.3'), where the heads carry it
    signed = _dots_signed(results, shape, out, (s_sum, var, first))
    if signed is not None:
        parts.append(signed)
    forms: list[tuple[tuple[str, ...], tuple[Any, Any, Any]]] = [(names, part) for part in parts]
    pv = _pv_through(results, shape, out)
    if pv is not None:
        with np.errstate(invalid="ignore", over="ignore"):
            forms += [
                ((*names, "attention.pv"), (part[0] + pv[0], part[1] + pv[1], part[2] + pv[2]))
                for part in parts
            ]
    # each form with each way of charging the output projection (its own roundings in the
    # martingale or not)
    options: list[tuple[tuple[str, ...], NumpyArray, tuple[NumpyArray, NumpyArray | float]]] = []
    with np.errstate(invalid="ignore", over="ignore"):
        for moved, (fixed, v, f) in forms:
            for projection, gain, extra in charges:
                across = _form((fixed, v + extra, f), out.kappa, lam)
                options.append((moved, across, (projection, gain)))
    _take_across(terms, logits, options)


def _projection_charges(
    charged: NumpyArray,
    read: tuple[NumpyArray, NumpyArray] | None,
    own: tuple[NumpyArray, NumpyArray] | None,
) -> list[tuple[NumpyArray, NumpyArray | float, NumpyArray | float]]:
    """The ways A.3‴ may charge the output projection: ``(what output_projection keeps, what it
    gives up, what the martingale's V gains)``, with its read of the head outputs in the
    martingale (``read``: its charge and squared increments) and, as a second way, its own
    roundings too (``own``: what it then keeps, and their squared increments). One way alone
    (``charged``, nothing moved) without either."""
    ways: list[tuple[NumpyArray, NumpyArray | float, NumpyArray | float]] = []
    start: list[tuple[NumpyArray, NumpyArray | float]] = [(charged, 0.0)]
    if own is not None:
        start.append(own)
    with np.errstate(invalid="ignore", over="ignore"):
        for kept, extra in start:
            projection = np.minimum(charged, kept)
            if read is not None:  # the output projection's read of the head outputs
                projection = np.minimum(
                    projection, np.maximum(projection - read[0], 0.0) * (1 + 2.0**-50)
                )
                extra = extra + read[1]
            gain = np.where(projection < charged, charged - projection, 0.0)
            ways.append((projection, gain, extra))
    return ways


def _dots_signed(
    results: dict[Any, HeadResult],
    shape: tuple[int, ...],
    out: Linear,
    parts: tuple[np.ndarray, np.ndarray, np.ndarray],
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Theorem A.3‴'s ``(R|ŵ| + S, V, F|ŵ|)`` with the heads' ``QKᵀ`` dots' martingale through
    ``ŵ`` with its signs (:data:`STORED_DOTS`) in place of its bound through ``|ŵ|`` in ``R``;
    ``parts = (S, V, F)``. ``None`` unless every head has it."""
    if not all(STORED_DOTS[0] in r[3] for r in results.values()):
        return None
    s_sum, var, first = parts
    signed, dots_first = (gather(results, lambda r, n=n: r[3][n], shape) for n in STORED_DOTS[::3])
    dots_var, dots_second = (head_sum(results, n, shape) for n in STORED_DOTS[1:3])
    with np.errstate(invalid="ignore", over="ignore"):
        return (
            signed @ out.slope + s_sum + dots_second,
            var + dots_var,
            (first + dots_first) @ out.slope,
        )


def _form(parts: tuple[Any, Any, Any], kappa: float, lam: float) -> NumpyArray:
    """``κ(R|ŵ| + S + λV^½) + (κ - 1)F|ŵ|`` for ``parts = (R|ŵ| + S, V, F|ŵ|)``."""
    fixed, var, first = parts
    with np.errstate(invalid="ignore", over="ignore"):
        return kappa * (fixed + lam * np.sqrt(var)) + (kappa - 1) * first


def _pv_through(
    results: dict[Any, HeadResult], shape: tuple[int, ...], out: Linear
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """What the heads' ``P·V`` roundings (:func:`stored.stored_pv`) add to Theorem A.3‴'s
    ``(R|ŵ| + S, V, F|ŵ|)`` when they join its martingale (formed once for every form they
    join); ``None`` unless every head has them."""
    if not all(STORED_PV[0] in r[3] for r in results.values()):
        return None
    pv_var, pv_first, pv_second = (
        gather(results, lambda r, n=n: r[3][n], shape) for n in STORED_PV
    )
    with np.errstate(invalid="ignore", over="ignore"):
        return pv_second @ out.slope, pv_var @ (out.slope * out.slope), pv_first @ out.slope


def _take_across(
    terms: dict[str, Any],
    logits: dict[str, Any],
    forms: list[tuple[tuple[str, ...], NumpyArray, tuple[NumpyArray, NumpyArray | float]]],
) -> None:
    """Per entry, the smallest of the terms as they are and each form of Theorem A.3‴ in
    place of the terms it names, with its charge of the output projection (``(what
    output_projection keeps, gain)``: the form is weighed less ``gain``, the part it takes
    over); the chosen form is shared among its terms in their proportion. Updates ``terms``
    and the logits term's parts."""
    names = max((f[0] for f in forms), key=len)
    total = sum(terms[n] for n in names)
    best, choice = total, np.zeros(np.shape(total), dtype=int)
    with np.errstate(invalid="ignore"):
        for i, (moved, across, (_, gain)) in enumerate(forms, start=1):
            kept = sum((terms[n] for n in names if n not in moved), np.zeros(()))
            option = across - gain + kept
            take = np.isfinite(option) & (option < best)
            best, choice = np.where(take, option, best), np.where(take, i, choice)
    projection = terms["output_projection"]
    for i, (_, _, (kept_projection, _)) in enumerate(forms, start=1):
        projection = np.where(choice == i, kept_projection, projection)
    before_logits = terms[names[0]]
    after = {n: terms[n] for n in names}
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        for i, (moved, across, _) in enumerate(forms, start=1):
            here = choice == i
            before = sum(terms[n] for n in moved)
            for n in moved:
                share = np.where(before > 0, terms[n] / before, 1.0 / len(moved))
                after[n] = np.where(here, across * share, after[n])
    logits.update(shared(logits, before_logits, after[names[0]]))
    terms.update(after)
    terms["output_projection"] = projection
