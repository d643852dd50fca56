"""The least a deterministic rounding-error bound can be on given inputs, found by realising a
worst-case rounding.

A deterministic bound in the standard model (every operation ``fl(x op y) = (x op y)(1 + δ)``,
``|δ| ≤ u`` of its format) must hold for **every** choice of the ``δ``, not only for the ones a
real run makes. So on a given input, a choice of the ``δ`` whose error is ``F`` proves that no
sound bound of that model is below ``F`` there, whatever its derivation; a bound's looseness is
``bound / error = (bound / F) · (F / error)``: the first factor is the derivation's own slack,
the second the model's (no deterministic bound can remove it).

This module builds that choice for attention (:func:`attention_floor`), multi-head attention
(:func:`mha_floor`) and attention's textbook backward (:func:`attention_grad_floor`) as ``mhanum.attention``/``mhanum.multi_head_attention`` compute them with the
safe softmax, ``exp``, the scale on the scores, IEEE dots, no mask and no bias, with every sum in
sequential order (which a ``native`` bound covers, since it holds for every order):

1. the first-order error of one output entry ``m`` is linear in the ``δ``: ``Σ_k g_k δ_k`` with
   ``g_k`` the derivative of entry ``m`` with respect to the value rounded at site ``k`` times
   that value (a sum's partial sums ``S_k`` for its ``k``-th addition), plus the known,
   deterministic roundings (the weights into the input format, the scale constant);
2. ``δ_k = u_k · sign(g_k)`` (times the sign of the known part) maximises it: the first-order
   worst case ``W_m``;
3. the computation is then **run** with those ``δ`` (in float64, every sum as its sequential
   recurrence, each partial sum times its own ``1 + δ``): its error ``F_m`` at entry ``m`` is a
   standard-model error, exact up to float64's own, with no first-order caveat.

Theorem A.1 takes four roundings to nearest, as every kernel's conversion makes them: the
scores' into the score format and their product by the scale there (step 3k), the
probabilities' into their format (steps 6k and 6r) and the output's (step 7'). The forward
floors run those as roundings to nearest of the perturbed values (no ``δ`` chosen; the
sensitivities pass through them), which is the model those bounds hold in.

Sites left out only lower ``F`` (a floor with fewer roundings is still a floor): products are
taken exact (a fused multiply-add), exp and division as correctly rounded (``u``, not the
numerics' ``exp_ulps``/``div_ulps``), and no underflow. Operand roundings (``operand_format``,
TF32) are not modelled: those numerics are refused.

For the probabilistic bounds (A.3: Azuma–Hoeffding on ``|δ_k| ≤ u_k``, some roundings taken
deterministically), :meth:`Floor.hoeffding` gives what a bound of that form reaches with the
exact first-order sensitivities in place of every bound a derivation must take on them:
``|known| + Σ_{k ≤ t} c_k + λ·sqrt(Σ_{k > t} c_k²)`` over the increments ``c_k = |g_k| u_k``,
largest first, ``t`` chosen best.

``python benchmarks/tightness.py --mha`` and ``--floor`` print these beside the bounds.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

jax.config.update("jax_enable_x64", True)

import mhanum as mn
from mhanum import InvalidArgument, Numerics
from mhanum.formats import Format, round_jax

Sites = dict[str, Any]


def _narrows(src: Format, dst: Format) -> bool:
    return dst.precision < src.precision


def _check(num: Numerics) -> None:
    plain = (
        num.softmax == "safe"
        and num.exp_form == "exp"
        and num.scale == "scores"
        and num.dot == "ieee"
        and num.operand_format is None
        and num.kv_splits is None
        and num.prob_offset == 0
    )
    if not plain:
        msg = (
            f"numerics: the floor models the safe softmax, exp, scale on the scores, IEEE dots "
            f"and no operand rounding; got {num}"
        )
        raise InvalidArgument(msg)


def _rounded(x: np.ndarray, fmt: Format) -> np.ndarray:
    return np.asarray(mn.round_to(x, fmt), np.float64)


@dataclasses.dataclass(frozen=True)
class _Formats:
    u: dict[str, float]  # the unit roundoff of every site that rounds

    @classmethod
    def of(cls, num: Numerics, heads: bool, c: float) -> _Formats:
        f = {s: num.format_of(s) for s in ("accum", "score", "softmax", "prob", "output")}
        st = num.storage_format
        u: dict[str, float] = {"qk_dot": f["accum"].u, "pv_dot": f["accum"].u}
        if _narrows(f["accum"], f["score"]):
            u["score_take"] = f["score"].u
        if math.frexp(c)[0] != 0.5:  # times a power of two is exact (no underflow here)
            u["scale_mul"] = f["score"].u
        if _narrows(f["score"], f["softmax"]):
            u["soft_take"] = f["softmax"].u
        u |= {"shift": f["softmax"].u, "exp": f["softmax"].u, "sum": f["softmax"].u}
        u["div"] = f["softmax"].u
        if _narrows(f["softmax"], f["prob"]):
            u["prob_take"] = f["prob"].u
        if _narrows(f["accum"], f["output"]):
            u["out_take"] = f["output"].u
        if heads:
            for z in "qkv":
                u[f"{z}_dot"] = u[f"{z}_bias"] = f["accum"].u
                if _narrows(f["accum"], st):
                    u[f"{z}_store"] = st.u
            u["y_dot"] = u["y_bias"] = f["accum"].u
            if _narrows(f["accum"], f["output"]):
                u["y_store"] = f["output"].u
        return cls(u)


def _worst_order(terms: jax.Array, axis: int) -> jax.Array:
    """Per sum of ``terms`` along ``axis``, an order of its addends that keeps the partial sums
    far from 0 (a ``native`` bound holds for every order): the addends of the sign with the
    larger total first, largest first, then the others, smallest first. Indices along ``axis``."""
    total = jnp.sum(terms, axis=axis, keepdims=True)
    lead = jnp.where(total >= 0, terms > 0, terms < 0)
    size = jnp.abs(terms)
    return jnp.lexsort((jnp.where(lead, -size, size), ~lead), axis=axis)


def _ordered(
    terms: jax.Array, axis: int, orders: dict[str, jax.Array] | None, name: str
) -> jax.Array:
    """``terms`` in sequential order along ``axis``, or (``orders`` given) in the worst order,
    which ``orders[name]`` records for the run."""
    if orders is None:
        return terms
    orders[name] = _worst_order(terms, axis)
    return jnp.take_along_axis(terms, orders[name], axis=axis)


def _partial_sums(
    a: jax.Array, b: jax.Array, orders: dict[str, jax.Array] | None = None, name: str = ""
) -> jax.Array:
    """``S[k, ..., i, j] = Σ_{t ≤ k} a[..., i, t] b[..., t, j]``: a sequential dot's partial sums,
    0 where the ``k``-th addend is exactly 0 (adding it is exact: a masked key's, say); with
    ``orders``, its addends in the worst order (:func:`_worst_order`)."""
    terms = _ordered(a[..., :, :, None] * b[..., None, :, :], -2, orders, name)
    return jnp.moveaxis(jnp.where(terms == 0, 0.0, jnp.cumsum(terms, axis=-2)), -2, 0)


def _cumulative(
    e: jax.Array, orders: dict[str, jax.Array] | None = None, name: str = ""
) -> jax.Array:
    """A row sum's partial sums (leading axis), 0 where the addend is exactly 0; with
    ``orders``, in the worst order."""
    e = _ordered(e, -1, orders, name)
    return jnp.moveaxis(jnp.where(e == 0, 0.0, jnp.cumsum(e, axis=-1)), -1, 0)[..., None]


def _live(a: jax.Array, keep: jax.Array | None) -> jax.Array:
    """The logits with the masked ones at ``-inf`` (``exp(-inf) = 0``, exactly)."""
    return a if keep is None else jnp.where(keep, a, -jnp.inf)


# a site's unit roundoff -> the format it rounds into, as a dtype (to tell an exact result)
_DTYPES = {
    2.0**-24: jnp.float32,
    2.0**-11: jnp.float16,
    2.0**-8: jnp.bfloat16,
    2.0**-4: jnp.float8_e4m3fn,
    2.0**-3: jnp.float8_e5m2,
}


class _Run:
    """One computation with perturbed roundings.

    ``mode="linear"``: every rounding adds ``E[site]`` (zero at the call; its derivative is the
    sensitivity); ``mode="real"``: every rounding multiplies by ``1 + D[site]`` (a sum's
    ``D[site]`` has one ``δ`` per partial sum, leading axis).
    """

    def __init__(
        self,
        pert: Sites,
        mode: str,
        exact: dict[str, Any] | None = None,
        nearest: dict[str, Format] | None = None,
        orders: dict[str, jax.Array] | None = None,
    ) -> None:
        self.pert, self.mode, self.exact = pert, mode, exact or {}
        self.nearest, self.orders = nearest or {}, orders or {}

    def _delta(self, name: str, x: jax.Array, delta: jax.Array) -> jax.Array:
        """``delta``, or 0 where ``x`` is a number of the site's format (round to nearest
        leaves it exact, and the bounds may rely on it: ``exp(0) = 1``, a one-key row's
        ``P = 1``)."""
        dtype = self.exact.get(name)
        if dtype is None:
            return delta
        return jnp.where(x.astype(dtype).astype(x.dtype) == x, 0.0, delta)

    def round(self, name: str, x: jax.Array) -> jax.Array:
        if name in self.nearest:
            # a rounding to nearest, as the kernel makes it: no δ to choose; the sensitivities
            # (linear) pass through it, the run rounds
            return x if self.mode == "linear" else round_jax(x, self.nearest[name])
        if name not in self.pert:
            return x
        if self.mode == "linear":
            return x + self.pert[name]
        return x * (1 + self._delta(name, x, self.pert[name]))

    def dot(self, name: str, a: jax.Array, b: jax.Array) -> jax.Array:
        if name not in self.pert or self.mode == "linear":
            return self.round(name, a @ b)
        deltas = self.pert[name]  # (n, ..., i, j): the k-th addition's δ (k ≥ 1; row 0 unused)
        if name in self.orders:  # each dot's addends in its own order
            terms = a[..., :, :, None] * b[..., None, :, :]
            terms = jnp.take_along_axis(terms, self.orders[name], axis=-2)
            return self._chain(name, jnp.moveaxis(terms, -2, 0), deltas)

        def step(acc: jax.Array, tk: tuple[jax.Array, jax.Array, jax.Array]) -> Any:
            at, bt, dk = tk
            x = acc + at[..., :, None] * bt[..., None, :]
            return x * (1 + self._delta(name, x, dk)), None

        a_t = jnp.moveaxis(a, -1, 0)
        b_t = jnp.moveaxis(b, -2, 0)
        first = a_t[0][..., :, None] * b_t[0][..., None, :]
        return jax.lax.scan(step, first, (a_t[1:], b_t[1:], deltas[1:]))[0]

    def _chain(self, name: str, terms: jax.Array, deltas: jax.Array) -> jax.Array:
        """The addends ``terms`` (leading axis) added in that order, the ``k``-th partial sum
        times ``1 + deltas[k]``."""

        def step(acc: jax.Array, tk: tuple[jax.Array, jax.Array]) -> Any:
            x = acc + tk[0]
            return x * (1 + self._delta(name, x, tk[1])), None

        return jax.lax.scan(step, terms[0], (terms[1:], deltas[1:]))[0]

    def sum(self, name: str, e: jax.Array) -> jax.Array:
        if name not in self.pert or self.mode == "linear":
            return self.round(name, jnp.sum(e, axis=-1, keepdims=True))
        if name in self.orders:
            e = jnp.take_along_axis(e, self.orders[name], axis=-1)
        return self._chain(name, jnp.moveaxis(e, -1, 0)[..., None], self.pert[name])


def _attend(
    run: _Run, q: jax.Array, k: jax.Array, v: jax.Array, c: float, keep: jax.Array | None = None
) -> jax.Array:
    t = run.round("score_take", run.dot("qk_dot", q, jnp.swapaxes(k, -1, -2)))
    a = _live(run.round("soft_take", run.round("scale_mul", t * c)), keep)
    d = run.round("shift", a - jnp.max(a, axis=-1, keepdims=True))
    e = run.round("exp", jnp.exp(d))
    p = run.round("prob_take", run.round("div", e / run.sum("sum", e)))
    return run.round("out_take", run.dot("pv_dot", p, v))


def _split(x: jax.Array, heads: int) -> jax.Array:
    return jnp.swapaxes(x.reshape(*x.shape[:-1], heads, x.shape[-1] // heads), -2, -3)


def _merge(x: jax.Array) -> jax.Array:
    x = jnp.swapaxes(x, -2, -3)
    return x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])


def _mha(run: _Run, x: jax.Array, w: dict[str, Any], heads: int, c: float) -> jax.Array:
    def proj(z: str, inp: jax.Array, wz: Any, bz: Any) -> jax.Array:
        y = run.dot(f"{z}_dot", inp, wz)
        return run.round(f"{z}_store", run.round(f"{z}_bias", y + bz))

    q, k, v = (_split(proj(z, x, w[f"w{z}"], w[f"b{z}"]), heads) for z in "qkv")
    o = _merge(_attend(run, q, k, v, c))
    return proj("y", o, w["wo"], w["bo"])


_TOP = 64  # the largest increments kept per entry (a bound with lam < 16 needs at most lam²/4)


@dataclasses.dataclass
class Floor:
    """The realised worst-case rounding of chosen output entries.

    Attributes:
        entries: the output entries (index tuples).
        known: per entry, the error of the known roundings alone (weights, scale constant).
        worst: per entry, the first-order worst case ``W = |known| + Σ_k |g_k| u_k``.
        realised: per entry, the error of the computation run with the maximising ``δ``
            (``F``, the floor).
        spread: per entry, ``sqrt(Σ_k g_k² u_k²)`` (the exact sensitivities' root sum of squares).
        top: per entry, the ``_TOP`` largest increments ``|g_k| u_k``, largest first.
        increments: per entry, every increment ``|g_k| u_k`` (:meth:`quantile`), or none.
    """

    entries: list[tuple[int, ...]]
    known: np.ndarray
    worst: np.ndarray
    realised: np.ndarray
    spread: np.ndarray
    top: np.ndarray
    increments: list[np.ndarray] | None = None

    def quantile(self, p: float, draws: int = 4000, seed: int = 0) -> np.ndarray:
        """Per entry, the ``p``-quantile of the first-order error ``|known + Σ_k s_k |g_k| u_k|``
        over independent random signs ``s_k = ±1`` (every rounding ``±u_k``, mean zero:
        roundings the independence model of A.3 allows), from ``draws`` samples: the
        ``_SIGNED`` largest increments with drawn signs, the sum of the rest as its normal law
        (:func:`_berry_esseen`: the quantile is taken at ``p`` less twice its distance). A
        bound that holds with probability ``p`` at an entry under that model is at least this
        there (up to the sampling error and second order)."""
        if self.increments is None:
            msg = "increments: this floor kept none (keep_increments=False)"
            raise InvalidArgument(msg)
        rng = np.random.default_rng(seed)
        out = []
        for known, inc in zip(self.known, self.increments, strict=True):
            inc = -np.sort(-inc)
            big, small = inc[:_SIGNED], inc[_SIGNED:]
            sums = np.concatenate([
                known + (rng.integers(0, 2, (chunk, big.size), dtype=np.int8) * 2 - 1) @ big
                for chunk in np.diff(np.r_[0:draws:500, draws])
            ])  # fmt: skip
            gap = 0.0
            if small.size:  # the rest's sum as its normal law, off by at most ``gap``
                sums = sums + rng.standard_normal(draws) * math.sqrt(float(np.sum(small**2)))
                gap = _berry_esseen(small)
            out.append(float(np.quantile(np.abs(sums), max(p - 2 * gap, 0.0))))
        return np.array(out)

    def hoeffding(self, lam: float) -> np.ndarray:
        """Per entry, the least bound of A.3's form on the exact sensitivities: the ``t`` largest
        increments ``|g_k| u_k`` taken deterministically, Azuma–Hoeffding with ``lam`` on the
        rest, ``t`` chosen best (an increment ``c`` is worth taking out only if
        ``c > 2·spread/lam``, which at most ``lam²/4`` can be)."""
        if not 0 <= lam < 16:
            msg = f"lam: expected 0 <= lam < 16, got {lam}"
            raise InvalidArgument(msg)
        out = []
        for known, spread, top in zip(self.known, self.spread, self.top, strict=True):
            taken = np.concatenate([[0.0], np.cumsum(top)])
            rest = np.maximum(spread**2 - np.concatenate([[0.0], np.cumsum(top**2)]), 0.0)
            out.append(abs(known) + float(np.min(taken + lam * np.sqrt(rest))))
        return np.array(out)


_SIGNED = 16384  # the largest increments Floor.quantile draws signs for; the rest as one normal


def _berry_esseen(small: np.ndarray) -> float:
    """How far in distribution (Kolmogorov) the sum of random signs times ``small`` is from its
    normal law at most (Berry–Esseen for independent terms, constant 0.56:
    ``0.56·Σc³/(Σc²)^{3/2}``). A probability of ``|sum| <= t`` computed with the normal law is
    then off by at most twice that, so :meth:`Floor.quantile` takes the quantile at ``p``
    less twice that: the true ``p``-quantile is at least it."""
    return 0.56 * float(np.sum(small**3)) / float(np.sum(small**2)) ** 1.5


def _floor(
    fwd: Callable[[_Run], jax.Array],
    exact: np.ndarray,
    masses: dict[str, tuple[jax.Array, bool]],
    u: dict[str, float],
    entries: list[tuple[int, ...]],
    nearest: dict[str, Format] | None = None,
    orders: dict[str, jax.Array] | None = None,
    keep_increments: bool = False,
) -> Floor:
    """``masses[site] = (values, is_sum)``: a sum's partial sums (leading axis) or the rounded
    values themselves; ``nearest``: the sites rounded to nearest as the kernel rounds them
    (the probabilities into their format: steps 6k and 6r of Theorem A.1 rely on it), which
    take no ``δ``; ``orders``: the sums whose addends the run takes in another order than
    their index's (the ``masses``' partial sums in that order)."""
    zeros = {s: jnp.zeros(m.shape[1:] if is_sum else m.shape) for s, (m, is_sum) in masses.items()}
    # the linearisation and each entry's pullback as compiled programs (op by op, each of their
    # operations would be a program of its own)
    y0, vjp = jax.jit(lambda e: jax.vjp(lambda e: fwd(_Run(e, "linear", nearest=nearest)), e))(
        zeros
    )
    pullback = jax.jit(lambda vjp, cot: vjp(cot)[0])
    values = {s: (np.asarray(m), is_sum) for s, (m, is_sum) in masses.items()}
    known = np.asarray(y0) - exact
    worst, realised, spread, tops, kept = [], [], [], [], []
    exact_in = {s: _DTYPES[u[s]] for s in masses if u[s] in _DTYPES}
    # the orders as an argument: as constants of the program XLA would fold their gathers
    real = jax.jit(lambda d, o: fwd(_Run(d, "real", exact_in, nearest, o)))
    for m in entries:
        cot = np.zeros(known.shape)
        cot[m] = 1.0
        g = {s: np.asarray(gs) for s, gs in pullback(vjp, cot).items()}
        sign = 1.0 if known[m] >= 0 else -1.0
        deltas, incs = {}, []
        for s, (vals, is_sum) in values.items():
            if is_sum:  # δ_k S_k for k ≥ 1 (the first partial sum is a product, not rounded)
                coef = g[s][None] * vals
                coef[0] = 0.0
            else:
                coef = g[s] * vals
            incs.append(u[s] * np.abs(coef).ravel())
            deltas[s] = sign * u[s] * np.sign(coef)
        inc = np.concatenate(incs)
        top = -np.sort(-np.partition(inc, -_TOP)[-_TOP:]) if inc.size > _TOP else -np.sort(-inc)
        tops.append(np.pad(top, (0, _TOP - top.size)))
        worst.append(abs(known[m]) + float(np.sum(inc)))
        realised.append(float(real(deltas, orders or {})[m]) - exact[m])
        spread.append(math.sqrt(float(np.sum(inc**2))))
        if keep_increments:
            kept.append(inc[inc > 0])
    return Floor(
        entries,
        np.array([known[m] for m in entries]),
        np.array(worst),
        np.array(realised),
        np.array(spread),
        np.array(tops),
        kept if keep_increments else None,
    )


ORDERS = ("sequential", "worst")
"""The orders of the sums a floor takes: each sum in its index order, or each in its own worst
order (:func:`_worst_order`: the partial sums kept far from 0), which only a bound for every
order (``native``) must cover."""


def _order_book(order: str) -> dict[str, jax.Array] | None:
    """The record of the sums' orders a floor in ``order`` keeps (None: index order)."""
    if order not in ORDERS:
        msg = f"order: expected one of {ORDERS}, got {order!r}"
        raise InvalidArgument(msg)
    return {} if order == "worst" else None


