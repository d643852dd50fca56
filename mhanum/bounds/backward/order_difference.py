"""Theorem B.3: two orders of FlashAttention-2's ``dQ`` additions (run-to-run nondeterminism),
papers/backward.md."""

from __future__ import annotations

from typing import Any

import numpy as np

from mhanum._errors import InvalidArgument
from mhanum._threads import one_blas_thread
from mhanum.bounds._result import Bound
from mhanum.bounds.backward.b1 import gradient_bounds
from mhanum.bounds.backward.inputs import inputs
from mhanum.bounds.backward.scope import ASSUMPTIONS, check_scope
from mhanum.bounds.enclosure import read_error
from mhanum.bounds.factors import (
    chain,
    evaluation_rounding,
    operand_bits,
    operand_error,
    rounding_error,
    unit_eta,
    unit_factor,
)
from mhanum.bounds.scale import scale_rounding
from mhanum.numerics import Backward, Numerics, resolve, resolve_backward
from mhanum.problem import AttentionProblem

__all__ = ["dq_order_difference"]


@one_blas_thread
def dq_order_difference(
    q: Any,
    k: Any,
    v: Any,
    d_out: Any,
    mask: Any = None,
    *,
    bias: Any = None,
    scale: float | None = None,
    numerics: Numerics | str | None = None,
    backward: Backward | str | None = None,
    softcap: float | None = None,
) -> Bound:
    """A bound on ``|dq_a - dq_b|`` between two orders of FlashAttention-2's ``dQ`` additions.

    **Theorem B.3.** Let ``dq_a`` and ``dq_b`` be computed as in Theorem B.2 with the same
    inputs, numerics and blocks, their ``n_b = ceil(Lk/block_k)`` partials ``Π_j`` (each a dot
    from zero, the same in both runs) added in two orders. Both sums are within
    ``((1 + u)^{n_b - 1} - 1)·Σ_j|Π_j| + (n_b - 1)·2^emin`` of ``Σ_j Π_j``, so

    .. math::

        |\\hat a - \\hat b| \\le 2\\,((1 + u)^{n_b - 1} - 1)\\,\\sum_j |\\Pi_j| + 2(n_b - 1)\\eta,

    and the scaling and the output rounding add ``u_×|ĉ|(|â| + |b̂|)`` and ``u_out`` of each
    result. ``Σ_j|Π_j|`` is enclosed by ``(1 + γ_B)|dŜ||k̂|`` from B.2's enclosure of ``dŜ``
    (with a soft-cap, of ``dÂ = fl(fl(fl(dŜ·ĉ)·σ̂)·r̂)``, Theorem B.7's step 6c: the partials
    are dots of ``dÂ``). It is 0 for one key block, and for the textbook backward (one chain,
    no atomics).

    Args:
        q, k, v, d_out, mask, bias, scale, numerics, backward: as for
            :func:`attention_grad_bound`.
        softcap: the logit soft-cap ``c``, as for :func:`attention_grad_bound`; a bad one
            (not a finite number > 0) is refused by name.

    Returns:
        A :class:`Bound` shaped like ``dq``, terms ``additions`` and ``rounding``.

    Examples:
        >>> import numpy as np
        >>> from mhanum.numerics import Backward
        >>> rng = np.random.default_rng(0)
        >>> q, k, v, g = (rng.standard_normal((8, 4)) for _ in range(4))
        >>> b = dq_order_difference(q, k, v, g, numerics="fp32",
        ...                         backward=Backward("flash2", block_k=2))
        >>> b.theorem, bool(0 < np.max(b.total) < 1e-5)
        ('B.3', True)
    """
    num = resolve(numerics)
    bw = resolve_backward(backward)
    check_scope(num, bw, "B.3")
    if bw.scale_at != "output":
        msg = f"backward.scale_at: expected 'output' for Theorem B.3, got {bw.scale_at!r}"
        raise InvalidArgument(msg)
    problem = AttentionProblem.of(
        q, k, v, mask=mask, bias=bias, scale=scale, softcap=softcap, d_out=d_out
    )
    x = inputs(problem, num)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        full, dsd = gradient_bounds(x, num, bw)
        ds_used = dsd["ds_used"]
    n = x.k.shape[-2]
    count = len(bw.key_blocks(n))
    acc, out = num.format_of("accum"), num.format_of("output")
    shape = np.shape(full.dq.total)
    if bw.algorithm != "flash2" or count == 1:
        zero = np.zeros(shape)
        return Bound(zero, {"additions": zero, "rounding": zero}, "B.3", ASSUMPTIONS, "dao2023")
    with np.errstate(over="ignore", invalid="ignore"):
        _, dsf = bw.formats(num)
        fin = num.format_of("input")
        ak, f_k = np.abs(x.k) + rounding_error(x.k, fin), fin
        if x.scaled is not None and "k" in x.scaled.errors:  # step 2': the dot reads f̂·k
            ak = np.abs(x.k) + x.scaled.radii["k"] + x.scaled.errors["k"]
            f_k = x.scaled.scale.fmt
        u_op, eta_op = operand_error(num)
        ak = ak * (1 + u_op) + eta_op
        ds_used = ds_used * (1 + u_op) + eta_op
        bits = (operand_bits(num, dsf), operand_bits(num, f_k))
        g_b = unit_factor(num, bw.block_k, None, bits=bits)
        parts = (1 + g_b) * (ds_used @ ak) + count * unit_eta(num, bw.block_k)
        parts = parts * (1 + evaluation_rounding(n))
        grow = chain(count, "sequential", acc.u, None, products=False)
        additions = 2 * grow * parts + 2 * count * acc.smallest_normal
        # both runs multiply by the same ĉ: dq's factor (the scale, or step 2''s)
        f_q = x.factors[0] if x.factors else None
        c_hat, _, u_mul = scale_rounding(x.c64 if f_q is None else f_q[0], acc)
        a_up = (1 + grow) * parts + count * acc.smallest_normal
        y = abs(c_hat) * a_up * (1 + u_mul) + acc.smallest_normal
        rounding = (
            2 * u_mul * abs(c_hat) * a_up + 2 * acc.smallest_normal + 2 * read_error(y, acc, out)
        )
        scaled = abs(c_hat) * additions * (1 + 2.0**-50)
        total = np.where(np.isfinite(full.dq.total), scaled + rounding, np.inf)
    return Bound(
        total=total,
        terms={"additions": scaled, "rounding": rounding},
        theorem="B.3",
        assumptions=ASSUMPTIONS,
        source="dao2023",
        reasons=full.dq.reasons,
    )
