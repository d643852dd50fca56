"""Run the installed frameworks on one input, measure each, and attribute differences to causes.

:func:`compare` runs every installed framework path on the same float32 input and weights,
measures each output against the certified reference, checks it against mhanum's bound for the
path's :class:`~mhanum.Numerics` model, and reports how far the framework is from that model.

:func:`attribute` explains the difference between two layers' outputs. With ``o`` an output,
``m`` mhanum's prediction of it from its path model and the mask the framework really applied
(``M_eff``), and ``r`` references, each side's output splits exactly into

.. math::

    o - r(M) = \\underbrace{(o - m)}_{\\text{summation order}}
      + \\underbrace{(m - m_{-\\infty})}_{\\text{masking constant}}
      + \\underbrace{(m_{-\\infty} - m_{\\text{ieee}})}_{\\text{matmul precision}}
      + \\underbrace{(m_{\\text{ieee}} - r(M_{\\text{eff}}))}_{\\text{rounding}}
      + \\underbrace{(r(M_{\\text{eff}}) - r(M))}_{\\text{mask polarity}},

where ``m_{-inf}`` masks with ``-inf`` instead of the path's constant, ``m_ieee`` also drops TF32
or bfloat16 operand rounding, and ``M`` is the intended mask. The difference of two sides with the
same weights is the difference of these sums, so each cause's contribution is the difference of
its two terms. Different weights are measured first, in exact arithmetic (the two references),
and side b is then reloaded with side a's weights.
Every size is normwise: ``max|term| / max|reference|``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from mhanum import adapters
from mhanum._errors import InvalidArgument
from mhanum.adapters import _common as C
from mhanum.formats import ulp
from mhanum.metrics import Errors, errors
from mhanum.params import MHAParams

if TYPE_CHECKING:
    from types import ModuleType

    from mhanum._types import ArrayLike
    from mhanum.numerics import Numerics

__all__ = ["Attribution", "Cause", "Comparison", "Measurement", "Side", "attribute", "compare"]


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One framework path measured against the reference and its bound.

    Attributes:
        framework, path, version: what ran.
        model: the :class:`~mhanum.adapters.PathModel` of the path.
        errors: the output's :class:`~mhanum.metrics.Errors` against the reference.
        bound: the largest entry of mhanum's bound (Theorem A.2) for the path's numerics over
            the rows it bounds, or None where it bounds none (``bound_note`` says why).
        ratio: ``max |error| / bound`` over the entries of those rows (<= 1: within the bound).
        model_difference: ``max |output - mhanum's prediction|``: how well the model predicts.
        seconds: the framework's run time (first call, including tracing).
        convention_rows: the fully-masked rows (no attended key) answered by the path's
            convention (``model.fully_masked``) rather than bounded: under ``-inf`` masking there
            is no exact attention to bound them against, and where the path's answer is not the
            one the bound's numerics compute (a zero row after a finite constant) the theorem
            does not describe it. A fully-masked row whose convention is what the numerics
            compute (the mean of the values after a replaced finite constant, the unmasked
            attention after an added one) is bounded like any other row.
        follows_convention: whether every one of those rows is the convention's answer exactly
            (NaN, or the output bias for ``zero``); None without such rows, or where the
            convention (``uniform``, ``unmasked`` under ``-inf``) has no exact answer to check.
        rows_note: one line on the fully-masked rows, empty without them.
    """

    framework: str
    path: str
    version: str
    model: C.PathModel
    errors: Errors
    bound: float | None
    ratio: float | None
    bound_note: str
    model_difference: float
    seconds: float
    convention_rows: int = 0
    follows_convention: bool | None = None
    rows_note: str = ""

    @property
    def within(self) -> bool | None:
        """Whether every bounded error is within its bound and every fully-masked row answered
        by convention follows it (None without a bound)."""
        if self.ratio is None:
            return None
        return self.ratio <= 1.0 and self.follows_convention is not False

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {
            "framework": self.framework,
            "path": self.path,
            "version": self.version,
            "model": self.model.as_dict(),
            "errors": self.errors.as_dict(),
            "bound": self.bound,
            "ratio": self.ratio,
            "within": self.within,
            "bound_note": self.bound_note,
            "model_difference": self.model_difference,
            "seconds": self.seconds,
            "convention_rows": self.convention_rows,
            "follows_convention": self.follows_convention,
            "rows_note": self.rows_note,
        }