def attention_floor(
    q: Any, k: Any, v: Any, numerics: Numerics | str, entries: list[tuple[int, ...]],
    *, scale: float | None = None, mask: Any = None, order: str = "sequential",
    keep_increments: bool = False,
) -> Floor:  # fmt: skip
    """The floor of :func:`mhanum.attention` on ``(L, d)`` inputs already in the input format,
    at ``entries`` of the output: ``scale`` (default ``1/sqrt(d)``), ``mask`` (``(Lq, Lk)``
    booleans, True where attended, every row keeping a key) or none, every sum in the
    ``order`` of :data:`ORDERS` (``"worst"``: a floor of the bounds for every order only);
    ``keep_increments`` for :meth:`Floor.quantile`."""
    num = Numerics.preset(numerics) if isinstance(numerics, str) else numerics
    _check(num)
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    fmt = num.format_of("input")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not np.array_equal(_rounded(x, fmt), x):
            msg = f"{name}: expected values of the input format {fmt.name}"
            raise InvalidArgument(msg)
    orders = _order_book(order)
    c = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    c_hat = float(_rounded(np.array(c), num.format_of("score")))
    u = _Formats.of(num, heads=False, c=c_hat).u
    nearest = _nearest_sites(num, u)
    keep = _keep(mask, (q.shape[-2], k.shape[-2]))
    exact = np.asarray(mn.reference.attention(q, k, v, mask=mask, scale=c), np.float64)
    qj, kj, vj = (jnp.asarray(x) for x in (q, k, v))

    def fwd(run: _Run) -> jax.Array:
        return _attend(run, qj, kj, vj, c_hat, keep)

    masses = _attention_masses(qj, kj, vj, c_hat, u, keep, orders)
    return _floor(fwd, exact, masses, u, entries, nearest, orders, keep_increments)


