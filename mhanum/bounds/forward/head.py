"""Theorem A.1 for one head (papers/attention.md): the stages of steps 0-7 chained, the logits
term apportioned to its sources, the target, the float64 evaluation's own error and the
output's range (R.6, step W); evaluated on chunks of query rows."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from mhanum._threads import map_threads
from mhanum.bounds._result import where_smaller
from mhanum.bounds.factors import compound, evaluation_rounding
from mhanum.bounds.forward.across_keys import across_splits, stored_split
from mhanum.bounds.forward.evaluation import on, quiet
from mhanum.bounds.forward.keys import BandRows
from mhanum.bounds.forward.known_rounding import coarser_probabilities
from mhanum.bounds.forward.logits import (
    Logits,
    Masking,
    bias_step,
    dots_step,
    fold_step,
    known_scores_step,
    logits_step,
    masking_step,
    softcap_step,
    softmax_read_step,
)
from mhanum.bounds.forward.operands import (
    Constant,
    Keys,
    Operands,
    constant_step,
    keys_step,
    operands_step,
    stored_operands,
)
from mhanum.bounds.forward.ranges import Ranges
from mhanum.bounds.forward.softmax_pv import softmax_pv
from mhanum.bounds.forward.split_kv import split_pv
from mhanum.bounds.forward.stage import (
    ALONG,
    PLAIN,
    PROJECTED,
    SOFTMAX_PROJECTED,
    STORED_DOTS,
    STORED_PARTS,
    STORED_PV,
    UNSHAPED,
    WHOLE,
    Context,
    Enclosure,
    Head,
    Setting,
    Values,
)
from mhanum.bounds.softmax import division_error
from mhanum.numerics import Numerics
from mhanum.units import Online

__all__ = [
    "CHUNK",
    "CHUNK_MAX",
    "CHUNK_ROWS",
    "SIDE_BY_SIDE",
    "HeadResult",
    "chunk_logits",
    "evaluate_head",
    "evaluate_heads",
    "evaluate_rows",
    "given_error",
    "rows_per_chunk",
]

# The chunks of query rows the float64 temporaries are evaluated on: about CHUNK logits, and at
# least CHUNK_ROWS rows while they hold at most CHUNK_MAX logits. A chunk's products stream the
# values from memory for its rows alone (the keys' side itself is taken once per head:
# keys_step), so a chunk of few rows costs more a logit: at L = 16,384, d = 128 (fp32,
# 2 threads) 16 rows a chunk took 31-36 s and 32 rows 26-28 s (docs/performance.md). CHUNK_MAX
# bounds a chunk's temporaries (about 490 bytes a logit at their peak in bf16-fp32acc: 250 MiB
# a thread), which keeps L = 32,768 within 2 GiB.
CHUNK = 2**18
CHUNK_ROWS = 64
CHUNK_MAX = 2**19
# Heads in one piece are evaluated side by side where a head holds at least SIDE_BY_SIDE logits,
# in turn below: a small head's time is the interpreter's (a thousand NumPy calls on small
# arrays, under its lock), and two threads taking turns at the lock are slower than one. Fp32,
# d = 64 unless said, medians of 15 in one process, in turn against side by side on 2 threads:
# 8 heads of 64 x 64, 13-23 ms against 26-33; 16 of 128 x 128, 55-65 against 71-98; 8 of
# 181 x 181 (d = 181), 72-94 against 66; 8 of 256 x 256 (d = 128), 236-239 against 124-134
# (docs/performance.md).
SIDE_BY_SIDE = 2**15

# the terms, the float64 output o, |o - o*|, the logits' parts, the range record
HeadResult = tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, dict[str, np.ndarray], Ranges]


def evaluate_head(head: Head, setting: Setting, keys: Keys | None = None) -> HeadResult:
    """The terms of Theorem A.1 for one head, the float64 output ``o = p v``, ``|o - o*|``, the
    logits term apportioned to the sources of the logit errors (``Bound.parts``) and the output
    entries the range checks (papers/attention.md, R) cannot prove finite.

    The float64 logits the bound is evaluated on are off the exact ones by at most ``ε64``
    (step 0); that is added to the logits' errors and, as a perturbation of the target, to the
    term ``evaluation``, as is the effect of ``head.given`` on the exact output. ``keys``: the
    keys' and values' side (:func:`keys_step`), where it is taken once for the whole head.
    """
    if keys is None:
        keys = keys_step(head, setting)
    ranges = Ranges(head.q.shape[-2], head.v.shape[-1])
    head, setting = stored_operands(head, setting, ranges, keys)
    num = setting.num
    ops = operands_step(head, num, ranges, keys)
    u_div = division_error(num.div_ulps, num.format_of("softmax").u)
    const = constant_step(setting, head.q.shape[-1], ranges)
    dots = dots_step(head, ops, num, setting.lam)
    lg, masking = _logits(
        logits_step(dots, head, setting, const, ranges), head, setting, const, ranges
    )
    live = masking.live
    lg, fold, lift_arg = fold_step(lg, live, const.u_c, num, ranges)
    across = across_splits(lg, dots, ops, const, live, head, setting)
    known = known_scores_step(lg, dots, ops, head, setting, const)
    kernel = None if known is None else (on(live, known[0], -np.inf), on(live, known[1], 0.0))
    stored = stored_split(lg, dots, ops, const, live, head, setting)
    enc = Enclosure(
        on(live, lg.s, -np.inf), on(live, lg.delta, 0.0), live, fold, across, lift_arg, kernel,
        stored,
    )  # fmt: skip
    values = keys.values
    ctx = Context(num, setting.lam, u_div, ranges, setting.known_rounding, setting.lam_entries)
    if num.kv_splits is None:
        terms, p, _, direct = softmax_pv(enc, values, ctx, keys.through, head.along)
    else:
        terms, p, _ = split_pv(enc, values, ctx, _lse_scale(num, const))
        direct = None
    whole = terms.pop(WHOLE, None)
    parts = _parts(terms, p, enc, lg.sources)
    target, p_t, o, pv_abs = _target(terms, head, enc, masking, (p, direct))
    o_error = _evaluation(terms, head, setting, (ops, lg.eps64), target, (p_t, pv_abs))
    terms = _output_range(terms, parts, ctx, (head, o, o_error, values), whole)
    return terms, o, o_error, parts, ranges


def _logits(
    lg: Logits, head: Head, setting: Setting, const: Constant, ranges: Ranges
) -> tuple[Logits, Masking]:
    """Steps 3c (the soft-cap), 3 (the bias), R.4 and 3' (a finite masking constant), in the
    kernel's order, on the scaled scores of step 3."""
    num = setting.num
    if setting.softcap is not None:
        lg = softcap_step(lg, setting.softcap, num, ranges)
    if head.bias is not None:
        lg = bias_step(lg, head.bias, num, ranges)
    lg = softmax_read_step(lg, const.folded, num, ranges)
    return masking_step(lg, head, num, ranges)


