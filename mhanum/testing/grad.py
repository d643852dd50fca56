"""Certified tolerances for other people's attention gradients: "is this difference a bug, or
rounding?", for ``dq``, ``dk``, ``dv``, ``dbias`` and ``dsink``.

:func:`attention_grad_oracle` gives, element by element and gradient by gradient, how far a
kernel's backward pass may lie from the exact gradients of its inputs
(:func:`mhanum.reference.attention_grad`, certified): the bounds of Theorems B.1 and B.2
(:func:`mhanum.bounds.attention_grad_bound`) under every candidate of the kernel's backward
descriptor (:mod:`mhanum.testing.backward_kernels`), the largest of them, plus what the
descriptor says the kernel does beyond the model (a softmax backward as a difference of
products; the sums of grouped heads' and broadcast biases' gradients), plus the float64
rounding of the certified reference. :func:`assert_attention_grad_close` checks a kernel's
gradients against it and, when one fails, names the gradient, how many of its elements fail,
the worst one and the bound's term that governs it.

>>> import numpy as np, jax
>>> rng = np.random.default_rng(0)
>>> q, k, v, g = (rng.standard_normal((1, 8, 1, 16)).astype(np.float32) for _ in range(4))
>>> _, vjp = jax.vjp(jax.nn.dot_product_attention, q, k, v)
>>> dq, dk, dv = vjp(g)
>>> assert_attention_grad_close((dq, dk, dv), q, k, v, g, kernel="jax-xla", layout="blhd")
>>> bad = np.array(dq); bad[0, 3, 0, 5] += 1e-3
>>> assert_attention_grad_close((bad, dk, dv), q, k, v, g, kernel="jax-xla", layout="blhd")
... # doctest: +ELLIPSIS
Traceback (most recent call last):
    ...
mhanum.testing.grad.GradientMismatch: dq: 1 of 128 elements outside the certified tolerance...
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from mhanum import masks
from mhanum._errors import InvalidArgument
from mhanum._threads import map_threads, one_blas_thread
from mhanum.testing.backward_kernels import BackwardKernel, get_backward_kernel
from mhanum.testing.grad_magnitudes import gradient_magnitudes, probabilities_upper
from mhanum.testing.kernels import Kernel
from mhanum.testing.oracle import (
    Oracle,
    PredictedOverflow,
    as_float64,
    fold_candidates,
    keyword_defaults,
    keywords_over,
)

if TYPE_CHECKING:
    from mhanum.numerics import Backward, Numerics

__all__ = [
    "GRADIENTS",
    "MHA_GRADIENTS",
    "GradientMismatch",
    "GradientOracle",
    "assert_attention_grad_close",
    "assert_mha_grad_close",
    "attention_grad_oracle",
    "attention_grad_tolerance",
    "mha_grad_oracle",
    "mha_grad_tolerance",
]

GRADIENTS = ("dq", "dk", "dv", "dbias", "dsink")
"""The gradients an attention oracle may check, in this order."""

MHA_GRADIENTS = ("dx_q", "dx_kv", "dwq", "dwk", "dwv", "dwo", "dbq", "dbk", "dbv", "dbo",
                 "dbias", "dsink")  # fmt: skip
"""The gradients a multi-head attention oracle may check, in this order (``dwq`` the gradient
of ``params.wq``, ...)."""

_LAYOUTS = ("bhld", "blhd")
_FORMATS = {"float64": "float32", "float32": "float32", "bfloat16": "bfloat16",
            "float16": "float16"}  # fmt: skip
_F64 = 2.0**-52  # the certified reference (17 digits) rounded to float64, relative, with margin


class GradientMismatch(AssertionError):
    """A kernel's gradient lies outside its certified tolerance (an ``AssertionError``)."""


def _oracle_class() -> Any:
    return Oracle