def _keep(mask: Any, shape: tuple[int, int]) -> jax.Array | None:
    """``mask`` as the attended keys, checked: ``shape`` booleans, a key in every row."""
    if mask is None:
        return None
    keep = np.asarray(mask, bool)
    if keep.shape != shape or not keep.any(axis=-1).all():
        msg = f"mask: expected {shape} booleans, a key in every row"
        raise InvalidArgument(msg)
    return jnp.asarray(keep)


def _nearest_sites(num: Numerics, u: dict[str, float]) -> dict[str, Format]:
    """The roundings Theorem A.1 takes to nearest, as every kernel's conversions make them:
    the scores' into the score format and their product by the scale (step 3k), the
    probabilities' into their format (steps 6k and 6r) and the output's (step 7'), taken out
    of the free sites ``u``."""
    score = num.format_of("score")
    sites = {
        "score_take": score,
        "scale_mul": score,
        "prob_take": num.format_of("prob"),
        "out_take": num.format_of("output"),
    }
    return {s: f for s, f in sites.items() if u.pop(s, None) is not None}


def _attention_masses(
    q: jax.Array, k: jax.Array, v: jax.Array, c: float, u: dict[str, float],
    keep: jax.Array | None = None, orders: dict[str, jax.Array] | None = None,
) -> dict[str, tuple[jax.Array, bool]]:  # fmt: skip
    """Every site's values at the unperturbed point (exact arithmetic, known roundings in);
    ``keep``: the attended keys (a masked logit's sites are 0); ``orders``: the sums' orders
    (worst), recorded there."""
    t = q @ jnp.swapaxes(k, -1, -2)
    a = t * c
    live = _live(a, keep)
    d = live - jnp.max(live, axis=-1, keepdims=True)
    e = jnp.exp(d)
    d = jnp.where(jnp.isfinite(d), d, 0.0)
    p = e / jnp.sum(e, axis=-1, keepdims=True)
    vals: dict[str, tuple[jax.Array, bool]] = {
        "qk_dot": (_partial_sums(q, jnp.swapaxes(k, -1, -2), orders, "qk_dot"), True),
        "score_take": (t, False),
        "scale_mul": (a, False),
        "soft_take": (a, False),
        "shift": (d, False),
        "exp": (e, False),
        "sum": (_cumulative(e, orders, "sum"), True),
        "div": (p, False),
        "prob_take": (p, False),
        "pv_dot": (_partial_sums(p, v, orders, "pv_dot"), True),
        "out_take": (p @ v, False),
    }
    return {s: m for s, m in vals.items() if s in u}