@dataclasses.dataclass(frozen=True)
class Comparison:
    """The result of :func:`compare`: one :class:`Measurement` per framework path."""

    config: dict[str, Any]
    measurements: tuple[Measurement, ...]

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {"config": self.config, "measurements": [m.as_dict() for m in self.measurements]}

    def render(self) -> str:
        """A text table."""
        c = self.config
        kv = c.get("kv_length", c["length"])
        length = f"L {c['length']}" if kv == c["length"] else f"Lq {c['length']}, Lk {kv}"
        lines = [
            (
                f"mhanum compare: {c['num_heads']} heads, d_model {c['d_model']}, "
                f"batch {c['batch']}, {length}, mask {c['mask']}, seed {c['seed']}"
            ),
            "",
            (
                f"{'framework':<10}{'path':<10}{'max abs':>10}{'normwise':>10}{'bound':>10}"
                f"{'err/bnd':>9}{'vs model':>10}  numerics"
            ),
        ]
        for m in self.measurements:
            bound = "-" if m.bound is None else f"{m.bound:.2e}"
            ratio = "-" if m.ratio is None else f"{m.ratio:.3g}"
            n = m.model.numerics
            value = n.mask_value if isinstance(n.mask_value, str) else f"{n.mask_value:.4g}"
            desc = f"scale={n.scale} mask={n.mask_mode}:{value} rows={m.model.fully_masked}"
            lines.append(
                f"{m.framework:<10}{m.path:<10}{m.errors.max_abs:>10.2e}"
                f"{m.errors.normwise_max:>10.2e}{bound:>10}{ratio:>9}"
                f"{m.model_difference:>10.2e}  {desc}"
            )
        notes = sorted({f"{m.framework}/{m.path}: {m.bound_note}" for m in self.measurements
                        if m.bound_note})  # fmt: skip
        if notes:
            lines += ["", "no bound:", *(f"  {note}" for note in notes)]
        rows = [f"  {m.framework}/{m.path}: {m.rows_note}" for m in self.measurements
                if m.rows_note]  # fmt: skip
        if rows:
            lines += ["", f"fully-masked rows ({c.get('fully_masked_rows', '?')}):", *rows]
        lines += [
            "",
            (
                "errors against the certified reference of the float32 inputs and weights; "
                "bound: Theorem A.2 for the path's numerics; vs model: "
                "max |framework - mhanum's model|."
            ),
        ]
        return "\n".join(lines)


def _paths(adapter: ModuleType) -> tuple[str, ...]:
    return tuple(adapter.PATHS)


def _model_of(adapter: ModuleType, layer: object, path: str) -> C.PathModel:
    if adapter.__name__.endswith(".model"):
        return adapter.model(path, layer=layer)
    return adapter.model(path)


@dataclasses.dataclass(frozen=True)
class _Judged:
    """What :func:`_judge` finds: the bound over the bounded rows and the convention's rows."""

    bound: float | None
    ratio: float | None
    note: str
    convention_rows: int = 0
    follows: bool | None = None
    rows_note: str = ""


def _bounded_target(numerics: Numerics) -> str | None:
    """What Theorem A.2 bounds a fully-masked row against under ``numerics``: nothing under
    ``-inf`` (no exact attention: the bound is ``inf`` there, term ``fully_masked``), the mean of
    the values when a finite constant replaces the logits (``uniform``), the unmasked attention
    when one is added to them (``unmasked``)."""
    if not math.isfinite(numerics.mask_constant()):
        return None
    return "uniform" if numerics.mask_mode == "fill" else "unmasked"


_ANSWER = {
    "nan": "NaN",
    "zero": "the output bias",
    "uniform": "the mean of the values",
    "unmasked": "the unmasked attention",
}