@dataclasses.dataclass(frozen=True)
class GradientOracle:
    """The exact gradients and their certified tolerances, one :class:`mhanum.testing.Oracle`
    per gradient (``dq``, ``dk``, ``dv``, and ``dbias``, ``dsink`` where the inputs have a bias
    or sinks), each with the forward oracle's contract, element by element: where the tolerance
    is finite, ``|actual - exact| <= tolerance`` (an inf or NaN where the exact value is finite
    fails); where it is infinite, the model bounds nothing (``reason`` says why) and any value
    passes, an overflow there warned as :class:`mhanum.testing.PredictedOverflow`.

    Attributes:
        oracles: gradient name -> its :class:`mhanum.testing.Oracle` (``exact``,
            ``tolerance``, ``term``, ``reason``), shaped as the kernel returns the gradient.
        kernel: the backward descriptor.
        dtype: the input format the tolerances were computed for.
    """

    oracles: Mapping[str, Any]
    kernel: BackwardKernel
    dtype: str

    def __getitem__(self, name: str) -> Any:
        if name not in self.oracles:
            msg = f"name: expected one of {tuple(self.oracles)}, got {name!r}"
            raise InvalidArgument(msg)
        return self.oracles[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.oracles)

    @property
    def tolerance(self) -> dict[str, np.ndarray]:
        """Gradient name -> its tolerance."""
        return {n: o.tolerance for n, o in self.oracles.items()}

    @property
    def exact(self) -> dict[str, np.ndarray]:
        """Gradient name -> the certified exact gradient."""
        return {n: o.exact for n, o in self.oracles.items()}

    def check(self, grads: Any) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Gradient name -> ``(failing, ratio)`` (:meth:`mhanum.testing.Oracle.check`) for each
        gradient given in ``grads`` (see :func:`assert_attention_grad_close`)."""
        return {n: self.oracles[n].check(a) for n, a in self._given(grads).items()}

    def message(self, grads: Any) -> str | None:
        """The failure report for ``grads`` (the failing gradients, worst first), or None."""
        given = self._given(grads)
        texts = []
        for name, actual in given.items():
            text = self.oracles[name].message(actual)
            if text is not None:
                worst = float(np.max(self.oracles[name].check(actual)[1]))
                texts.append((worst, f"{name}: {text}"))
        if not texts:
            return None
        texts.sort(key=lambda t: -t[0])
        return "; ".join(t for _, t in texts)

    def assert_close(self, grads: Any) -> None:
        """Raise :class:`GradientMismatch` with :meth:`message` when a bounded element of a
        given gradient fails; warn :class:`mhanum.testing.PredictedOverflow` (naming the
        gradient) when a kernel overflowed only where its model allows it."""
        _assert_close(self, grads, stacklevel=3)

    def _given(self, grads: Any) -> dict[str, Any]:
        order = MHA_GRADIENTS if "dx_q" in self.oracles else GRADIENTS
        got = _as_mapping(grads, order)
        if hasattr(grads, "_fields"):  # mhanum's Gradients hold dS as dbias even without a bias
            got = {n: a for n, a in got.items() if n in self.oracles}
        for name in got:
            if name not in self.oracles:
                msg = (
                    f"grads: expected gradients among {tuple(self.oracles)} for these inputs, "
                    f"got {name!r}"
                )
                raise InvalidArgument(msg)
        if not got:
            msg = "grads: expected at least one gradient that is not None, got none"
            raise InvalidArgument(msg)
        return got


def _assert_close(oracle: GradientOracle, grads: Any, *, stacklevel: int) -> None:
    """:meth:`GradientOracle.assert_close`, its warning attributed ``stacklevel`` frames up."""
    text = oracle.message(grads)
    if text is not None:
        raise GradientMismatch(text)
    for name, actual in oracle._given(grads).items():
        o = oracle.oracles[name]
        got = as_float64(actual, name)
        if (o.unbounded & ~np.isfinite(got) & np.isfinite(o.exact)).any():
            warning = PredictedOverflow(f"{name}: {o.unbounded_report(actual)}")
            warnings.warn(warning, stacklevel=stacklevel)


def _as_mapping(grads: Any, order: tuple[str, ...]) -> dict[str, Any]:
    """``grads`` as gradient name -> array, the ``None`` entries dropped (the ``params`` of a
    :class:`mhanum.gradients.MHAGradients` spread into ``dwq``, ..., ``dbo``)."""
    if isinstance(grads, Mapping):
        items = dict(grads)
    elif hasattr(grads, "_fields"):  # a named tuple (mhanum.gradients.Gradients)
        items = dict(zip(grads._fields, grads, strict=True))
    elif isinstance(grads, (tuple, list)) and 1 <= len(grads) <= len(order):
        items = dict(zip(order, grads, strict=False))
    else:
        msg = (
            "grads: expected a mapping or named tuple of gradients, or a tuple in the order "
            f"{order}, got {type(grads).__name__}"
        )
        raise InvalidArgument(msg)
    params = items.pop("params", None)
    if params is not None:
        for field in ("wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo"):
            items.setdefault(f"d{field}", getattr(params, field, None))
    unknown = [n for n in items if n not in order]
    if unknown:
        msg = f"grads: expected names among {order}, got {unknown[0]!r}"
        raise InvalidArgument(msg)
    return {n: a for n, a in items.items() if a is not None}


def _format_of(x: Any, dtype: str | None) -> str:
    if dtype is not None:
        if dtype not in _FORMATS:
            msg = f"dtype: expected one of {tuple(_FORMATS)}, got {dtype!r}"
            raise InvalidArgument(msg)
        return _FORMATS[dtype]
    name = str(getattr(x, "dtype", "float64")).removeprefix("torch.")
    if name not in _FORMATS:
        msg = f"q: expected a float16, bfloat16, float32 or float64 array, got dtype {name}"
        raise InvalidArgument(msg)
    return _FORMATS[name]


def _dense_mask(mask: Any, is_causal: bool, target: tuple[int, ...]) -> np.ndarray | None:
    """The kernel's boolean mask (True = attend) for scores shaped ``target``."""
    if hasattr(mask, "detach"):  # a torch tensor
        mask = mask.detach().cpu().numpy()
    mask = masks.normalise(mask, target)
    if mask is None and not is_causal:
        return None
    m = np.broadcast_to(np.asarray(masks.dense(mask, target), bool), target)
    if is_causal:
        m = m & np.asarray(masks.causal().array(*target[-2:]), bool)
    return np.asarray(m)