def mha_floor(
    x: Any, params: mn.MHAParams, heads: int, numerics: Numerics | str,
    entries: list[tuple[int, ...]], *, order: str = "sequential", keep_increments: bool = False,
) -> Floor:  # fmt: skip
    """The floor of :func:`mhanum.multi_head_attention` (self-attention on ``x`` ``(L, d_model)``,
    already in the input format; the weights are rounded into it as the emulation does) at
    ``entries`` of the output, every sum in the ``order`` of :data:`ORDERS`."""
    num = Numerics.preset(numerics) if isinstance(numerics, str) else numerics
    _check(num)
    x = np.asarray(x, np.float64)
    fmt = num.format_of("input")
    if not np.array_equal(_rounded(x, fmt), x):
        msg = f"x: expected values of the input format {fmt.name}"
        raise InvalidArgument(msg)
    orders = _order_book(order)
    names = ("wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo")
    w_exact = {n: np.asarray(getattr(params, n), np.float64) for n in names}
    w_hat = {n: jnp.asarray(_rounded(a, fmt)) for n, a in w_exact.items()}
    dk = w_exact["wq"].shape[1] // heads
    c = 1.0 / math.sqrt(dk)
    c_hat = float(_rounded(np.array(c), num.format_of("score")))
    u = _Formats.of(num, heads=True, c=c_hat).u
    nearest = _nearest_sites(num, u)
    exact = np.asarray(mn.reference.multi_head_attention(x, x, params, heads), np.float64)
    xj = jnp.asarray(x)

    def fwd(run: _Run) -> jax.Array:
        return _mha(run, xj, w_hat, heads, c_hat)

    masses: dict[str, tuple[jax.Array, bool]] = {}
    proj = {}
    for z in "qkv":
        s = _partial_sums(xj, w_hat[f"w{z}"], orders, f"{z}_dot")
        proj[z] = s[-1] + w_hat[f"b{z}"]
        masses |= {
            f"{z}_dot": (s, True),
            f"{z}_bias": (proj[z], False),
            f"{z}_store": (proj[z], False),
        }
    q, k, v = (_split(proj[z], heads) for z in "qkv")
    masses |= _attention_masses(q, k, v, c_hat, u, None, orders)
    t = q @ jnp.swapaxes(k, -1, -2)
    a = t * c_hat
    p = jax.nn.softmax(a, axis=-1)
    o = _merge(p @ v)
    s = _partial_sums(o, w_hat["wo"], orders, "y_dot")
    y = s[-1] + w_hat["bo"]
    masses |= {"y_dot": (s, True), "y_bias": (y, False), "y_store": (y, False)}
    masses = {n: m for n, m in masses.items() if n in u}
    return _floor(fwd, exact, masses, u, entries, nearest, orders, keep_increments)