def _judge(
    out: np.ndarray,
    ref: np.ndarray,
    params: MHAParams,
    x_q: np.ndarray,
    x_kv: np.ndarray,
    num_heads: int,
    mask: np.ndarray | None,
    model: C.PathModel,
) -> _Judged:
    """The path's bound (Theorem A.2) row by row: fully-masked rows whose convention the bound
    does not describe are checked against the convention instead (``ref`` is the reference
    under the path's convention)."""
    from mhanum.bounds import mha_bound

    rows = C.fully_masked_rows(mask)
    dead = np.zeros(out.shape[:-1], bool) if rows is None else rows
    policy, target = model.fully_masked, _bounded_target(model.numerics)
    by_convention = dead if policy != target else np.zeros_like(dead)
    n_rows = int(by_convention.sum())
    out64 = np.asarray(out, np.float64)
    follows: bool | None = None
    rows_note = ""
    if n_rows:
        got, want = out64[by_convention], ref[by_convention]
        if policy in ("nan", "zero"):
            follows = bool(np.array_equal(got, want, equal_nan=True))
        verdict = {True: "as its convention says", False: "NOT its convention's answer",
                   None: "not checked: the convention has no exact answer"}[follows]  # fmt: skip
        why = ("no exact attention under -inf" if target is None
               else f"its numerics give {_ANSWER[target]} there")  # fmt: skip
        plural = "s" if n_rows > 1 else ""
        rows_note = f"{_ANSWER[policy]} in {n_rows} row{plural} ({verdict}); not bounded: {why}"
    elif dead.any():
        rows_note = f"{_ANSWER[policy]}, bounded by Theorem A.2 like every row"
    m4 = None if mask is None else mask[:, None]
    try:
        bound = mha_bound(
            x_q.astype(np.float64),
            x_kv.astype(np.float64),
            params,
            num_heads,
            mask=m4,
            numerics=model.numerics,
            # a framework's weights before their rounding are known to its model only to
            # within the classic steps' charges (mhanum.testing.Kernel.known_rounding)
            known_rounding=False,
        )
    except InvalidArgument as exc:
        return _Judged(None, None, str(exc), n_rows, follows, rows_note)
    bounded = ~by_convention
    if not bounded.any():
        note = "every row is fully masked and answered by the path's convention"
        return _Judged(None, None, note, n_rows, follows, rows_note)
    total = np.asarray(bound.total, np.float64)[bounded]
    got, want = out64[bounded], ref[bounded]
    with np.errstate(divide="ignore", invalid="ignore"):
        err = np.abs(got - want)
        ratio = np.where(err == 0, 0.0, err / total)
    ratio = np.where(np.isfinite(got), ratio, np.inf)  # a NaN or inf where a number is due
    return _Judged(
        float(np.max(total)),
        float(np.max(ratio, initial=0.0)),
        "",
        n_rows,
        follows,
        rows_note,
    )


def _selection(
    frameworks: str | tuple[str, ...] | None, paths: dict[str, str | tuple[str, ...]] | None
) -> tuple[tuple[str, ...], dict[str, tuple[str, ...]]]:
    """The frameworks to compare (a single name as one; default: every installed adapter but
    ``model``) and the paths chosen for them (a single path as one).

    Raises:
        InvalidArgument: for no framework, or paths chosen for a framework not compared.
    """
    if frameworks is None:
        names = tuple(n for n in adapters.available() if n != "model")
    else:
        names = (frameworks,) if isinstance(frameworks, str) else tuple(frameworks)
        if not names:
            msg = (
                "frameworks: expected at least one adapter name (or None: every one "
                "installed), got ()"
            )
            raise InvalidArgument(msg)
    chosen = {n: (p,) if isinstance(p, str) else tuple(p) for n, p in (paths or {}).items()}
    stray = [n for n in chosen if n not in names]
    if stray:
        msg = f"paths: expected keys among the frameworks compared {names}, got {stray}"
        raise InvalidArgument(msg)
    return names, chosen