def attention_grad_oracle(
    q: Any,
    k: Any,
    v: Any,
    d_out: Any,
    *,
    mask: Any = None,
    bias: Any = None,
    scale: float | None = None,
    is_causal: bool = False,
    kernel: BackwardKernel | str = "jax-xla",
    dtype: str | None = None,
    layout: str = "bhld",
    enable_gqa: bool = False,
    softcap: float | None = None,
    sink: Any = None,
) -> GradientOracle:
    """The certified gradients of ``<d_out, attention(q, k, v)>`` and the kernel's tolerances.

    Args:
        q, k, v: as for :func:`mhanum.testing.attention_oracle` (the kernel's inputs as it
            received them; their values are used exactly). q, k and v have the same leading
            (batch and head) dimensions, but for ``enable_gqa``'s fewer key/value heads.
        d_out: the output's cotangent, in the layout of the output.
        mask, bias, scale, is_causal, dtype, layout, enable_gqa, softcap, sink: as for
            :func:`mhanum.testing.attention_oracle`. Every query row must attend some key (the
            softmax of an empty row has no gradient). A bias broadcast over some dimensions
            gets the sum of its gradient over them, as autograd returns it; sinks likewise.
        kernel: a name in :data:`mhanum.testing.BACKWARD_KERNELS` or a
            :class:`mhanum.testing.BackwardKernel`.

    Returns:
        A :class:`GradientOracle` with ``dq``, ``dk``, ``dv`` (and ``dbias`` with a bias,
        ``dsink`` with sinks), in the layout and shapes of the inputs.

    Raises:
        InvalidArgument: for an unknown kernel, a format it does not take, a scale or a length
            its placement or accumulation is not modelled for, a row that attends no key, or
            bad inputs (named).
    """
    keywords = {"mask": mask, "bias": bias, "scale": scale, "is_causal": is_causal,
                "kernel": kernel, "dtype": dtype, "layout": layout, "enable_gqa": enable_gqa,
                "softcap": softcap, "sink": sink}  # fmt: skip
    return _attention_grad_oracle(q, k, v, d_out, keywords, certified=True)