def _lse_scale(num: Numerics, const: Constant) -> float:
    """A.6, folded: a split's lse is ``fl(fl(m·ĉ) + log ℓ)`` with ``ĉ = fl(scale)``, while its
    exponents scale by ``c2 = fl(scale·log2 e)``: the two constants differ by ``u_m + u_c``
    (and float64's)."""
    u_m = num.format_of("softmax").u
    return compound(u_m, u_m, const.u_c, 2.0**-51) if const.folded else 0.0


def _parts(
    terms: dict[str, Any], p: np.ndarray, enc: Enclosure, sources: dict[str, Any]
) -> dict[str, Any]:
    """The logits term apportioned to the sources of ``δ`` by their p-weighted share in each
    row (``Bound.parts``), with the side terms the softmax stage carried out of ``terms``:
    the plain output term, A.2 (c')'s and (c'')'s projected logits and softmax terms and
    A.1g's coupled bound."""
    ev_rel = evaluation_rounding(p.shape[-1])  # float64 sums over the keys
    plain = terms.pop(PLAIN)
    projected = terms.pop(PROJECTED, None)
    soft_projected = terms.pop(SOFTMAX_PROJECTED, None)
    along_rows = terms.pop(ALONG, None)
    row_delta = (p * enc.delta).sum(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        shares = {
            name: np.where(
                row_delta > 0, (p * on(enc.live, x, 0.0)).sum(-1, keepdims=True) / row_delta, 0.0
            )
            for name, x in sources.items()
        }
    parts = {name: share * terms["logits"] * (1 + ev_rel) for name, share in shares.items()}
    parts[PLAIN] = plain * (1 + ev_rel)
    if projected is not None:
        parts[PROJECTED] = projected * (1 + ev_rel)
    if soft_projected is not None:
        parts[SOFTMAX_PROJECTED] = soft_projected * (1 + ev_rel)
    if along_rows is not None:
        parts[ALONG] = along_rows
    for name in (*STORED_PARTS, *STORED_PV, *STORED_DOTS):
        if name in terms:
            parts[name] = terms.pop(name)
    return parts


def _target(
    terms: dict[str, Any],
    head: Head,
    enc: Enclosure,
    masking: Masking,
    softmax: tuple[np.ndarray, Any],
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The target: the exact attention over the attended keys; in a row with none, the leaky
    problem itself (fill: uniform over the keys; add: the unmasked softmax). Returns it, its
    probabilities, ``o`` and ``p|v|``; the term ``mask`` (step 3') bounds the leakage of the
    keys the leaky problem attends beyond it. ``softmax``: the stage's ``p`` and direct
    ``(p v, p|v|)``."""
    keep, v = head.keep, head.v
    p, direct = softmax
    empty = ~keep.any(axis=-1, keepdims=True)
    target = np.where(empty, enc.live, keep)
    if direct is not None and head.masked is None:
        # target = keep = live: the softmax the stage evaluated, on every row
        p_t, (o, pv_abs) = p, direct
    else:
        s_t = np.where(target, enc.s, -np.inf)
        p_t = np.exp(s_t - s_t.max(axis=-1, keepdims=True))
        p_t /= p_t.sum(axis=-1, keepdims=True)
        o, pv_abs = p_t @ v, p_t @ np.abs(v)
    if masking.exclude.any():
        n = head.k.shape[-2]
        leak = np.where(masking.exclude & ~empty, p, 0.0)
        spread = np.abs(v)[None, :, :] + np.abs(o)[:, None, :]
        floor = np.where(empty, 0.0, n * 2.0**-1022 * spread.max(axis=1))
        terms["mask"] = np.einsum("ij,ijl->il", leak, spread) + floor
    return target, p_t, o, pv_abs


def _evaluation(
    terms: dict[str, Any],
    head: Head,
    setting: Setting,
    ops_eps: tuple[Operands, Any],
    target: np.ndarray,
    softmax: tuple[np.ndarray, np.ndarray],
) -> Any:
    """The float64 logits' own error ``eps64`` moves the target (Theorem S.4), as do the
    float64 operands' errors ``given`` (:func:`given_error`): the term ``evaluation``.
    Returns ``|o - o*|``; ``softmax``: the target's probabilities and ``p|v|``."""
    ops, eps64 = ops_eps
    p_t, pv_abs = softmax
    ev_rel = evaluation_rounding(head.k.shape[-2])
    big = np.max(on(target, eps64, 0.0), axis=-1, keepdims=True)
    with np.errstate(over="ignore"):
        evaluation = np.expm1(2 * big) * pv_abs
    o_error = ev_rel * pv_abs + evaluation
    given = head.given
    if given is not None:
        moved = given_error(ops.q_abs, ops.k_abs, head.v, p_t, pv_abs, target, setting.scale, given)
        evaluation = evaluation + moved
        o_error = o_error + moved
    if given is not None or setting.num.scale != "scores" or np.any(evaluation > 0):
        terms["evaluation"] = evaluation
    return o_error


def _output_range(
    terms: dict[str, Any],
    parts: dict[str, Any],
    ctx: Context,
    output: tuple[Head, np.ndarray, Any, Values],
    whole: Any,
) -> dict[str, Any]:
    """R.6: the output, ``|ô| <= |o| + the bound``, in the output format (online: and the
    softmax format it is divided in); step W's magnitudes (:func:`_at_most_magnitudes`).
    Returns the terms, rounded up for their float64 evaluation. ``output``: the head, ``o``,
    ``|o - o*|`` and the values."""
    head, o, o_error, values = output
    num, ranges = ctx.num, ctx.ranges
    ev_rel = evaluation_rounding(head.k.shape[-2])
    terms = {name: value * (1 + ev_rel) for name, value in terms.items()}
    upper = np.abs(o) + sum(terms.values())
    if whole is not None:
        upper = np.fmin(upper, whole)
    ranges.check(upper, num.format_of("output"), "the output", entries=True)
    if whole is not None:
        # |o*| <= max_j |v*_j| too: the target is a convex combination of the exact values
        if head.given is None:
            v_top = values.abs_v_max
        else:
            v_top = (values.abs_v + np.asarray(head.given[2])).max(axis=0, initial=0.0)
        o_star = np.fmin(np.abs(o) + o_error, v_top)
        terms = _at_most_magnitudes(terms, parts, whole + o_star * (1 + ev_rel))
    if isinstance(num.softmax_algorithm, Online):
        fm = num.format_of("softmax")
        ranges.check(upper, fm, "the output divided in the softmax format", entries=True)
    return terms


def _at_most_magnitudes(
    terms: dict[str, np.ndarray], parts: dict[str, Any], magnitudes: np.ndarray
) -> dict[str, np.ndarray]:
    """Step W: ``|ô - o| <= |ô| + |o|`` (``magnitudes``) replaces the terms of the entries where
    it is smaller than their sum (term ``magnitudes``). The logits' parts there are 0, and the
    rows with such an entry drop A.2 (c')'s and A.1g's coupled forms (``parts``, in place),
    which bound the logits' part of every entry of the row together."""
    kept, take = where_smaller(terms, magnitudes, "magnitudes")
    if take is None:
        return kept
    rows = take.any(axis=-1, keepdims=True)
    for name, x in parts.items():
        if name == PLAIN:
            continue
        if name in UNSHAPED:
            parts[name] = np.where(rows, np.inf, x)
        else:
            parts[name] = np.where(take, 0.0, x)
    return kept


def given_error(
    q_abs: np.ndarray,
    k_abs: np.ndarray,
    v: np.ndarray,
    p: np.ndarray,
    pv_abs: np.ndarray,
    keep: np.ndarray,
    scale: float,
    given: tuple[Any, Any, Any],
) -> np.ndarray:
    """``|p v - p* v*|`` for inputs off the exact ones by ``given`` (Theorem S.4 for ``p``);
    ``pv_abs = p |v|``.

    The logits move by at most ``|c|(g_q|k| + |q|g_k + g_q g_k)`` (each term non-negative);
    its largest entry in a row is at most ``|c| Σ_d (g_q (K + G) + |q| G)_d`` with ``K_d`` and
    ``G_d`` the largest ``|k_jd|`` and ``(g_k)_jd`` over every key (the same for every chunk of
    rows): ``O(L d)`` instead of an ``L × L × d`` product.
    """
    g_q, g_k, g_v = given
    g_k = np.broadcast_to(np.asarray(g_k, np.float64), k_abs.shape)
    k_top, g_top = k_abs.max(axis=0, initial=0.0), g_k.max(axis=0, initial=0.0)
    moved = (np.asarray(g_q) * (k_top + g_top) + q_abs * g_top).sum(axis=-1, keepdims=True)
    big = np.where(keep.any(axis=-1, keepdims=True), abs(scale) * moved, 0.0)
    return np.expm1(2 * big) * pv_abs + np.exp(2 * big) * (p @ (g_v * np.ones_like(v)))


def evaluate_rows(head: Head, setting: Setting) -> HeadResult:
    """:func:`evaluate_head`, evaluated on chunks of query rows (:func:`evaluate_heads`)."""
    return evaluate_heads([head], setting)[0]


def evaluate_heads(heads: list[Head], setting: Setting) -> list[HeadResult]:
    """:func:`evaluate_head` for every head, each evaluated on chunks of query rows.

    Every quantity of Theorem A.1 belongs to one query row (the keys and values enter each
    row alike), so the chunks' terms, outputs and range flags are those of the whole head,
    stacked; the chunks only keep the ``rows × keys`` temporaries small. The keys' and values'
    side (:func:`keys_step`, with the values' median of step 4) is taken once per head, before
    its chunks. The chunks share nothing else, so they are evaluated side by side
    (:func:`mhanum._threads.map_threads`), each as it would be alone: the result does not
    depend on the number of threads. Heads in one piece are evaluated side by side instead,
    each taking its own keys' side, where one holds at least :data:`SIDE_BY_SIDE` logits (in
    turn below).
    """
    logits = chunk_logits(setting)
    cuts = [_row_chunks(head, logits) for head in heads]
    chunk = functools.partial(_evaluate_chunk, setting=setting)
    if all(len(c) == 1 for c in cuts):
        tasks = [(h, c[0], None) for h, c in zip(heads, cuts, strict=True)]
        if max((h.q.shape[-2] * h.k.shape[-2] for h in heads), default=0) < SIDE_BY_SIDE:
            return [chunk(task) for task in tasks]
        return map_threads(chunk, tasks)
    results = []
    for head, head_cuts in zip(heads, cuts, strict=True):
        with quiet():
            keys = keys_step(head, setting)
        done = map_threads(chunk, [(head, cut, keys) for cut in head_cuts])
        results.append(_stacked_rows(done, head))
    return results


def _evaluate_chunk(task: tuple[Head, slice | None, Keys | None], setting: Setting) -> HeadResult:
    """:func:`evaluate_head` on the query rows ``cut`` of ``head`` (``None``: all of them),
    ``task = (head, cut, keys)``."""
    head, cut, keys = task
    with quiet():  # (per thread) overflow in float64 is caught by the range checks
        return evaluate_head(head if cut is None else head.rows(cut), setting, keys)


def chunk_logits(setting: Setting) -> int:
    """The logits a chunk of query rows holds (:func:`rows_per_chunk`): :data:`CHUNK`, or half
    of it where steps 6k and 6r may keep the weights' enclosures (probabilities stored in a
    coarser format than the softmax computes them in), whose temporaries reach about 420 bytes
    a logit at their peak against 240 for ``fp32`` (tracemalloc, ``L = 1024``): half keeps a
    chunk within the 64 MiB that glibc keeps for a thread (:mod:`mhanum._threads`)."""
    heavy = setting.known_rounding and coarser_probabilities(setting.num)
    return CHUNK // 2 if heavy else CHUNK


def rows_per_chunk(keys: int, logits: int = CHUNK) -> int:
    """The query rows of a chunk of a head with ``keys`` keys: about ``logits`` logits
    (:func:`chunk_logits`), and at least :data:`CHUNK_ROWS` rows while they hold at most
    :data:`CHUNK_MAX` logits.

    >>> rows_per_chunk(1024), rows_per_chunk(4096), rows_per_chunk(32768), rows_per_chunk(10**7)
    (256, 64, 16, 1)
    >>> rows_per_chunk(1024, CHUNK // 2), rows_per_chunk(8192, CHUNK // 2)
    (128, 64)
    """
    keys = max(1, keys)
    return max(1, logits // keys, min(CHUNK_ROWS, CHUNK_MAX // keys))


def _row_chunks(head: Head, logits: int) -> list[slice | None]:
    """The chunks of query rows of :func:`rows_per_chunk` (``None``: the head in one piece,
    where its mask is an array already)."""
    rows, step = head.q.shape[-2], rows_per_chunk(head.k.shape[-2], logits)
    if rows <= step:
        lazy = isinstance(head.keep, BandRows) or isinstance(head.replaced, BandRows)
        return [slice(0, rows) if lazy else None]
    return [slice(a, a + step) for a in range(0, rows, step)]


def _stacked_rows(parts: list[HeadResult], head: Head) -> HeadResult:
    """One head's result from its chunks' (in row order): terms, outputs, parts and range
    records stacked along the rows."""
    if len(parts) == 1:
        return parts[0]
    rows = head.q.shape[-2]
    ranges = Ranges(rows, head.v.shape[-1])
    for name in dict.fromkeys(n for part in parts for n in part[4].where):
        ranges.where[name] = np.concatenate(
            [part[4].where.get(name, np.zeros(part[4].shape, bool)) for part in parts]
        )
    ranges.reasons = list(dict.fromkeys(r for part in parts for r in part[4].reasons))

    shapes = [part[1].shape for part in parts]

    def stack(dicts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        names = dict.fromkeys(n for d in dicts for n in d)
        return {
            n: np.concatenate(
                [
                    d[n] if n in UNSHAPED else np.broadcast_to(d.get(n, 0.0), shape)
                    for d, shape in zip(dicts, shapes, strict=True)
                ]
            )
            for n in names
        }

    o = np.concatenate([part[1] for part in parts])
    o_error = np.concatenate([np.broadcast_to(part[2], part[1].shape) for part in parts])
    return stack([p[0] for p in parts]), o, o_error, stack([p[3] for p in parts]), ranges