_LOGIT_SITES = ("qk_dot", "score_take", "scale_mul", "soft_take")


def _grad_formats(num: Numerics, c: float, flash: bool = False) -> dict[str, float]:
    """The sites of the backward (Backward's default formats) and the forward's: up to the
    stored probabilities (textbook), or the whole forward and its log-sum-exp (FlashAttention-2,
    which recomputes ``P`` from it and reads the output in ``D``)."""
    u = _Formats.of(num, heads=False, c=c).u
    acc, out = num.format_of("accum"), num.format_of("output")
    grad, prob = num.format_of("softmax"), num.format_of("prob")
    if flash:
        sm, fin = num.format_of("softmax"), num.format_of("input")
        u |= {"log": sm.u, "lse_add": sm.u, "lse_sub": sm.u, "p_exp": sm.u}
        u |= {f"{site}_b": u[site] for site in _LOGIT_SITES if site in u}
        if _narrows(sm, prob):
            u["pr_take"] = prob.u
        if _narrows(out, grad):
            u["og_take"] = grad.u
        u["go_mul"] = grad.u
        if _narrows(grad, fin):  # dS to the input format before the dots
            u["ds_take"] = fin.u
        src = sm
    else:
        for site in ("pv_dot", "out_take"):
            u.pop(site, None)
        src = prob
    u |= {"dv_dot": acc.u, "dp_dot": acc.u, "dq_dot": acc.u, "dk_dot": acc.u}
    if _narrows(acc, grad):
        u["dp_take"] = grad.u
    if _narrows(src, grad):
        u["pg_take"] = grad.u
    u |= {"d_sum": grad.u, "diff_sub": grad.u, "ds_mul": grad.u}
    if not flash:
        u["dpp_mul"] = grad.u
    if _narrows(acc, out):
        u |= {"dq_out": out.u, "dk_out": out.u, "dv_out": out.u}
    if math.frexp(c)[0] != 0.5:  # fl_acc(ĉ·acc) at the end of dq and dk
        u |= {"dq_scale": acc.u, "dk_scale": acc.u}
    return u