@one_blas_thread  # its own products too, whichever thread takes them: the same bits
def _attention_grad_oracle(
    q: object, k: object, v: object, d_out: object, keywords: dict[str, Any], *, certified: bool
) -> GradientOracle:
    """:func:`attention_grad_oracle` for its ``keywords``; with ``certified=False``, its
    tolerances alone, without the certified gradients: the reference's float64 rounding,
    ``2^-52·|exact|``, is charged on Lemma O.2's bounds of ``|exact|``
    (:func:`mhanum.testing.grad_magnitudes.gradient_magnitudes`), which the oracle's ``exact``
    then holds."""
    from mhanum import reference
    from mhanum.bounds import attention_grad_bound

    mask, bias, scale, is_causal = (keywords[n] for n in ("mask", "bias", "scale", "is_causal"))
    kernel, dtype, layout = keywords["kernel"], keywords["dtype"], keywords["layout"]
    enable_gqa, softcap, sink = keywords["enable_gqa"], keywords["softcap"], keywords["sink"]
    kern = get_backward_kernel(kernel)
    fmt = _format_of(q, dtype)
    if layout not in _LAYOUTS:
        msg = f"layout: expected one of {_LAYOUTS}, got {layout!r}"
        raise InvalidArgument(msg)
    names = ("q", "k", "v", "d_out")
    q64, k64, v64, g64 = (as_float64(a, n) for a, n in zip((q, k, v, d_out), names, strict=True))
    for a, n in zip((q64, k64, v64, g64), names, strict=True):
        if a.ndim < (3 if layout == "blhd" or enable_gqa else 2):
            msg = f"{n}: expected an array of at least {3 if layout == 'blhd' else 2} dimensions"
            msg += f" for layout={layout!r}, enable_gqa={enable_gqa}, got shape {a.shape}"
            raise InvalidArgument(msg)
    if layout == "blhd":
        q64, k64, v64, g64 = (np.swapaxes(a, -3, -2) for a in (q64, k64, v64, g64))
    group = 1
    if enable_gqa:
        if kern.grouped is None:
            msg = (
                f"enable_gqa: expected False for kernel {kern.name!r} (its grouped heads are not "
                f"modelled: {kern.notes}), got True"
            )
            raise InvalidArgument(msg)
        group = _group(q64, k64, v64)
        k64, v64 = (np.repeat(a, group, axis=-3) for a in (k64, v64))
    lead = q64.shape[:-2]
    for a, n in ((k64, "k"), (v64, "v")):
        if a.shape[:-2] != lead:
            msg = f"{n}: expected the leading dimensions of q, {lead}, got {a.shape[:-2]}"
            raise InvalidArgument(msg)
    lq, lk, d = q64.shape[-2], k64.shape[-2], q64.shape[-1]
    if g64.shape != (*lead, lq, v64.shape[-1]):
        msg = f"d_out: expected the output's shape {(*lead, lq, v64.shape[-1])}, got {g64.shape}"
        raise InvalidArgument(msg)
    m = _dense_mask(mask, is_causal, (*lead, lq, lk))
    if m is not None and not m.any(axis=-1).all():
        msg = "mask: expected every query row to attend some key (an empty softmax has no gradient)"
        raise InvalidArgument(msg)
    b64 = None if bias is None else as_float64(bias, "bias")
    c = 1.0 / math.sqrt(d) if scale is None else _scale_value(scale)
    kern.check_scale(c, fmt)
    kern.check_blocks(lq, lk, fmt, grouped=group > 1)
    candidates = kern.candidates(fmt, lq)
    if kern.softmax_backward == "products" and sink is not None:
        msg = f"sink: expected None for kernel {kern.name!r} (its softmax backward is modelled "
        msg += "without sinks), got sinks"
        raise InvalidArgument(msg)
    if kern.mask_fill is not None and m is not None:
        _check_fill(q64, k64, b64, c, softcap, kern.mask_fill)

    # a gradient the kernel sums (grouped heads' dk and dv, a broadcast bias's, the sinks')
    # is charged its rounding to the output format on |Σ exact| (_summed): that needs the
    # exact values, not Lemma O.2's bounds of their magnitudes (papers/backward.md)
    summed = sink is not None or (group > 1 and kern.grouped != "one-dot")
    summed = summed or (b64 is not None and np.shape(b64) != (*lead, lq, lk))

    def exact_gradients() -> dict[str, Any]:
        if not (certified or summed):
            bounds = gradient_magnitudes(q64, k64, v64, g64, m, b64, (c, softcap), sink)
            if all(np.isfinite(b).all() for b in bounds.values()):
                return bounds
            # a bound that overflows would turn a finite tolerance infinite: take the exact ones
        exact = reference.attention_grad(
            q64, k64, v64, g64, mask=m, bias=b64, scale=scale, digits=17, softcap=softcap,
            sink=sink,
        )  # fmt: skip
        return {"dq": exact.dq, "dk": exact.dk, "dv": exact.dv, "dbias": exact.dbias,
                "dsink": exact.dsink}  # fmt: skip

    def candidate_terms(candidate: tuple[Numerics, Backward]) -> dict[str, Any]:
        num, bw = candidate
        # a negative scale split over q and k multiplies q by -sqrt(|c|): the bound of -q with
        # |c| (every rounding is symmetric, so each gradient's error is the same up to sign)
        flip = num.scale == "qk" and c < 0
        bounds = attention_grad_bound(
            -q64 if flip else q64, k64, v64, g64, m, bias=b64, scale=-c if flip else scale,
            numerics=num, backward=bw, sink=sink, softcap=softcap,
            known_rounding=False,  # (no backward descriptor's forward is measured to opt in)
        )  # fmt: skip
        terms = _candidate_terms(bounds)
        if kern.softmax_backward == "products":
            _add_products(terms, bounds, q64, k64, v64, g64, m, b64, c, softcap, num, bw)
        return terms

    # the reference and every candidate's bounds are independent: side by side on threads
    jobs: list[tuple[Numerics, Backward] | None] = [None, *candidates]
    done = map_threads(lambda job: exact_gradients() if job is None else candidate_terms(job), jobs)
    exact: dict[str, Any] = done[0]
    per: list[dict[str, Any]] = done[1:]
    exact_map = {"dq": exact["dq"], "dk": exact["dk"], "dv": exact["dv"]}
    if b64 is not None:
        exact_map["dbias"] = exact["dbias"]
    if sink is not None:
        exact_map["dsink"] = exact["dsink"]
    out_fmt = candidates[0][0].format_of("output")
    fwd = Kernel(
        kern.name,
        {fmt: tuple(n for n, _ in candidates)},
        "zero",
        kern.evidence,
        kern.notes,
    )
    oracle_cls = _oracle_class()
    oracles: dict[str, Any] = {}
    for name, ex in exact_map.items():
        ex = np.asarray(ex, np.float64)
        if name in ("dk", "dv") and group > 1 and kern.grouped == "one-dot":
            pairs = zip(per, candidates, strict=True)
            cands = [_one_dot(p[name], group, lq, num, bw, name) for p, (num, bw) in pairs]
            ex = _grouped_exact(ex, group)
            tol, term, reason = _fold(ex, cands)
            tol = tol + group * _F64 * _grouped_exact(np.abs(exact_map[name]), group)
        else:
            tol, term, reason = _fold(ex, [p[name] for p in per])
        if name in ("dk", "dv") and group > 1 and kern.grouped != "one-dot":
            target = (*lead[:-1], lead[-1] // group, group, *ex.shape[-2:])
            ex, tol, term, reason = (a.reshape(target) for a in (ex, tol, term, reason))
            ex, tol, term, reason = _summed(ex, tol, term, reason, (-3,), out_fmt)
        elif name == "dbias" and b64 is not None and np.shape(b64) != ex.shape:
            ex, tol, term, reason = _reduce_to(ex, tol, term, reason, np.shape(b64), out_fmt)
        elif name == "dsink":
            ex, tol, term, reason = _reduce_to(ex, tol, term, reason, np.shape(sink), out_fmt)
        if layout == "blhd" and name in ("dq", "dk", "dv"):
            ex, tol, term, reason = (np.swapaxes(a, -3, -2) for a in (ex, tol, term, reason))
        oracles[name] = oracle_cls(ex, tol, term, reason, fwd, fmt)
    return GradientOracle(oracles, kern, fmt)


def _scale_value(scale: Any) -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating)):
        msg = f"scale: expected a real number or None, got {type(scale).__name__}"
        raise InvalidArgument(msg)
    if not (math.isfinite(scale) and scale != 0):
        msg = f"scale: expected a finite nonzero number, got {scale!r}"
        raise InvalidArgument(msg)
    return float(scale)


