"""Head partitioning: what changes numerically when ``d_model`` is split into ``H`` heads.

Multi-head attention with ``H`` heads of ``d_k = d_model / H`` is not one head of ``d_model``
with the same weights: head ``h``'s score ``q_i^{(h)} · k_j^{(h)}`` is the dot product over its own
``d_k`` components, so the ``H`` softmaxes see ``H`` different partial sums of the one-head score
``q_i · k_j = Σ_h q_i^{(h)} · k_j^{(h)}``. The two layers compute different functions; their
difference is not a rounding effect (:func:`head_partition_difference` measures it exactly).

The numerical consequences (papers/heads.md):

* **dot lengths** — the score dots have length ``d_k``, not ``d_model``, so their worst-case
  rounding factor is ``γ_{d_k}`` instead of ``γ_{d_model}`` (Theorem H.1);
* **scale exactness** — ``1/sqrt(d_k)`` is a binary float exactly when ``d_k = 4^m``, and the
  ``d_k^{-1/4}`` applied to q and k each (PyTorch's math path) exactly when ``d_k = 16^m``
  (Theorem H.2);
* **the output projection as a blocked sum over heads** — ``concat_h(O_h) W_o = Σ_h O_h W_o^{(h)}``;
  computed per head and then across heads (as tensor parallelism does), it is a blocked sum with
  blocks of ``d_v`` and its factor is ``γ_{(d_v - 1) + (H - 1)}`` instead of ``γ_{H d_v - 1}``
  (Theorem H.3).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from mhanum import _validate as V
from mhanum import reference
from mhanum._errors import InvalidArgument
from mhanum.bounds._result import Bound
from mhanum.bounds.factors import product_gamma
from mhanum.formats import Format, get_format, round_to
from mhanum.params import MHAParams

__all__ = [
    "HeadDifference",
    "ScaleExactness",
    "head_partition_difference",
    "output_projection_factor",
    "scale_exactness",
    "score_dot_factor",
]


@dataclasses.dataclass(frozen=True)
class ScaleExactness:
    """Whether the softmax scale is a value of a format, and how far its rounding moves it.

    Attributes:
        d_k: the head dimension.
        fmt: the format the constant is rounded to.
        placement: ``"scores"``/``"q"`` (the constant ``d_k^{-1/2}``) or ``"qk"`` (``d_k^{-1/4}``).
        exact_value: the constant, as the closest float64 (exact when the constant is dyadic).
        exact: whether the constant is a value of ``fmt`` (Theorem H.2).
        relative_error: ``|fl(c) − c| / c`` in ``fmt`` (0 when exact); for ``"qk"`` the constant
            enters twice, so the scores move by up to about twice this.
    """

    d_k: int
    fmt: str
    placement: str
    exact_value: float
    exact: bool
    relative_error: float


def scale_exactness(d_k: int, fmt: Format | str, placement: str = "scores") -> ScaleExactness:
    """Whether ``d_k^{-1/2}`` (or ``d_k^{-1/4}`` for ``placement="qk"``) is exact in ``fmt``.

    Theorem H.2 (papers/heads.md): for an integer ``d >= 1``, ``d^{-1/2}`` is a binary
    floating-point number (in a format whose range contains it) iff ``d = 4^m``, and ``d^{-1/4}``
    iff ``d = 16^m``. (A positive rational ``d^{-1/r}`` is dyadic iff ``d`` is a power of two whose
    exponent ``r`` divides.) Otherwise the constant is irrational and its rounding to nearest has
    relative error at most ``u``, which the bounds carry.

    Examples:
        >>> scale_exactness(64, "bfloat16").exact, scale_exactness(64, "bfloat16", "qk").exact
        (True, False)
        >>> scale_exactness(256, "float16", "qk").exact
        True
    """
    d = V.positive_int(d_k, "d_k")
    f = get_format(fmt)
    if placement not in ("scores", "q", "qk"):
        msg = f"placement: expected 'scores', 'q' or 'qk', got {placement!r}"
        raise InvalidArgument(msg)
    root = 4 if placement == "qk" else 2
    power = d.bit_length() - 1
    dyadic = d == 1 << power and power % root == 0
    if dyadic:
        value = math.ldexp(1.0, -power // root)
        stored = float(round_to(value, f))
        return ScaleExactness(
            d, f.name, placement, value, stored == value, abs(stored - value) / value
        )
    import mpmath

    ctx = mpmath.MPContext()
    ctx.prec = 200
    c = ctx.power(d, ctx.mpf(-1) / root)
    stored = float(round_to(float(c), f))  # float(c) is within 2^-53 relative; fmt has p <= 53
    relative = float(abs(ctx.mpf(stored) - c) / c)
    return ScaleExactness(d, f.name, placement, float(c), False, relative)


def score_dot_factor(d_model: int, num_heads: int, accum: Format | str) -> Bound:
    """Theorem H.1: the worst-case rounding factor of one head's score dot, against one head.

    With products rounded to ``accum`` and any summation order, ``|fl(q·k) − q·k| <= γ_n |q|·|k|``
    with ``n`` the dot length (Higham 2002, eq. (3.5)). ``H`` heads have ``n = d_model / H``.
    Where ``γ_n >= 1`` the factor is ``(1 + u)^n - 1``, which holds for every ``n``
    (:func:`~mhanum.bounds.factors.product_gamma`, Corollary R.1').
    Assumptions: round-to-nearest, no underflow.

    Returns:
        A :class:`Bound` whose ``total`` is ``γ_{d_k}`` and whose terms are ``per_head``
        (``γ_{d_k}``) and ``one_head`` (``γ_{d_model}``), for comparison.
    """
    d = V.positive_int(d_model, "d_model")
    h = V.positive_int(num_heads, "num_heads")
    if d % h:
        msg = f"num_heads: expected a divisor of d_model = {d}, got {h}"
        raise InvalidArgument(msg)
    u = get_format(accum, argname="accum").u
    per_head = product_gamma(d // h, u)
    return Bound(
        per_head,
        {"per_head": per_head, "one_head": product_gamma(d, u)},
        "H.1",
        ("round-to-nearest", "no underflow"),
        "higham2002",
    )


def output_projection_factor(
    num_heads: int, d_v: int, accum: Format | str, *, per_head_partials: bool = True
) -> Bound:
    """Theorem H.3: the rounding factor of the output projection ``concat_h(O_h) W_o``.

    Each output is a dot product of length ``n = H·d_v``. Summed sequentially over all ``n``
    products its factor is ``γ_{n}`` (``n − 1`` additions plus the product rounding). Summed per
    head (``d_v`` products, as tensor parallelism computes ``O_h W_o^{(h)}`` on its own device) and
    then across the ``H`` partial sums, every product passes through at most ``(d_v − 1) + (H − 1)``
    additions, so ``|fl(y) − y| <= γ_{d_v + H − 1} Σ|o_t||w_t|`` (the product rounding adds one).
    Beyond ``γ_n >= 1`` the factors are ``(1 + u)^n - 1`` (Corollary R.1').
    Assumptions: round-to-nearest, no underflow.

    Returns:
        A :class:`Bound` with ``total`` the factor of the chosen order and terms ``per_head``
        (``γ_{d_v + H − 1}``) and ``flat`` (``γ_{H d_v}``).
    """
    h = V.positive_int(num_heads, "num_heads")
    dv = V.positive_int(d_v, "d_v")
    u = get_format(accum, argname="accum").u
    blocked, flat = product_gamma(dv + h - 1, u), product_gamma(h * dv, u)
    return Bound(
        blocked if per_head_partials else flat,
        {"per_head": blocked, "flat": flat},
        "H.3",
        ("round-to-nearest", "no underflow", "products rounded"),
        "higham2002",
    )


@dataclasses.dataclass(frozen=True)
class HeadDifference:
    """How far ``h1``-head and ``h2``-head attention with the same weights are apart (exactly).

    Attributes:
        heads: ``(h1, h2)``.
        normwise_max: ``‖y_{h1} − y_{h2}‖_∞ / ‖y_{h2}‖_∞`` of the certified references.
        max_abs: ``max |y_{h1} − y_{h2}|``.
        score_split: for one query/key pair, the one-head score ``q·k/√d_model`` next to the
            per-head scores ``q^{(h)}·k^{(h)}/√d_k`` of ``h2`` heads, to show the partition.
        explanation: one sentence for reports.
    """

    heads: tuple[int, int]
    normwise_max: float
    max_abs: float
    score_split: dict[str, Any]
    explanation: str


def head_partition_difference(
    x: Any, params: MHAParams, h1: int, h2: int, *, x_kv: Any = None, digits: int = 20
) -> HeadDifference:
    """Measure, with the certified reference, how far ``h1``- and ``h2``-head attention differ.

    Both layers use the same ``params``; only the partition of the projected width into heads
    differs. The difference is exact (no rounding of the computation is involved): it is the
    difference between two functions.
    """
    a, b = V.positive_int(h1, "h1"), V.positive_int(h2, "h2")
    x_kv = x if x_kv is None else x_kv
    ya, yb = (
        np.asarray(reference.multi_head_attention(x, x_kv, params, h, digits=digits))
        for h in (a, b)
    )
    diff = np.abs(ya - yb)
    norm = float(np.max(np.abs(yb)))
    q = np.asarray(x, np.float64)[..., 0, :] @ params.wq + (0 if params.bq is None else params.bq)
    k = np.asarray(x_kv, np.float64)[..., 0, :] @ params.wk + (
        0 if params.bk is None else params.bk
    )
    width = q.shape[-1]
    d_k = width // b
    per_head = [
        float(q[..., i * d_k : (i + 1) * d_k] @ k[..., i * d_k : (i + 1) * d_k]) / math.sqrt(d_k)
        for i in range(b)
    ]
    split = {"one_head_score": float(q @ k) / math.sqrt(width), "per_head_scores": per_head}
    explanation = (
        f"With {b} heads each score is a dot product over {d_k} of the {width} components "
        f"(scaled by 1/sqrt({d_k})), and each head has its own softmax; one head takes the "
        f"softmax of the full dot product scaled by 1/sqrt({width}). Different functions, not "
        "rounding."
    )
    return HeadDifference(
        (a, b),
        float(diff.max()) / norm if norm else math.inf,
        float(diff.max()),
        split,
        explanation,
    )