def _grad(
    run: _Run, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, c: float,
    keep: jax.Array | None = None,
) -> Any:  # fmt: skip
    t = run.round("score_take", run.dot("qk_dot", q, k.T))
    a = _live(run.round("soft_take", run.round("scale_mul", t * c)), keep)
    d = run.round("shift", a - jnp.max(a, axis=-1, keepdims=True))
    e = run.round("exp", jnp.exp(d))
    p = run.round("prob_take", run.round("div", e / run.sum("sum", e)))
    dv = run.round("dv_out", run.dot("dv_dot", p.T, g))
    dp = run.round("dp_take", run.dot("dp_dot", g, v.T))
    pg = run.round("pg_take", p)
    big_d = run.sum("d_sum", run.round("dpp_mul", dp * pg))
    ds = run.round("ds_mul", pg * run.round("diff_sub", dp - big_d))
    dq = run.round("dq_out", run.round("dq_scale", run.dot("dq_dot", ds, k) * c))
    dk = run.round("dk_out", run.round("dk_scale", run.dot("dk_dot", ds.T, q) * c))
    return {"dq": dq, "dk": dk, "dv": dv}


def _grad_flash(
    run: _Run, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, c: float,
    keep: jax.Array | None = None,
) -> Any:  # fmt: skip
    """FlashAttention-2's backward with one block of queries and of keys (every dot one chain)."""
    t = run.round("score_take", run.dot("qk_dot", q, k.T))
    a = _live(run.round("soft_take", run.round("scale_mul", t * c)), keep)
    top = jnp.max(a, axis=-1, keepdims=True)
    d = run.round("shift", a - top)
    e = run.round("exp", jnp.exp(d))
    ell = run.sum("sum", e)
    p = run.round("prob_take", run.round("div", e / ell))
    o = run.round("out_take", run.dot("pv_dot", p, v))
    lse = run.round("lse_add", top + run.round("log", jnp.log(ell)))
    # the logits recomputed: B.2 holds for every order of their dot, so their roundings are
    # the backward's own, not the forward's
    t2 = run.round("score_take_b", run.dot("qk_dot_b", q, k.T))
    a2 = _live(run.round("soft_take_b", run.round("scale_mul_b", t2 * c)), keep)
    pr = run.round("p_exp", jnp.exp(run.round("lse_sub", a2 - lse)))
    dv = run.round("dv_out", run.dot("dv_dot", run.round("pr_take", pr).T, g))
    dp = run.round("dp_take", run.dot("dp_dot", g, v.T))
    big_d = run.sum("d_sum", run.round("go_mul", g * run.round("og_take", o)))
    pg = run.round("pg_take", pr)
    ds = run.round("ds_take", run.round("ds_mul", pg * run.round("diff_sub", dp - big_d)))
    dq = run.round("dq_out", run.round("dq_scale", run.dot("dq_dot", ds, k) * c))
    dk = run.round("dk_out", run.round("dk_scale", run.dot("dk_dot", ds.T, q) * c))
    return {"dq": dq, "dk": dk, "dv": dv}


