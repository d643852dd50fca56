"""The gradient search: inputs on which a backward pass is furthest from the exact gradients,
relative to Theorem B.1/B.2 (B.7 with a soft-cap), every evaluation measured against the
certified reference gradients."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import numpy as np
from hypothesis import strategies as st

from mhanum import _validate as V
from mhanum import reference, strategies
from mhanum._errors import CertificationError, InvalidArgument
from mhanum.bounds import attention_grad_bound
from mhanum.emulate.backward import attention_grad
from mhanum.formats import round_to
from mhanum.numerics import Backward, Numerics, resolve, resolve_backward
from mhanum.search._core import (
    Case,
    Entry,
    Sizes,
    Tracker,
    check_search,
    run_stage,
    steer,
    tuple_of,
    worst_entry,
)
from mhanum.search.attention import Shape

__all__ = ["GradientWorstCase", "gradient_evaluation", "gradient_worst_case"]

GRADIENTS = ("dq", "dk", "dv", "dbias")
"""The gradients a backward pass computes, in the order of its result."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class GradientWorstCase(Case):
    """The input on which a backward pass is furthest from the exact gradients, relative to
    Theorem B.1/B.2, measured against the certified reference gradients.

    Attributes:
        numerics, backward: the configuration searched.
        shape: the sizes searched.
        q, k, v, d_out: the inputs (float64 arrays whose values lie in ``numerics.input``).
        mask: the boolean mask (True = attend), or ``None``.
        gradient: the gradient attaining ``ratio`` (``"dq"``, ``"dk"``, ``"dv"``, ``"dbias"``).
        index: its entry.
        error: ``|ĝ_i - g_i|`` there; bound: the bound there; ratio: their quotient (above 1 a
            violation; ``inf`` for a non-finite gradient under a finite bound).
        dominant_term: the bound's largest term at that entry.
        evaluations, budget, seed, seconds: the search's accounting.
        gradients: the computed ``(dq, dk, dv, dbias)`` at the input (float64 copies of their
            values), for a bit-for-bit replay.
        softcap: the logit soft-cap of the search (Theorem B.7), or ``None``.
    """

    backward: Backward
    shape: Shape
    q: np.ndarray = dataclasses.field(repr=False)
    k: np.ndarray = dataclasses.field(repr=False)
    v: np.ndarray = dataclasses.field(repr=False)
    d_out: np.ndarray = dataclasses.field(repr=False)
    gradient: str
    gradients: tuple[np.ndarray, ...] = dataclasses.field(default=(), repr=False)
    softcap: float | None = None

    KIND: ClassVar[str | None] = "gradient"
    SHAPE: ClassVar[type[Sizes]] = Shape
    INPUTS: ClassVar[tuple[str, ...]] = ("q", "k", "v", "d_out", "mask")
    ARRAY_FIELDS: ClassVar[tuple[str, ...]] = ("q", "k", "v", "d_out", "mask", "gradients")
    GROUPS: ClassVar[dict[str, tuple[tuple[str, ...], Callable[..., Any]]]] = {
        "gradients": (GRADIENTS, tuple_of)
    }
    SUMMARY: ClassVar[tuple[str, ...]] = (
        "preset", "numerics", "backward", "gradient", "index", "error", "bound", "ratio",
        "dominant_term", "violation", "evaluations", "seconds", "softcap?",
    )  # fmt: skip


def gradient_evaluation(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    d_out: np.ndarray,
    mask: np.ndarray | None,
    numerics: Numerics,
    backward: Backward,
    softcap: float | None = None,
) -> tuple[float, str, tuple[int, ...], float, float, str, tuple[np.ndarray, ...]] | None:
    """One input's worst ``|ĝ_i - g_i| / B_i`` (Theorems B.1/B.2, with ``softcap`` B.7)
    against the certified reference: ``(ratio, gradient, index, error, bound, dominant term,
    computed gradients)``, or ``None`` outside the bound's scope."""
    found = _measure(q, k, v, d_out, mask, numerics, backward, attention_grad_bound, softcap)
    if found is None:
        return None
    name, ev = found
    grads = attention_grad(
        q, k, v, d_out, mask, numerics=numerics, backward=backward, softcap=softcap
    )
    copies = tuple(np.asarray(x, np.float64) for x in grads[:4])
    return ev.ratio, name, ev.index, ev.error, ev.bound, ev.dominant_term, copies