def _group(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> int:
    h, h_kv = q.shape[-3], k.shape[-3]
    if v.shape[-3] != h_kv or h_kv == 0 or h % h_kv:
        msg = (
            f"k: expected a number of key/value heads dividing q's {h}, the same for k and v, "
            f"got {h_kv} and {v.shape[-3]}"
        )
        raise InvalidArgument(msg)
    return h // h_kv


def _check_fill(
    q: np.ndarray, k: np.ndarray, b: np.ndarray | None, c: float, cap: float | None, fill: float
) -> None:
    """A kernel that replaces masked logits by a finite ``fill`` (jax.nn's
    ``-0.7·finfo(float32).max``): its masked exponentials ``exp(fill - m)`` are exactly 0, as
    under ``-inf``, when the row maximum ``m`` (a live logit) is at least ``fill + 110`` (float32
    exp of anything below ``-104`` rounds to 0, within any few ulps): so when every live
    logit's magnitude, at most ``|c| Σ|q||k|`` (or the cap) plus the bias, is below
    ``|fill| - 110`` (with a relative margin for its float64 evaluation)."""
    top = abs(c) * (np.abs(q) @ np.swapaxes(np.abs(k), -1, -2)) * (1 + 1e-6)
    if cap is not None:
        top = np.minimum(top, abs(cap) * (1 + 1e-6))
    if b is not None:
        top = top + np.abs(np.where(np.isfinite(b), b, 0.0)) * (1 + 1e-6)
    limit = abs(fill) - 110
    if not (np.max(top, initial=0.0) < limit):
        msg = (
            f"q: expected logits of magnitude below {limit:.3g} with a mask (the kernel's "
            f"masking constant {fill:.3g} must leave the masked exponentials at 0), got up to "
            f"{np.max(top):.3g}"
        )
        raise InvalidArgument(msg)


def _candidate_terms(bounds: Any) -> dict[str, Any]:
    """Gradient name -> ``(total, {term: array}, reasons)`` of one candidate's bounds (a
    :class:`mhanum.bounds.GradientBounds`, or a mapping of gradient name -> bound)."""
    out: dict[str, Any] = {}
    named = bounds if isinstance(bounds, Mapping) else bounds._asdict()
    for name, b in named.items():
        if b is None or not hasattr(b, "total"):  # GradientBounds.stages
            continue
        total = np.asarray(b.total, np.float64)
        terms = {t: np.broadcast_to(np.asarray(x, np.float64), total.shape)
                 for t, x in b.terms.items()}  # fmt: skip
        out[name] = [total, terms, tuple(b.reasons)]
    return out


def _add_products(
    terms: dict[str, Any], bounds: Any, q: np.ndarray, k: np.ndarray, v: np.ndarray,
    g: np.ndarray, m: np.ndarray | None, b: np.ndarray | None, c: float, cap: float | None,
    num: Any, bw: Any,
) -> None:  # fmt: skip
    """The extra roundings of a softmax backward formed as ``P ∘ dP - P ∘ D``.

    The kernel's ``dS = fl(fl(P̂ dP̂) - fl(P̂ D̂))`` is the model's ``P̂ (dP̂ - D̂)(1 + ε)`` (its
    subtraction exact) plus ``Δ = (P̂ dP̂ ε_1 - P̂ D̂ ε_2)(1 + ε_3)``, ``|Δ| <= u(1 + u)·P̂(|dP̂|
    + |D̂|)`` with ``u`` the softmax format's unit roundoff; every dot that reads ``dS`` is
    linear, so ``Δ`` adds ``|c|(1 + u_ds)(1 + γ_n)(1 + u_acc)(1 + u_out)·|Δ| |k|`` to ``dq``
    (likewise ``dk`` with ``q``, ``dbias`` ``(1 + u_out)|Δ|``), the magnitudes from the float64
    values and the bounds' stages (``P̂ <= P + ε_P``, ``|dP̂| <= |d_out||v|ᵀ + ε_dP``, ``|D̂| <=
    Σ P |dP| + ε_D``). A soft-cap's slope (at most 1, computed within ``4u_grad``) multiplies
    ``dS`` first; with ``Backward.scale_at="ds"`` the product by ``ĉ = fl_grad(c)``, rounded in
    the gradient format, adds ``(1 + u_grad)²``.
    """
    u = num.format_of("softmax").u
    grad, dsf = bw.formats(num)
    acc, out = num.format_of("accum"), num.format_of("output")
    p_up = probabilities_upper(q, k, m, b, c, cap) + bounds.stages["P"]
    n, lq = k.shape[-2], q.shape[-2]
    dp_abs = (np.abs(g) @ np.swapaxes(np.abs(v), -1, -2)) * (1 + (v.shape[-1] + 2) * 2.0**-52)
    d_abs = (p_up * dp_abs).sum(axis=-1, keepdims=True) * (1 + (n + 2) * 2.0**-52)
    delta = u * (1 + u) * p_up * (dp_abs + bounds.stages["dP"] + d_abs + bounds.stages["D"])
    if m is not None:
        delta = np.where(m, delta, 0.0)
    if cap is not None:
        delta = delta * (1 + 4 * grad.u)

    def gamma(length: int) -> float:
        return length * acc.u / (1 - length * acc.u)

    common = (1 + dsf.u) * (1 + acc.u) * (1 + out.u) * (1 + 2.0**-50)
    if bw.scale_at == "ds":  # Δ times ĉ = fl_grad(c) (within u_grad of c), rounded in grad
        common *= (1 + grad.u) ** 2
    extra = {
        "dq": abs(c) * common * (1 + gamma(n)) * (delta @ np.abs(k)),
        "dk": abs(c) * common * (1 + gamma(lq)) * (np.swapaxes(delta, -1, -2) @ np.abs(q)),
        "dbias": (1 + dsf.u) * (1 + out.u) * delta,
    }
    for name, x in extra.items():
        if name in terms:
            total, named, reasons = terms[name]
            named = {**named, "softmax_products": x}
            terms[name] = [total + x, named, reasons]


def _fold(exact: np.ndarray, cands: list[Any]) -> tuple[np.ndarray, ...]:
    """The tolerance: the candidates' largest total, element by element, the governing term's
    name and the reason where it is infinite, plus the reference's float64 rounding."""
    tol, names, reason = fold_candidates(cands, exact.shape)
    tol = tol + _F64 * np.abs(exact) + 2.0**-1074
    return tol, names, reason


def _grouped_exact(ex: np.ndarray, group: int) -> np.ndarray:
    """``(..., H, n, d)`` summed over each group of ``group`` consecutive heads."""
    return ex.reshape(*ex.shape[:-3], ex.shape[-3] // group, group, *ex.shape[-2:]).sum(axis=-3)


def _one_dot(
    cand: list[Any], group: int, lq: int, num: Numerics, bw: Backward, name: str
) -> list[Any]:
    """A group's ``dk`` (``dv``) computed as one dot over its heads' query rows (``jax.nn``'s
    einsum over the group and the rows, in any order), from each head's bound (B.1, step 7).

    Theorem B.0's error of a dot splits into the operands' shares, sums over the contraction
    index (so over heads: additive), and the accumulation's ``f(n)·Σ|a||b| + η(n)``; the one
    dot has length ``n = group·L_q``, so its accumulation is at most ``ρ`` times the heads'
    sum, ``ρ = max(f(group·L_q)/f(L_q), η(group·L_q)/η(L_q))`` (the unit's factors, any
    order). The scale's and the output's roundings of the sum are at most the heads' sum
    (a rounding's error is monotone and subadditive in the magnitude). So the group's bound is
    ``Σ_heads (upstream + inputs + ρ·accumulation + output)``, ``inf`` where a head's is; a
    descriptor's ``softmax_products`` term (carried through the same dot, its ``γ_{L_q}``
    then ``γ_{group·L_q}``) is scaled by ``ρ`` too."""
    from mhanum.bounds.factors import operand_bits, unit_eta, unit_factor

    total, terms, reasons = cand
    first = bw.formats(num)[1] if name == "dk" else num.format_of("prob")
    bits = (operand_bits(num, first), operand_bits(num, num.format_of("input")))
    f_one = unit_factor(num, group * lq, None, bits=bits)
    f_head = unit_factor(num, lq, None, bits=bits)
    e_one, e_head = unit_eta(num, group * lq), unit_eta(num, lq)
    rho = max(f_one / f_head if f_head else 1.0, e_one / e_head if e_head else 1.0)
    rho = max(rho, 1.0) * (1 + 2.0**-50)
    grows = ("accumulation", "softmax_products")
    parts = {t: _grouped_exact(x * (rho if t in grows else 1.0), group)
             for t, x in terms.items()}  # fmt: skip
    summed = sum(parts.values()) * (1 + group * 2.0**-52)
    hit = _grouped_exact(np.where(np.isfinite(total), 0.0, 1.0), group) > 0
    return [np.where(hit, np.inf, summed), parts, reasons]


def _summed(
    ex: np.ndarray, tol: np.ndarray, term: np.ndarray, reason: np.ndarray,
    axes: tuple[int, ...], out_fmt: Any,
) -> tuple[np.ndarray, ...]:  # fmt: skip
    """The sum over ``axes`` of a gradient that the kernel adds up (a group of heads, a
    broadcast bias), and its tolerance.

    Each term's computed value is within ``tol`` of the exact one (before or after its
    rounding to the output format, which the bound charges last); the sum of ``m`` of them in
    any order in a format at least as fine as the output's is within ``γ_{m-1}·Σ(|exact| +
    tol)`` plus ``m`` underflows of the sum, then rounded to the output format:
    ``(Σ tol + γ_{m-1}Σ(|g| + tol) + m·η)(1 + u) + u|Σ g| + η``. The float64 sum of the exact
    terms adds ``m·2^-52·Σ|g|``."""
    count = math.prod(ex.shape[a] for a in axes)
    u, eta = out_fmt.u, out_fmt.smallest_normal
    gamma = (count - 1) * u / (1 - (count - 1) * u)
    total = ex.sum(axis=axes)
    mag = (np.abs(ex) + tol).sum(axis=axes)
    sum_tol = (tol.sum(axis=axes) + gamma * mag + count * eta) * (1 + u)
    sum_tol = sum_tol + u * np.abs(total) + eta + count * _F64 * np.abs(ex).sum(axis=axes)

    def last(a: np.ndarray) -> np.ndarray:
        moved = np.moveaxis(a, axes, tuple(range(-len(axes), 0)))
        return moved.reshape((*total.shape, count))

    worst = np.argmax(last(tol), axis=-1)[..., None]
    terms = np.take_along_axis(last(term), worst, axis=-1)[..., 0]
    reasons = np.take_along_axis(last(reason), worst, axis=-1)[..., 0]
    return total, sum_tol, terms, reasons


def _reduce_to(
    ex: np.ndarray, tol: np.ndarray, term: np.ndarray, reason: np.ndarray,
    shape: tuple[int, ...], out_fmt: Any,
) -> tuple[np.ndarray, ...]:  # fmt: skip
    """The gradient of an input of ``shape`` broadcast to ``ex``'s: the sum over the broadcast
    dimensions (:func:`_summed`)."""
    full = ex.shape
    if len(shape) > len(full) or np.broadcast_shapes(shape, full) != full:
        msg = f"bias: expected a shape that broadcasts to {full}, got {shape}"
        raise InvalidArgument(msg)
    pad = (1,) * (len(full) - len(shape)) + tuple(shape)
    axes = tuple(i - len(full) for i, (s, f) in enumerate(zip(pad, full, strict=True)) if s != f)
    if not axes:
        return ex.reshape(shape), tol.reshape(shape), term.reshape(shape), reason.reshape(shape)
    out = _summed(ex, tol, term, reason, axes, out_fmt)
    return tuple(a.reshape(shape) for a in out)


def mha_grad_oracle(
    x_q: Any,
    x_kv: Any,
    params: Any,
    num_heads: int,
    d_out: Any,
    *,
    mask: Any = None,
    bias: Any = None,
    scale: float | None = None,
    kernel: BackwardKernel | str = "torch-sdpa-flash-cpu",
    dtype: str | None = None,
    num_kv_heads: int | None = None,
    softcap: float | None = None,
    sink: Any = None,
) -> GradientOracle:
    """:func:`attention_grad_oracle` for a multi-head attention layer (Theorem B.6): the
    gradients with respect to the inputs and every weight and bias.

    Every candidate of the kernel's backward descriptor describes the whole layer: the
    projections and their gradients on the same dot unit and formats as the attention
    (:func:`mhanum.bounds.mha_grad_bound`; exact: :func:`mhanum.reference.mha_grad`).

    Args:
        x_q, x_kv: ``(..., Lq, d_model)``, ``(..., Lk, d_model)``.
        params: a :class:`mhanum.MHAParams` (``y = x W + b``).
        num_heads: the number of heads.
        d_out: the layer output's cotangent.
        mask, bias, scale, num_kv_heads, softcap, sink: as for
            :func:`mhanum.reference.mha_grad`; every row must attend some key in every head.
        kernel, dtype: as for :func:`attention_grad_oracle`; a descriptor whose softmax
            backward is a difference of products (``jax-xla``) is refused (that term is added
            per attention, not inside the layer's bound).

    Returns:
        A :class:`GradientOracle` with ``dx_q``, ``dx_kv``, ``dwq``, ``dwk``, ``dwv``, ``dwo``,
        the biases' ``dbq``, ... where ``params`` has them, and ``dbias``, ``dsink`` with a
        bias or sinks.

    Raises:
        InvalidArgument: as :func:`attention_grad_oracle`.
    """
    from mhanum import reference
    from mhanum.bounds import mha_grad_bound

    kern = get_backward_kernel(kernel)
    fmt = _format_of(x_q, dtype)
    if kern.softmax_backward != "fused":
        msg = (
            f"kernel: expected a backward descriptor whose softmax backward is fused for "
            f"mha_grad_oracle, got {kern.name!r} ({kern.softmax_backward!r})"
        )
        raise InvalidArgument(msg)
    xq, xkv, g64 = (as_float64(a, n) for a, n in ((x_q, "x_q"), (x_kv, "x_kv"), (d_out, "d_out")))
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        msg = f"num_heads: expected an integer >= 1, got {num_heads!r}"
        raise InvalidArgument(msg)
    width = int(np.shape(params.wq)[-1])
    if width % num_heads:
        msg = f"num_heads: expected a divisor of wq's {width} columns, got {num_heads}"
        raise InvalidArgument(msg)
    lq, lk = xq.shape[-2], xkv.shape[-2]
    d = width // num_heads
    c = 1.0 / math.sqrt(d) if scale is None else _scale_value(scale)
    kern.check_scale(c, fmt)
    grouped = num_kv_heads is not None and num_kv_heads != num_heads
    kern.check_blocks(lq, lk, fmt, grouped=grouped)
    if hasattr(mask, "detach"):
        mask = mask.detach().cpu().numpy()
    b64 = None if bias is None else as_float64(bias, "bias")
    kw: dict[str, Any] = {"mask": mask, "bias": b64, "scale": scale, "sink": sink,
                          "softcap": softcap, "num_kv_heads": num_kv_heads}  # fmt: skip
    exact = reference.mha_grad(xq, xkv, params, num_heads, g64, digits=17, **kw)
    exact_map: dict[str, Any] = {"dx_q": exact.dx_q, "dx_kv": exact.dx_kv}
    for field in ("wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo"):
        if getattr(params, field) is not None:
            exact_map[f"d{field}"] = getattr(exact.params, field)
    if b64 is not None:
        exact_map["dbias"] = exact.dbias
    if sink is not None:
        exact_map["dsink"] = exact.dsink
    per = []
    candidates = kern.on_scores(kern.candidates(fmt, lq), c)
    for num, bw in candidates:
        bounds = mha_grad_bound(xq, xkv, params, num_heads, g64, numerics=num, backward=bw, **kw)
        named = {"dx_q": bounds.dx_q, "dx_kv": bounds.dx_kv, "dbias": bounds.dbias,
                 "dsink": bounds.dsink}  # fmt: skip
        named.update({f"d{f}": b for f, b in bounds.params.items()})
        per.append(_candidate_terms(named))
    fwd = Kernel(kern.name, {fmt: tuple(n for n, _ in candidates)}, "zero", kern.evidence)
    oracle_cls = _oracle_class()
    oracles = {}
    for name, ex in exact_map.items():
        ex = np.asarray(ex, np.float64)
        tol, term, reason = _fold(ex, [p[name] for p in per])
        oracles[name] = oracle_cls(ex, tol, term, reason, fwd, fmt)
    return GradientOracle(oracles, kern, fmt)


def mha_grad_tolerance(
    x_q: Any, x_kv: Any, params: Any, num_heads: int, d_out: Any, **kwargs: Any
) -> dict[str, Any]:
    """Gradient name -> the per-element certified tolerance of a multi-head attention layer's
    backward pass (see :func:`mha_grad_oracle`)."""
    return mha_grad_oracle(x_q, x_kv, params, num_heads, d_out, **kwargs).tolerance


def assert_mha_grad_close(
    grads: Any, x_q: Any, x_kv: Any, params: Any, num_heads: int, d_out: Any, **kwargs: Any
) -> None:
    """:func:`assert_attention_grad_close` for a multi-head attention layer (see
    :func:`mha_grad_oracle`): ``grads`` a mapping with some of :data:`MHA_GRADIENTS`, or a
    :class:`mhanum.gradients.MHAGradients` (its ``params`` checked as ``dwq``, ...)."""
    oracle = mha_grad_oracle(x_q, x_kv, params, num_heads, d_out, **kwargs)
    _assert_close(oracle, grads, stacklevel=3)


def attention_grad_tolerance(q: Any, k: Any, v: Any, d_out: Any, **kwargs: Any) -> dict[str, Any]:
    """Gradient name -> the per-element certified tolerance of ``kernel``'s backward on these
    inputs (see :func:`attention_grad_oracle` for the arguments): ``|actual - exact| <=
    tolerance`` whenever the kernel computes as one of its candidates.

    It computes no certified gradients: where :func:`attention_grad_oracle` charges their
    float64 rounding as ``2^-52·|exact|``, this charges ``2^-52`` of Lemma O.2's bound of
    ``|exact|`` (:func:`mhanum.testing.grad_magnitudes.gradient_magnitudes`, from upper bounds
    of the probabilities). So it is at least ``attention_grad_oracle(...).tolerance`` and
    exceeds it by ``2^-52`` of that bound's excess over ``|exact|`` (times the group for a
    grouped kernel's sums), at the cost of the bounds alone."""
    keywords = keywords_over(_GRAD_DEFAULTS, kwargs, "attention_grad_tolerance")
    return _attention_grad_oracle(q, k, v, d_out, keywords, certified=False).tolerance


_GRAD_DEFAULTS = keyword_defaults(attention_grad_oracle)


def assert_attention_grad_close(
    grads: Any, q: Any, k: Any, v: Any, d_out: Any, **kwargs: Any
) -> None:
    """Assert that a kernel's gradients lie within their certified tolerances of the exact ones.

    Args:
        grads: the kernel's gradients: a mapping or named tuple with some of ``dq``, ``dk``,
            ``dv``, ``dbias``, ``dsink`` (``mhanum.gradients.Gradients`` is one: its entries
            that these inputs do not have, such as ``dbias`` without a bias, are skipped), or a
            tuple ``(dq, dk, dv[, dbias[, dsink]])``; ``None`` entries are not checked.
        q, k, v, d_out, **kwargs: as for :func:`attention_grad_oracle`.

    Raises:
        GradientMismatch: naming each failing gradient (worst first), how many of its elements
            fail, the worst one (index, actual, exact, tolerance, ratio) and the bound's term
            that governs its tolerance.
        InvalidArgument: for a gradient these inputs do not have, or bad inputs (named).

    Warns:
        PredictedOverflow: as :func:`mhanum.testing.assert_attention_close`, naming the gradient.
    """
    _assert_close(attention_grad_oracle(q, k, v, d_out, **kwargs), grads, stacklevel=3)