def compare(
    x_q: ArrayLike,
    x_kv: ArrayLike,
    params: MHAParams,
    num_heads: int,
    *,
    mask: ArrayLike | None = None,
    frameworks: str | tuple[str, ...] | None = None,
    paths: dict[str, str | tuple[str, ...]] | None = None,
    config: dict[str, Any] | None = None,
) -> Comparison:
    """Run every installed framework path on the same input and weights, and measure each.

    The inputs and weights are rounded to float32 first (what the frameworks hold), and the
    reference is that of the rounded values, so every error is the framework's own. Each path
    is measured against the reference under its own fully-masked-row convention, and bounded
    row by row: a row that attends no key is bounded like the others where the path's answer
    is what its numerics compute (a finite constant), and otherwise checked against the
    convention (NaN, or the output bias) and reported as such (:class:`Measurement`).

    Args:
        x_q: ``(B, Lq, d_model)`` or ``(Lq, d_model)``.
        x_kv: ``(B, Lk, d_model)`` or ``(Lk, d_model)``.
        params: the weights (all four biases; ``d_q = d_kv = H*d_k = d_out``).
        num_heads: number of heads.
        mask: mhanum mask (True = attend) broadcastable to ``(B, Lq, Lk)``.
        frameworks: adapter names, or one name (default: every installed one but ``model``).
        paths: per framework compared, the paths to run, or one path (default: all of its
            paths; the torch ``fast`` path only for self-attention, ``x_kv is x_q``).
        config: extra description echoed in the result.

    Returns:
        A :class:`Comparison`.

    Raises:
        InvalidArgument: for an unknown or missing framework, no framework, paths for a
            framework not compared, or inputs that do not fit.
    """
    names, chosen = _selection(frameworks, paths)
    p32 = C.float32_params(params, num_heads)
    q = C.batched(x_q, "x_q", p32.d_q)
    kv = q if x_kv is x_q else C.batched(x_kv, "x_kv", p32.d_kv)
    m = C.mask3(mask, q.shape[0], q.shape[1], kv.shape[1])
    refs: dict[str, np.ndarray] = {}
    rows: list[Measurement] = []
    for name in names:
        adapter = adapters.get(name)
        layer = adapter.load(p32, num_heads)
        for path in chosen.get(name, _paths(adapter)):
            if name == "torch" and path == "fast" and kv is not q:
                continue
            model = _model_of(adapter, layer, path)
            if model.fully_masked not in refs:
                refs[model.fully_masked] = C.reference(p32, q, kv, num_heads, m, model.fully_masked)
            ref = refs[model.fully_masked]
            start = time.perf_counter()
            out = np.asarray(adapter.run(layer, q, kv, m, path=path))
            seconds = time.perf_counter() - start
            pred = C.predict(model, p32, q, kv, num_heads, m)
            judged = _judge(out, ref, p32, q, kv, num_heads, m, model)
            rows.append(
                Measurement(
                    name,
                    path,
                    adapter.version(),
                    model,
                    errors(out, ref, fmt="float32"),
                    judged.bound,
                    judged.ratio,
                    judged.note,
                    _max_difference(out, pred),
                    seconds,
                    judged.convention_rows,
                    judged.follows,
                    judged.rows_note,
                )
            )
    base = {
        "num_heads": num_heads,
        "d_model": p32.d_q,
        "batch": q.shape[0],
        "length": q.shape[1],
        "kv_length": kv.shape[1],
        "mask": "none" if m is None else f"{int(m.sum())}/{m.size} attended",
        "seed": None,
    }
    dead = C.fully_masked_rows(m)
    if dead is not None and dead.any():
        base["fully_masked_rows"] = f"{int(dead.sum())} of {dead.size} rows attend no key"
    return Comparison(base | (config or {}), tuple(rows))


def _max_difference(a: np.ndarray, b: np.ndarray) -> float:
    """``max |a - b|`` where both are finite; ``inf`` where exactly one is not."""
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    fa, fb = np.isfinite(a64), np.isfinite(b64)
    if np.any(fa != fb):
        return math.inf
    both = fa & fb
    return float(np.max(np.abs(a64 - b64)[both], initial=0.0))


# Attribution ----------------------------------------------------------------------------------

CAUSES = (
    "weights",
    "mask polarity",
    "masking constant",
    "fully-masked rows",
    "matmul precision",
    "summation order",
    "rounding",
)


@dataclasses.dataclass(frozen=True)
class Side:
    """One of the two layers whose outputs :func:`attribute` compares.

    Attributes:
        framework: adapter name (``torch``, ``keras``, ``flax``, ``jax``, ``model``).
        layer: the framework layer (built by the user, or by the adapter's ``load``).
        path: the code path it runs (default: the adapter's first).
        raw_mask: the mask exactly as the user passes it to the framework (its convention);
            None: the intended mask, translated correctly by the adapter.
    """

    framework: str
    layer: Any
    path: str | None = None
    raw_mask: Any = None