def attention_grad_floor(
    q: Any, k: Any, v: Any, d_out: Any, numerics: Numerics | str, which: str,
    entries: list[tuple[int, ...]], algorithm: str = "textbook", mask: Any = None,
) -> Floor:  # fmt: skip
    """The floor of the gradient ``which`` (``"dq"``, ``"dk"``, ``"dv"``) of
    :func:`mhanum.attention_grad` with the ``algorithm``'s backward (``"textbook"``, or
    ``"flash2"`` with one block: ``L <= 64``, Backward's default blocks) and its default
    formats, on ``(L, d)`` inputs and ``d_out`` already in the input format, default scale;
    ``mask`` (``(L, L)`` booleans, True where attended, every row keeping a key) or none."""
    num = Numerics.preset(numerics) if isinstance(numerics, str) else numerics
    _check(num)
    if which not in ("dq", "dk", "dv"):
        msg = f"which: expected 'dq', 'dk' or 'dv', got {which!r}"
        raise InvalidArgument(msg)
    flash = algorithm == "flash2"
    if algorithm not in ("textbook", "flash2") or (flash and np.shape(q)[-2] > 64):
        msg = f"algorithm: expected 'textbook', or 'flash2' with L <= 64, got {algorithm!r}"
        raise InvalidArgument(msg)
    arrays = [np.asarray(x, np.float64) for x in (q, k, v, d_out)]
    fmt = num.format_of("input")
    for name, x in zip(("q", "k", "v", "d_out"), arrays, strict=True):
        if not np.array_equal(_rounded(x, fmt), x):
            msg = f"{name}: expected values of the input format {fmt.name}"
            raise InvalidArgument(msg)
    q, k, v, g = (jnp.asarray(x) for x in arrays)
    c = 1.0 / math.sqrt(q.shape[-1])
    c_hat = float(_rounded(np.array(c), num.format_of("score")))
    u = _grad_formats(num, c_hat, flash)
    keep = None
    if mask is not None:
        keep_np = np.asarray(mask, bool)
        if keep_np.shape != (q.shape[-2], k.shape[-2]) or not keep_np.any(axis=-1).all():
            msg = f"mask: expected {(q.shape[-2], k.shape[-2])} booleans, a key in every row"
            raise InvalidArgument(msg)
        keep = jnp.asarray(keep_np)
    exact = np.asarray(getattr(mn.reference.attention_grad(*arrays, mask=mask), which), np.float64)

    def fwd(run: _Run) -> jax.Array:
        return (_grad_flash if flash else _grad)(run, q, k, v, g, c_hat, keep)[which]

    masses = _attention_masses(q, k, v, c_hat, u, keep)  # the forward's sites
    a = _live(q @ k.T * c_hat, keep)
    top = jnp.max(a, axis=-1, keepdims=True)
    ell = jnp.sum(jnp.exp(a - top), axis=-1, keepdims=True)
    p = jax.nn.softmax(a, axis=-1)
    o = p @ v
    dp = g @ v.T
    big_d = jnp.sum(dp * p, axis=-1, keepdims=True)  # = Σ_c g_c o_c
    ds = p * (dp - big_d)
    vals: dict[str, tuple[jax.Array, bool]] = {
        "log": (jnp.log(ell), False),
        "lse_add": (top + jnp.log(ell), False),
        "lse_sub": (jnp.where(p > 0, a - top - jnp.log(ell), 0.0), False),
        "p_exp": (p, False),
        "pr_take": (p, False),
        "og_take": (o, False),
        "go_mul": (g * o, False),
        "ds_take": (ds, False),
        "dv_dot": (_partial_sums(p.T, g), True),
        "dv_out": (p.T @ g, False),
        "dp_dot": (_partial_sums(g, v.T), True),
        "dp_take": (dp, False),
        "pg_take": (p, False),
        "dpp_mul": (dp * p, False),
        "d_sum": (_cumulative(g * o if flash else dp * p), True),
        "diff_sub": (dp - big_d, False),
        "ds_mul": (ds, False),
        "dq_dot": (_partial_sums(ds, k), True),
        "dq_scale": (ds @ k * c_hat, False),
        "dq_out": (ds @ k * c_hat, False),
        "dk_dot": (_partial_sums(ds.T, q), True),
        "dk_scale": (ds.T @ q * c_hat, False),
        "dk_out": (ds.T @ q * c_hat, False),
    }
    nearest = None
    if flash:  # the recomputed logits' sites hold the forward's values
        vals |= {f"{site}_b": masses[site] for site in _LOGIT_SITES if site in masses}
        # B.2 reads the forward's output through A.1, whose conversions round to nearest
        # (steps 3k, 6k, 6r, 7'); the recomputed logits' are B.2's own, free
        nearest = _nearest_sites(num, u)
    masses = {n: m for n, m in (masses | vals).items() if n in u}
    return _floor(fwd, exact, masses, u, entries, nearest)