def _measure(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    g: np.ndarray,
    mask: np.ndarray | None,
    num: Numerics,
    bw: Backward,
    bound: Callable[..., Any],
    softcap: float | None = None,
) -> tuple[str, Entry] | None:
    """The worst ``|ĝ - g| / B`` over the gradients, with the gradient's name (``None``
    outside the bound's scope or where every bound is infinite); the emulation, the reference
    and the bound all take ``softcap``."""
    cap = {} if softcap is None else {"softcap": softcap}  # a bound without it stays usable
    try:
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            bounds = bound(q, k, v, g, mask, numerics=num, backward=bw, **cap)
    except InvalidArgument:
        return None
    grads = attention_grad(q, k, v, g, mask, numerics=num, backward=bw, softcap=softcap)
    exact = reference.attention_grad(q, k, v, g, mask=mask, digits=17, softcap=softcap)
    best: tuple[str, Entry] | None = None
    per_gradient = (bounds.dq, bounds.dk, bounds.dv, bounds.dbias)
    for name, got, want, b in zip(GRADIENTS, grads, exact, per_gradient, strict=False):
        entry = worst_entry(got, want, b)
        if entry is not None and (best is None or entry.ratio > best[1].ratio):
            best = (name, entry)
    return best


def gradient_worst_case(
    numerics: Numerics | str,
    shape: Shape | Mapping[str, int],
    *,
    backward: Backward | str | None = None,
    budget: int = 50,
    seed: int = 0,
    mask: str | None = None,
    bound: Callable[..., Any] | None = None,
    softcap: float | None = None,
) -> GradientWorstCase:
    """Search for the input on which a backward pass is worst relative to its bound (B.1/B.2).

    Hypothesis draws q, k, v (:func:`mhanum.strategies.attention_inputs`, every structure family
    mixed in) and ``d_out`` (standard normal times ``2^j``, ``j`` in ``[-3, 3]``, rounded into
    the input format), with a mask of ``mask``'s kind, and is steered with ``target()`` on the
    largest ``|ĝ_i - g_i| / B_i`` over the four gradients, each evaluation measured against the
    certified reference gradients (so the ratio is exact: no cheap objective); an input the
    reference cannot certify (:class:`~mhanum.CertificationError`) is skipped, not measured.

    Args:
        numerics: a :class:`~mhanum.Numerics` or a preset name.
        shape: a :class:`Shape` or a mapping of its fields.
        backward: a :class:`~mhanum.numerics.Backward` or an algorithm name.
        budget: the number of evaluations.
        seed: seed of the Hypothesis search.
        mask: a mask kind of :func:`mhanum.strategies.masks`, or ``None``.
        bound: the bound function (default :func:`mhanum.bounds.attention_grad_bound`; a test
            can pass a deliberately wrong one).
        softcap: a logit soft-cap ``c > 0`` (``c·tanh(s/c)``) in every evaluation: the
            emulation, the reference and the bound (Theorem B.7) all take it, and the case
            records it.

    Returns:
        A :class:`GradientWorstCase`.

    Raises:
        InvalidArgument: as :func:`mhanum.search.worst_case` does.

    Examples:
        >>> import jax
        >>> jax.config.update("jax_enable_x64", True)
        >>> case = gradient_worst_case("fp32", {"q_len": 3, "kv_len": 4, "d_k": 2}, budget=4)
        >>> case.violation
        False
    """
    num, bw = resolve(numerics), resolve_backward(backward)
    sizes = Shape.of(shape)
    cap = V.softcap_value(softcap)
    if cap is not None:
        num.check_softcap()
    budget, seed, kind = check_search(budget, seed, mask)
    fmt = num.format_of("input")
    start = time.perf_counter()
    cotangents = st.tuples(st.integers(0, 2**32 - 1), st.integers(-3, 3))
    chosen = bound or attention_grad_bound

    def measure(**x: Any) -> tuple[str, Entry] | None:
        return _measure(x["q"], x["k"], x["v"], x["d_out"], x["mask"], num, bw, chosen, cap)

    tracker = Tracker(measure, lambda found: found[1].ratio, budget, skip=(CertificationError,))

    def step(x: strategies.AttentionInputs, m: np.ndarray | None, cot: tuple[int, int]) -> None:
        if tracker.exhausted:
            return
        rng = np.random.default_rng(cot[0])
        g = round_to(rng.standard_normal((*x.q.shape[:-1], x.v.shape[-1])) * 2.0 ** cot[1], fmt)
        found = tracker.evaluate(q=x.q, k=x.k, v=x.v, d_out=g, mask=m)
        if found is not None:
            steer(found[1].ratio, f"gradient error/bound | {found[0]}")

    run_stage(step, [sizes.draws(num), sizes.masks(kind), cotangents], budget, seed)
    best = tracker.finish()
    (name, ev), x = best.evaluation, best.inputs
    grads = attention_grad(
        x["q"], x["k"], x["v"], x["d_out"], x["mask"], numerics=num, backward=bw, softcap=cap
    )
    return GradientWorstCase(
        numerics=num, backward=bw, shape=sizes, q=x["q"], k=x["k"], v=x["v"], d_out=x["d_out"],
        mask=x["mask"], gradient=name, index=ev.index, error=ev.error, bound=ev.bound,
        ratio=ev.ratio, dominant_term=ev.dominant_term, evaluations=tracker.done, budget=budget,
        seed=seed, seconds=time.perf_counter() - start,
        gradients=tuple(np.asarray(g, np.float64) for g in grads[:4]), softcap=cap,
    )  # fmt: skip