@dataclasses.dataclass(frozen=True)
class Cause:
    """One cause of the difference, with its normwise size and each side's share."""

    name: str
    size: float
    side_a: float
    side_b: float
    detail: str

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Attribution:
    """The result of :func:`attribute`: the difference and its causes, largest first.

    Attributes:
        difference: normwise ``max|o_a - o_b| / max|reference|`` of the outputs as given.
        causes: one :class:`Cause` per source, sorted by size.
        errors_a, errors_b: each side's normwise error against the reference of the intended
            mask, with side a's weights, each under its own side's fully-masked-row convention
            (so a fully-masked row that a side answers with NaN, as its convention says, is no
            error of that side, whatever the other side answers).
    """

    difference: float
    causes: tuple[Cause, ...]
    errors_a: float
    errors_b: float
    sides: tuple[str, str]

    def dominant(self) -> Cause:
        """The largest cause."""
        return self.causes[0]

    def __getitem__(self, name: str) -> Cause:
        for cause in self.causes:
            if cause.name == name:
                return cause
        msg = f"name: expected one of {CAUSES}, got {name!r}"
        raise InvalidArgument(msg)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {
            "sides": list(self.sides),
            "difference": self.difference,
            "errors_a": self.errors_a,
            "errors_b": self.errors_b,
            "causes": [c.as_dict() for c in self.causes],
        }

    def render(self) -> str:
        """A text report."""
        a, b = self.sides
        lines = [
            (
                f"difference between a = {a} and b = {b}: {self.difference:.3g} "
                "(normwise, max|a - b| / max|reference|)"
            ),
            (
                "with a's weights, error against the reference (each side under its own "
                f"fully-masked-row convention): a {self.errors_a:.3g}, b {self.errors_b:.3g}"
            ),
            "",
            f"{'cause':<19}{'size':>10}{'a':>10}{'b':>10}  detail",
        ]
        for c in self.causes:
            lines.append(
                f"{c.name:<19}{c.size:>10.3g}{c.side_a:>10.3g}{c.side_b:>10.3g}  {c.detail}"
            )
        return "\n".join(lines)


@dataclasses.dataclass
class _Terms:
    """One side's exact split of ``output - reference(intended mask)`` (module docstring)."""

    out: np.ndarray
    terms: dict[str, np.ndarray]
    detail: dict[str, str]


def _weights_detail(pa: MHAParams, pb: MHAParams) -> tuple[float, str]:
    diffs = {}
    for f in dataclasses.fields(pa):
        wa, wb = getattr(pa, f.name), getattr(pb, f.name)
        if (wa is None) != (wb is None) or np.shape(wa) != np.shape(wb):
            return math.inf, f"{f.name}: shapes differ"
        if wa is not None:
            diffs[f.name] = float(np.max(np.abs(np.asarray(wa, np.float64) - wb)))
    worst = max(diffs, key=lambda k: diffs[k])
    return diffs[worst], f"largest weight difference {diffs[worst]:.3g} (in {worst})"


def _reload(side: Side, adapter: ModuleType, params: MHAParams, num_heads: int) -> object:
    if adapter.__name__.endswith(".model"):
        return adapter.load(
            params, num_heads, numerics=side.layer.numerics, fully_masked=side.layer.fully_masked
        )
    return adapter.load(params, num_heads)


def _run(
    side: Side,
    adapter: ModuleType,
    layer: object,
    q: np.ndarray,
    kv: np.ndarray,
    mask: ArrayLike | None,
    path: str,
) -> np.ndarray:
    if side.raw_mask is not None:
        return np.asarray(adapter.run(layer, q, kv, path=path, raw_mask=side.raw_mask))
    return np.asarray(adapter.run(layer, q, kv, mask, path=path))


def _diff(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a - b`` with NaN - NaN = 0 (an undefined row agrees with itself), NaN - x = inf."""
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    both_nan = np.isnan(a64) & np.isnan(b64)
    one_nan = np.isnan(a64) ^ np.isnan(b64)
    with np.errstate(invalid="ignore"):
        d = np.where(both_nan, 0.0, a64 - b64)
    return np.where(one_nan, np.inf, d)


def _size(term: np.ndarray, scale: float) -> float:
    return float(np.max(np.abs(term), initial=0.0)) / scale


def _constant_detail(num: Numerics) -> str:
    """The masking constant as stored, how it is applied, and its absorption when added."""
    c = num.mask_constant()
    fmt = num.format_of("score")
    spacing = float(ulp(np.float64(c), fmt)) if math.isfinite(c) else math.inf
    how = "added to" if num.mask_mode == "add" else "replacing"
    text = f"{c:.4g} {how} masked {fmt.name} logits (ulp {spacing:.3g})"
    if num.mask_mode == "add" and math.isfinite(c) and spacing > 2.0**-8:
        text += f": s + ({c:.3g}) keeps s only to a multiple of {spacing:.3g}"
    return text


def _side_terms(
    side: Side,
    adapter: ModuleType,
    layer: object,
    path: str,
    p32: MHAParams,
    q: np.ndarray,
    kv: np.ndarray,
    num_heads: int,
    intended: np.ndarray | None,
    ref_intended: np.ndarray,
) -> _Terms:
    """Split ``output - reference(intended)`` of one side into its causes (module docstring)."""
    model = _model_of(adapter, layer, path)
    num = model.numerics
    shape = (q.shape[0], q.shape[1], kv.shape[1])
    eff = intended
    if side.raw_mask is not None:
        eff = np.broadcast_to(adapter.effective_mask(side.raw_mask, path), shape).copy()
    out = _run(side, adapter, layer, q, kv, intended, path)
    pred = C.predict(model, p32, q, kv, num_heads, eff)
    detail: dict[str, str] = {}

    rows = C.fully_masked_rows(eff)
    ideal_mask = eff
    if eff is not None and model.fully_masked == "unmasked" and rows is not None:
        ideal_mask = np.where(rows[..., None], True, eff)
    constant_free = num.mask_value == -math.inf  # s + (-inf) is -inf: fill and add agree
    ideal_num = num
    still = None
    if eff is None or constant_free or eff.all():
        pred_ideal = pred
    else:
        ideal_num = num.replace(mask_mode="fill", mask_value=-math.inf)
        pred_ideal = C.predict(
            dataclasses.replace(model, numerics=ideal_num), p32, q, kv, num_heads, ideal_mask
        )
        still = C.fully_masked_rows(ideal_mask)
        if still is not None and still.any():
            pred_ideal[still] = pred[still]  # the row's semantics are the path's own, not a cause
        detail["masking constant"] = _constant_detail(num)
    if num.operand_rounding is None and num.dot_kind == "ieee":
        pred_ieee = pred_ideal
    else:
        plain = {"operand_format": None, "dot": "ieee"}
        pred_ieee = C.predict(
            dataclasses.replace(model, numerics=ideal_num.replace(**plain)),
            p32, q, kv, num_heads, ideal_mask,
        )  # fmt: skip
        if still is not None and still.any():
            own_rows = dataclasses.replace(model, numerics=num.replace(**plain))
            pred_ieee[still] = C.predict(own_rows, p32, q, kv, num_heads, eff)[still]
        detail["matmul precision"] = f"dot={num.dot}, operands rounded to " + (
            num.operand_rounding.name if num.operand_rounding is not None else "bf16 pieces"
        )
    policy = model.fully_masked
    ref_eff = C.reference(p32, q, kv, num_heads, eff, policy)
    base = intended if intended is not None else np.ones(shape, bool)
    if eff is not None and not np.array_equal(eff, base):
        flipped = int(np.sum(eff != base))
        inverted = bool(np.array_equal(eff, ~base))
        detail["mask polarity"] = (
            f"the framework attends differently from the intended mask at {flipped} of "
            f"{eff.size} (query, key) pairs" + (" (inverted)" if inverted else "")
        )
    polarity = _diff(ref_eff, ref_intended)
    if "mask polarity" in detail and not np.any(polarity):
        detail["mask polarity"] += ", without effect in exact arithmetic (a constant added to "
        detail["mask polarity"] += "every logit of a row cancels in the softmax)"
    terms = {
        "summation order": _diff(out, pred),
        "masking constant": _diff(pred, pred_ideal),
        "matmul precision": _diff(pred_ideal, pred_ieee),
        "rounding": _diff(pred_ieee, ref_eff),
        "mask polarity": polarity,
    }
    return _Terms(out, terms, detail)


def attribute(
    a: Side,
    b: Side,
    x_q: ArrayLike,
    x_kv: ArrayLike,
    num_heads: int,
    *,
    mask: ArrayLike | None = None,
) -> Attribution:
    """Attribute the difference between two layers' outputs to its causes, each quantified.

    Args:
        a, b: the two sides (:class:`Side`): framework, layer, path and, if the user passes the
            framework its own mask, that raw mask.
        x_q, x_kv: the inputs, ``(B, L, d_model)`` or ``(L, d_model)`` (rounded to float32).
        num_heads: the layers' number of heads.
        mask: the intended mhanum mask (True = attend), broadcastable to ``(B, Lq, Lk)``.

    Returns:
        An :class:`Attribution` with one :class:`Cause` per source in :data:`CAUSES`, sizes
        normwise relative to ``max|reference|``: ``weights`` (the difference the two sets of
        weights make in exact arithmetic: b's reference with b's weights minus with a's; side b
        is then reloaded with a's weights); then, with a's weights on both sides,
        ``mask polarity``,
        ``masking constant`` (absorption and leakage of the constant the path uses),
        ``fully-masked rows`` (the sides' different answers for a row with no key),
        ``matmul precision`` (TF32/bf16 operands), ``summation order`` (framework vs mhanum's
        model of it: order of sums and the framework's own roundings) and ``rounding``
        (mhanum's model vs the reference).

    Raises:
        InvalidArgument: for an unknown or missing framework, no framework, paths for a
            framework not compared, or inputs that do not fit.
    """
    ad_a, ad_b = adapters.get(a.framework), adapters.get(b.framework)
    path_a = a.path or _paths(ad_a)[0]
    path_b = b.path or _paths(ad_b)[0]
    params_a, params_b = ad_a.extract(a.layer), ad_b.extract(b.layer)
    p32 = C.float32_params(params_a, num_heads)
    q = C.batched(x_q, "x_q", p32.d_q)
    kv = q if x_kv is x_q else C.batched(x_kv, "x_kv", p32.d_kv)
    intended = C.mask3(mask, q.shape[0], q.shape[1], kv.shape[1])

    out_a = _run(a, ad_a, a.layer, q, kv, intended, path_a)
    out_b_given = _run(b, ad_b, b.layer, q, kv, intended, path_b)
    w_max, w_detail = _weights_detail(C.float32_params(params_a, num_heads),
                                      C.float32_params(params_b, num_heads))  # fmt: skip
    layer_b = b.layer if w_max == 0 else _reload(b, ad_b, p32, num_heads)

    ref_a = C.reference(
        p32, q, kv, num_heads, intended, _model_of(ad_a, a.layer, path_a).fully_masked
    )
    policy_b = _model_of(ad_b, layer_b, path_b).fully_masked
    ref_b = C.reference(p32, q, kv, num_heads, intended, policy_b)
    finite = np.abs(ref_a[np.isfinite(ref_a)])
    scale = float(np.max(finite, initial=0.0)) or 1.0

    ta = _side_terms(a, ad_a, a.layer, path_a, p32, q, kv, num_heads, intended, ref_a)
    tb = _side_terms(b, ad_b, layer_b, path_b, p32, q, kv, num_heads, intended, ref_b)
    if w_max == 0:
        weights_term = np.zeros_like(ref_b)
    else:
        # What the weights change in exact arithmetic: b's reference with b's own weights.
        own = C.float32_params(params_b, num_heads)
        weights_term = _diff(C.reference(own, q, kv, num_heads, intended, policy_b), ref_b)
    causes = [
        Cause(
            "weights",
            _size(weights_term, scale),
            0.0,
            _size(weights_term, scale),
            w_detail if w_max else "identical weights",
        ),
        Cause(
            "fully-masked rows",
            _size(_diff(ref_a, ref_b), scale),
            0.0,
            0.0,
            f"a: {_model_of(ad_a, a.layer, path_a).fully_masked}, "
            f"b: {_model_of(ad_b, layer_b, path_b).fully_masked}",
        ),
    ]
    for name in ("mask polarity", "masking constant", "matmul precision", "summation order",
                 "rounding"):  # fmt: skip
        details = [f"{s}: {t.detail[name]}" for s, t in (("a", ta), ("b", tb)) if name in t.detail]
        causes.append(
            Cause(
                name,
                _size(_diff(ta.terms[name], tb.terms[name]), scale),
                _size(ta.terms[name], scale),
                _size(tb.terms[name], scale),
                "; ".join(details),
            )
        )
    causes.sort(key=lambda c: -c.size)
    return Attribution(
        _size(_diff(out_a, out_b_given), scale),
        tuple(causes),
        _size(_diff(ta.out, ref_a), scale),
        _size(_diff(tb.out, ref_b), scale),  # each side under its own fully-masked convention
        (f"{a.framework}/{path_a}", f"{b.framework}/{path_b}"),
    )
