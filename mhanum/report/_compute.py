"""Every number of a report, as plain JSON-ready data (no figures, no formatting).

Each section is one function returning a dict; :func:`compute` calls them in order and reports
progress. Inputs come from :func:`mhanum.devices.inputs` (numpy ``PCG64``, never the JAX RNG), so
the same config gives the same numbers on any machine.
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mhanum import bounds, devices, masks, metrics, parallel, reference
from mhanum._errors import InvalidArgument
from mhanum.bounds import heads as heads_bounds
from mhanum.emulate.attention import attention, multi_head_attention
from mhanum.emulate.backward import attention_grad
from mhanum.formats import get_format
from mhanum.numerics import Backward, Numerics
from mhanum.params import MHAParams
from mhanum.report._config import Config

__all__ = ["CASE_FIELDS", "Progress", "compute", "read_cases"]

Progress = Callable[[int, int, str], None]
"""``progress(done, total, what)``, called after each step."""


CASE_FIELDS = (
    "mhanum_version",
    "numerics",
    "preset",
    "shape",
    "seed",
    "objective",
    "error",
    "bound",
    "ratio",
    "dominant_term",
    "created",
)
"""The fields of a saved worst case (``mhanum.search``)."""


def _a_priori_function(name: str) -> Callable[..., Any] | None:
    """``mhanum.bounds.<name>`` (Theorem A.4) when this mhanum has it: the report plots the
    a-priori series only then, and says so otherwise."""
    fn = getattr(bounds, name, None)
    return fn if callable(fn) else None


def _per_sample_max(x: np.ndarray, samples: int) -> np.ndarray:
    return np.asarray(x, np.float64).reshape(samples, -1).max(axis=1)


def _median(x: Iterable[float]) -> float:
    return float(np.median(np.fromiter(x, np.float64)))


def _attention_point(
    config: Config, length: int, mask_kind: str
) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], np.ndarray | None, np.ndarray]:
    shape = (1, config.samples, length, config.d_k)
    q, k, v = devices.inputs(shape, "float32", config.structure, config.seed)
    mask = devices.mask_array(mask_kind, length)
    ref = np.asarray(reference.attention(q, k, v, mask=mask), np.float64)
    return (q, k, v), mask, ref


def _min_keys(mask: np.ndarray | None, length: int) -> int:
    return length if mask is None else int(mask.sum(axis=-1).min())


def _a_priori(
    fn: Callable[..., Any] | None,
    qkv: Sequence[np.ndarray],
    mask: np.ndarray | None,
    num: Numerics,
    n: int,
) -> list[float] | None:
    """Per-sample a-priori bounds (Theorem A.4, max over entries) from each sample's sizes and
    norms only: the largest row norms of q and k, the largest |v|, the fewest attended keys."""
    if fn is None:
        return None
    q, k, v = (np.asarray(x, np.float64)[0] for x in qkv)
    length, d_k, d_v = k.shape[-2], q.shape[-1], v.shape[-1]
    up = 1 + 2.0**-40  # a float64 norm may fall below the exact one by a few ulps: round it up
    values = []
    for i in range(n):
        b = fn(
            q.shape[-2],
            length,
            d_k,
            d_v,
            q_norm=float(np.linalg.norm(q[i], axis=-1).max()) * up,
            k_norm=float(np.linalg.norm(k[i], axis=-1).max()) * up,
            v_max=float(np.abs(v[i]).max()),
            numerics=num,
            min_keys=_min_keys(mask, length),
        )
        values.append(float(np.max(b.total)))
    return values


def _note(text: str, notes: list[str]) -> None:
    if text not in notes:
        notes.append(text)


def _attention_bounds(
    qkv: Sequence[np.ndarray],
    mask: np.ndarray | None,
    num: Numerics,
    err: np.ndarray,
    config: Config,
    fn: Callable[..., Any] | None,
    refusals: list[str],
    prior_notes: list[str],
) -> dict[str, Any]:
    """The bounds of one grid point; ``None`` where a theorem refuses the point.

    The reasons go to ``refusals`` (A.1, A.3) and ``prior_notes`` (the a-priori bound), once each.
    """
    q, k, v = qkv
    n = config.samples
    out: dict[str, Any] = {
        "bound_a_posteriori": None,
        "bound_reasons": [],
        "bound_probabilistic": None,
        "probabilistic_lam": None,
        "probabilistic_probability": None,
        "ratio": None,
        "dominant_term": None,
        "terms_at_max": {},
        "terms_max": {},
    }
    try:
        post = bounds.attention_bound(q, k, v, mask, numerics=num)
    except InvalidArgument as exc:
        _note(str(exc), refusals)
    else:
        total = np.asarray(post.total, np.float64)
        at = np.unravel_index(int(np.argmax(total)), total.shape)
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(err == 0, 0.0, err / total)
        for reason in post.reasons:  # where A.1 is infinite, and why (papers/attention.md, R)
            _note(f"A.1 is inf where {reason}", refusals)
        out |= {
            "bound_reasons": list(post.reasons),
            "bound_a_posteriori": [float(x) for x in _per_sample_max(total, n)],
            "ratio": [float(x) for x in _per_sample_max(ratio, n)],
            "dominant_term": post.dominant(),
            "terms_at_max": {
                name: float(np.asarray(t, np.float64)[at]) for name, t in post.terms.items()
            },
            "terms_max": {name: float(np.max(t)) for name, t in post.terms.items()},
            # the logits term split into the sources of the logit errors (Bound.parts)
            "logits_parts_at_max": {
                src: float(np.asarray(t, np.float64)[at])
                for src, t in post.parts.get("logits", {}).items()
            },
        }
    try:
        prob = bounds.attention_bound(q, k, v, mask, numerics=num, probability=config.probability)
    except InvalidArgument as exc:
        _note(str(exc), refusals)
    else:
        out["bound_probabilistic"] = [float(x) for x in _per_sample_max(prob.total, n)]
        out["probabilistic_probability"] = prob.probability
        out["probabilistic_lam"] = prob.lam
    prior = None
    try:
        prior = _a_priori(fn, qkv, mask, num, n)
    except InvalidArgument as exc:
        _note(str(exc), prior_notes)
    return out | {"bound_a_priori": prior}


A_PRIORI = "attention_bound_a_priori"


def attention_cell(config: Config, mask_kind: str, length: int) -> dict[str, Any]:
    """The attention grid at one length and mask: every preset's point, and the reasons a
    theorem refused (``refusals``) or the a-priori bound was not evaluated (``prior_notes``)."""
    fn = _a_priori_function(A_PRIORI)
    points: list[dict[str, Any]] = []
    refusals: list[str] = []
    prior_notes: list[str] = []
    qkv, mask, ref = _attention_point(config, length, mask_kind)
    n = config.samples
    for preset in config.presets:
        num = Numerics.preset(preset)
        out = np.asarray(attention(*qkv, mask, numerics=num), np.float64)
        err = np.abs(out - ref)
        fmt = num.format_of("output")
        per_err = _per_sample_max(err, n)
        normwise = [metrics.errors(out[0, i], ref[0, i], fmt=fmt).normwise_max for i in range(n)]
        point: dict[str, Any] = {
            "preset": preset,
            "format": num.format_of("input").name,
            "output_format": fmt.name,
            "u": fmt.u,
            "length": length,
            "d_k": config.d_k,
            "mask": mask_kind,
            "error_max_abs": [float(x) for x in per_err],
            "error_normwise": [float(x) for x in normwise],
            "error_median": _median(per_err),
            "error_worst": float(per_err.max()),
        }
        point |= _attention_bounds(qkv, mask, num, err, config, fn, refusals, prior_notes)
        points.append(point)
    return {"points": points, "refusals": refusals, "prior_notes": prior_notes}


def attention_section(cells: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The ``attention`` section from its cells, in grid order (each note once)."""
    refusals: list[str] = []
    prior_notes: list[str] = []
    for cell in cells:
        for text in cell["refusals"]:
            _note(text, refusals)
        for text in cell["prior_notes"]:
            _note(text, prior_notes)
    return {
        "theorems": {"a_posteriori": "A.1", "probabilistic": "A.3", "a_priori": "A.4"},
        "a_priori": A_PRIORI if _a_priori_function(A_PRIORI) is not None else None,
        "a_priori_notes": prior_notes,
        "refusals": refusals,
        "points": [p for cell in cells for p in cell["points"]],
    }


def attention_grid(config: Config, step: Callable[[str], None]) -> dict[str, Any]:
    """Measured error, a-posteriori (A.1), probabilistic (A.3) and a-priori bounds per point."""
    cells = []
    for mask_kind in config.masks:
        for length in config.lengths:
            cells.append(attention_cell(config, mask_kind, length))
            step(f"attention L={length} mask={mask_kind}")
    return attention_section(cells)


def heads_cell(config: Config, h: int) -> dict[str, Any]:
    """One head count ``h`` at the fixed ``d_model``: the row of :func:`head_partitioning`,
    and the reasons a bound refused (``refusals``)."""
    hc = config.heads
    rng = np.random.Generator(np.random.PCG64(config.seed))
    x = rng.standard_normal((hc.length, hc.d_model)).astype(np.float32)
    params = MHAParams.random(hc.d_model, seed=config.seed)
    x_max = float(np.abs(x).max())
    prior = _a_priori_function("mha_bound_a_priori")
    refusals: list[str] = []
    ref = np.asarray(reference.multi_head_attention(x, x, params, h), np.float64)
    d_k = hc.d_model // h
    row: dict[str, Any] = {"num_heads": h, "d_k": d_k, "presets": {}}
    if h != 1:
        diff = heads_bounds.head_partition_difference(x, params, h, 1)
        row["difference_to_one_head"] = {
            "normwise_max": diff.normwise_max,
            "max_abs": diff.max_abs,
            "explanation": diff.explanation,
        }
    row["scale_exactness"] = {
        f"{fmt}/{placement}": {
            "exact": s.exact,
            "relative_error": s.relative_error,
        }
        for fmt in ("float32", "bfloat16", "float16")
        for placement in ("scores", "qk")
        for s in (heads_bounds.scale_exactness(d_k, fmt, placement),)
    }
    for preset in config.presets:
        num = Numerics.preset(preset)
        y = np.asarray(multi_head_attention(x, x, params, h, numerics=num), np.float64)
        err = np.abs(y - ref)
        entry: dict[str, Any] = {
            "error_max_abs": float(err.max()),
            "error_normwise": metrics.errors(y, ref, fmt=num.format_of("output")).normwise_max,
            "bound_max": None,
            "ratio": None,
        }
        try:
            bound = np.asarray(bounds.mha_bound(x, x, params, h, numerics=num).total)
        except InvalidArgument as exc:
            _note(str(exc), refusals)
        else:
            with np.errstate(divide="ignore", invalid="ignore"):
                ratio = float(np.max(np.where(err == 0, 0.0, err / bound)))
            entry |= {"bound_max": float(bound.max()), "ratio": ratio}
        entry["bound_a_priori"] = None
        if prior is not None:
            try:
                b = prior(params, h, hc.length, hc.length, x_max=x_max, numerics=num)
            except InvalidArgument as exc:
                _note(str(exc), refusals)
            else:
                entry["bound_a_priori"] = float(np.max(b.total))
        accum = num.format_of("accum")
        for name, factor in (
            ("score_dot_factor", functools.partial(heads_bounds.score_dot_factor, hc.d_model, h)),
            (
                "output_projection_factor",
                functools.partial(heads_bounds.output_projection_factor, h, d_k),
            ),
        ):
            try:
                entry[name] = factor(accum).as_dict()
            except InvalidArgument as exc:
                entry[name] = None
                _note(str(exc), refusals)
        row["presets"][preset] = entry
    return {"row": row, "refusals": refusals}


def heads_section(config: Config, cells: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The ``heads`` section from its cells, in the order of ``heads.num_heads``."""
    refusals: list[str] = []
    for cell in cells:
        for text in cell["refusals"]:
            _note(text, refusals)
    hc = config.heads
    rows = [cell["row"] for cell in cells]
    return {"d_model": hc.d_model, "length": hc.length, "rows": rows, "refusals": refusals}


def head_partitioning(config: Config, step: Callable[[str], None]) -> dict[str, Any]:
    """h heads at a fixed ``d_model``: errors and bounds (A.2, and A.4 from ``max |x|`` when
    mhanum has it), the difference to one head, dot-length factors (H.1), output projection
    factors (H.3) and scale exactness (H.2)."""
    cells = []
    for h in config.heads.num_heads:
        cells.append(heads_cell(config, h))
        step(f"heads h={h}")
    return heads_section(config, cells)


def _variant_cases(config: Config) -> list[tuple[str, dict[str, Any], bool, dict[str, Any]]]:
    """``(label, keyword arguments, grouped, numerics changes)`` of each variant, on the same
    inputs."""
    c = config.variants
    causal = masks.causal()
    return [
        ("causal", {"mask": causal}, False, {}),
        (f"sliding window of {c.window}", {"mask": masks.sliding_window(c.window)}, False, {}),
        (
            "ALiBi, causal",
            {"mask": causal, "bias": masks.alibi(c.heads, c.length, c.length)},
            False,
            {},
        ),
        (
            f"sinks (σ = {c.sink:g}), causal",
            {"mask": causal, "sink": np.full(c.heads, c.sink)},
            False,
            {},
        ),
        (f"GQA {c.heads}/{c.kv_heads} heads, causal", {"mask": causal}, True, {}),
        (
            f"soft-capped (c = {c.softcap:g}), causal",
            {"mask": causal, "softcap": c.softcap},
            False,
            {},
        ),
        (
            f"split-KV ({c.kv_splits} splits), causal",
            {"mask": causal},
            False,
            {"kv_splits": c.kv_splits},
        ),
    ]


def _variant_inputs(config: Config) -> tuple[np.ndarray, ...]:
    """q, k, v of the variants, and k, v repeated over the query groups (GQA)."""
    c = config.variants
    shape = (c.heads, c.length, config.d_k)
    q, k, v = devices.inputs((1, *shape), "float32", config.structure, config.seed)
    q, k, v = q[0], k[0], v[0]
    group = c.heads // c.kv_heads
    k_g, v_g = (np.repeat(x[: c.kv_heads], group, axis=0) for x in (k, v))
    return q, k, v, k_g, v_g


def variant_cell(config: Config, index: int) -> dict[str, Any]:
    """The rows of one variant (``_variant_cases(config)[index]``), one per preset."""
    q, k, v, k_g, v_g = _variant_inputs(config)
    label, kwargs, grouped, changes = _variant_cases(config)[index]
    kk, vv = (k_g, v_g) if grouped else (k, v)
    exact = np.asarray(reference.attention(q, kk, vv, **kwargs), np.float64)
    mask = kwargs.get("mask")
    rest = {n: x for n, x in kwargs.items() if n != "mask"}
    rows: list[dict[str, Any]] = []
    for preset in config.presets:
        num = Numerics.preset(preset)
        if changes and num.exp_form == "exp":
            num = num.replace(**changes)
        out = np.asarray(attention(q, kk, vv, mask, numerics=num, **rest), np.float64)
        bound = bounds.attention_bound(q, kk, vv, mask, numerics=num, **rest)
        total = np.asarray(bound.total, np.float64)
        err = np.abs(out - exact)
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(err == 0, 0.0, err / total)
        rows.append(
            {
                "variant": label,
                "preset": preset,
                "error_max": float(err.max()),
                "bound_median": float(np.median(total)),
                "bound_max": float(total.max()),
                "ratio_max": float(ratio.max()),
                "dominant_term": bound.dominant(),
                "theorem": bound.theorem,
                "reasons": list(bound.reasons),
            }
        )
    return {"rows": rows}


def variants_section(config: Config, cells: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The ``variants`` section from its cells, in the order of the variants."""
    c = config.variants
    return {
        "theorem": "A.1",
        "length": c.length,
        "heads": c.heads,
        "kv_heads": c.kv_heads,
        "d_k": config.d_k,
        "rows": [row for cell in cells for row in cell["rows"]],
    }


def variants(config: Config, step: Callable[[str], None]) -> dict[str, Any]:
    """Today's attention variants (papers/attention.md, the variants reduced to A.1): error
    against the certified reference and Theorem A.1 per preset."""
    cells = []
    for index, (label, *_) in enumerate(_variant_cases(config)):
        cells.append(variant_cell(config, index))
        step(f"variant {label}")
    return variants_section(config, cells)


@functools.lru_cache(maxsize=2)
def _backward_reference(
    config: Config,
) -> tuple[tuple[np.ndarray, ...], np.ndarray, np.ndarray, Any]:
    """q, k, v, the output cotangent, the causal mask and the certified gradients (computed
    once per process for the presets' cells)."""
    c = config.backward
    shape = (1, 1, c.length, config.d_k)
    q, k, v = (x[0, 0] for x in devices.inputs(shape, "float32", config.structure, config.seed))
    d_out = np.random.default_rng(config.seed + 1).standard_normal(v.shape).astype(np.float32)
    d_out = d_out.astype(np.float64)
    mask = np.tril(np.ones((c.length, c.length), bool))
    exact = reference.attention_grad(q, k, v, d_out, mask=mask, digits=17)
    return (q, k, v), d_out, mask, exact


def backward_cell(config: Config, preset: str) -> dict[str, Any]:
    """The backward rows of one preset (every algorithm and gradient), and its refusals."""
    c = config.backward
    (q, k, v), d_out, mask, exact = _backward_reference(config)
    rows: list[dict[str, Any]] = []
    refusals: list[str] = []
    num = Numerics.preset(preset)
    for algorithm in c.algorithms:
        bw = Backward(algorithm, block_q=c.block, block_k=c.block)
        try:
            found = bounds.attention_grad_bound(q, k, v, d_out, mask, numerics=num, backward=bw)
        except InvalidArgument as refused:
            refusals.append(f"{preset}, {algorithm}: {refused}")
            continue
        grads = attention_grad(q, k, v, d_out, mask, numerics=num, backward=bw)
        for name, got, want, b in zip(
            ("dq", "dk", "dv"), grads, exact, (found.dq, found.dk, found.dv), strict=False
        ):
            total = np.asarray(b.total, np.float64)
            err = np.abs(np.asarray(got, np.float64) - want)
            with np.errstate(divide="ignore", invalid="ignore"):
                ratio = np.where(err == 0, 0.0, err / total)
            rows.append(
                {
                    "preset": preset,
                    "algorithm": algorithm,
                    "gradient": name,
                    "error_max": float(err.max()),
                    "bound_max": float(total.max()),
                    "ratio_max": float(ratio.max()),
                    "dominant_term": b.dominant(),
                    "theorem": b.theorem,
                    "reasons": list(b.reasons),
                }
            )
    return {"rows": rows, "refusals": refusals}


def backward_section(config: Config, cells: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The ``backward`` section from its cells, in the order of the presets."""
    c = config.backward
    return {
        "length": c.length,
        "d_k": config.d_k,
        "block": c.block,
        "rows": [row for cell in cells for row in cell["rows"]],
        "refusals": [text for cell in cells for text in cell["refusals"]],
    }


def backward(config: Config, step: Callable[[str], None]) -> dict[str, Any]:
    """The backward pass (papers/backward.md): every gradient's error against the certified
    reference gradients and Theorem B.1 (textbook) or B.2 (FlashAttention-2), per preset, on
    one causal head."""
    cells = []
    for preset in config.presets:
        cells.append(backward_cell(config, preset))
        step(f"backward {preset}")
    return backward_section(config, cells)


def _constant_label(value: float | str) -> str:
    if isinstance(value, str):
        return "-0.7·finfo.max" if value == "0.7*finfo.min" else value
    return "-inf" if value == -math.inf else f"{value:g}"


def mask_constants(config: Config) -> dict[str, Any]:
    """What each constant does in each format and the safe range (papers/masking.md M.1–M.7).

    Leakage and fully-masked rows (M.4–M.6) follow the configured mode; overflow and absorption
    (M.2, M.3) are those of the constant added to a score, whatever the mode.
    """
    mc = config.mask_constants
    formats = []
    for fmt in mc.formats:
        rows = []
        for value in mc.values:
            a = bounds.analyze_mask(fmt, value, mc.mode, mc.score_bound, n_keys=mc.n_keys)
            added = bounds.analyze_mask(fmt, value, "add", mc.score_bound, n_keys=mc.n_keys)
            rows.append(
                {
                    "constant": _constant_label(value),
                    "requested": a.requested_value,
                    "stored": a.stored_value,
                    "overflows": a.overflows,
                    "add_can_overflow": added.add_can_overflow,
                    "absorbs_scores_when_added": added.absorbs_scores,
                    "absorption_ulp": added.absorption_ulp,
                    "leakage_bound": a.leakage_bound,
                    "leakage_is_zero": a.leakage_is_zero,
                    "fully_masked_row": a.fully_masked_row,
                }
            )
        r = bounds.safe_mask_range(fmt, mc.score_bound, mc.leak_tol, mode=mc.mode, n_keys=mc.n_keys)
        entry: dict[str, Any] = {
            "format": get_format(fmt).name,
            "constants": rows,
            "safe_range": {"low": r.low, "high": r.high, "empty": r.empty, "reason": r.reason},
            "recommended": None,
        }
        if not r.empty:
            rec = bounds.recommend_mask_value(
                fmt, mc.score_bound, mc.leak_tol, mode=mc.mode, n_keys=mc.n_keys
            )
            entry["recommended"] = {"value": rec.value, "reason": rec.reason}
        formats.append(entry)
    return {
        "mode": mc.mode,
        "score_bound": mc.score_bound,
        "n_keys": mc.n_keys,
        "leak_tol": mc.leak_tol,
        "formats": formats,
    }


def _case_files(sources: Sequence[str | os.PathLike[str]]) -> list[Path]:
    files: list[Path] = []
    for source in sources:
        path = Path(source)
        if path.is_dir():
            files.extend(sorted(path.glob("*.json")))
        elif path.is_file():
            files.append(path)
        else:
            msg = f"cases: expected JSON files or directories of them, got {str(path)!r}"
            raise InvalidArgument(msg)
    return files


def read_cases(sources: Sequence[str | os.PathLike[str]]) -> list[dict[str, Any]]:
    """Worst cases saved by the search: JSON objects (or lists of them) with :data:`CASE_FIELDS`.

    Fields missing from a case are ``None``; its file is recorded under ``file``. Its
    ``numerics`` (a mapping of fields) is read by :meth:`~mhanum.Numerics.from_dict`, so an
    earlier version's form reads too, and written as :meth:`~mhanum.Numerics.to_dict` does.

    Raises:
        InvalidArgument: for a path that does not exist, a file that is not a JSON object or
            list of objects, or a case whose ``numerics`` ``Numerics.from_dict`` refuses.
    """
    cases = []
    for path in _case_files(sources):
        try:
            data = json.loads(path.read_text("utf-8"))
        except (OSError, ValueError) as exc:
            msg = f"cases: expected a JSON case file, got {str(path)!r} ({exc})"
            raise InvalidArgument(msg) from None
        items = data if isinstance(data, list) else [data]
        for item in items:
            if not isinstance(item, Mapping):
                msg = f"cases: expected JSON objects in {str(path)!r}, got {type(item).__name__}"
                raise InvalidArgument(msg)
            case = {f: item.get(f) for f in CASE_FIELDS} | {"file": str(path)}
            if isinstance(case["numerics"], Mapping):
                case["numerics"] = _case_numerics(case["numerics"], path)
            cases.append(case)
    return sorted(cases, key=lambda c: -_number(c["ratio"]))


def _case_numerics(fields: Mapping[str, Any], path: Path) -> dict[str, Any]:
    try:
        return Numerics.from_dict(fields).to_dict()
    except InvalidArgument as exc:
        msg = f"cases: expected a case's numerics in {str(path)!r}, got {exc}"
        raise InvalidArgument(msg) from None


def _number(x: object) -> float:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else -math.inf


def device_records(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The verdicts of :func:`mhanum.devices.check` on a records file, and every measurement."""
    records = devices.read_records(path)
    try:
        result = devices.check(records)
    except InvalidArgument as exc:
        msg = f"{path}: {exc}"
        raise InvalidArgument(msg) from None
    points = [
        {
            "implementation": r["implementation"],
            "dtype": r["dtype"],
            "model": r["model"]["label"],
            "error_max_abs": r["errors"]["max_abs"],
            "bound_max": r["bound"]["max"],
            "ratio": v.ratio,
            "verdict": v.verdict,
        }
        for r, v in zip(records, result.verdicts, strict=True)
        if r.get("kind") == "attention" and r.get("status") == "measured"
    ]
    return {
        "file": str(path),
        "ok": result.ok,
        "counts": result.counts,
        "summary": list(result.summary),
        "points": points,
    }


Cell = tuple[Config, str, Any, bool]
"""A cell of the grid: the config, its section, the section's argument, JAX's 64-bit mode."""


def _cells(config: Config) -> list[tuple[str, Cell]]:
    """The independent cells of the grid as ``(key, cell)``, longest first (the backward
    presets share a reference per process)."""
    import jax

    x64 = bool(jax.config.read("jax_enable_x64"))
    cells: list[tuple[str, Cell]] = []
    cells += [(f"backward {p}", (config, "backward", p, x64)) for p in config.presets]
    cells += [
        (f"variant {label}", (config, "variants", i, x64))
        for i, (label, *_) in enumerate(_variant_cases(config))
    ]
    cells += [(f"heads h={h}", (config, "heads", h, x64)) for h in config.heads.num_heads]
    cells += [
        (f"attention L={n} mask={kind}", (config, "attention", (kind, n), x64))
        for kind in config.masks
        for n in config.lengths
    ]
    return cells


def grid_cell(spec: Cell, seed: np.random.SeedSequence | None = None) -> dict[str, Any]:
    """One cell of the report grid (a task of :func:`mhanum.parallel.run_tasks`: the inputs
    come from ``config.seed``, so the task seed is not used), in the 64-bit mode of the
    process that made the cell."""
    import jax

    config, section, arg, x64 = spec
    if bool(jax.config.read("jax_enable_x64")) != x64:  # a worker process
        jax.config.update("jax_enable_x64", x64)
    if section == "attention":
        return attention_cell(config, *arg)
    if section == "heads":
        return heads_cell(config, arg)
    if section == "variants":
        return variant_cell(config, arg)
    return backward_cell(config, arg)


def campaign(config: Config) -> dict[str, Any]:
    """What a report's journal records as its campaign: the grid and the mhanum version."""
    from mhanum._version import __version__

    return {"kind": "mhanum.report", "mhanum_version": __version__, "config": config.as_dict()}


def compute(
    config: Config,
    *,
    cases: Sequence[str | os.PathLike[str]] = (),
    records: Sequence[str | os.PathLike[str]] = (),
    progress: Progress | None = None,
    executor: object = None,
    journal: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """All sections of a report as JSON-ready data (without provenance: see ``build``).

    The grid's cells (each length and mask, head count, variant, backward preset) are
    independent tasks of :func:`mhanum.parallel.run_tasks` on ``executor`` (``None``: in this
    process), recorded in ``journal`` if given; the data are the same whichever runs them.
    """
    cells = _cells(config)
    total = len(cells) + 1 + len(records)
    done = 0

    def step(what: str) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total, what)

    case_list = read_cases(cases)  # read first: a bad file fails before minutes of work
    results = parallel.run_tasks(
        grid_cell,
        cells,
        seed=config.seed,
        executor=executor,
        journal=journal,
        campaign=campaign(config),
        progress=lambda _done, _total, key: step(key),
    )
    by_section: dict[str, list[Any]] = {}
    for (_, (_, section, _, _)), result in zip(cells, results, strict=True):
        by_section.setdefault(section, []).append(result)
    data: dict[str, Any] = {"attention": attention_section(by_section.get("attention", []))}
    data["heads"] = heads_section(config, by_section.get("heads", []))
    data["mask_constants"] = mask_constants(config)
    step("mask constants")
    data["variants"] = variants_section(config, by_section.get("variants", []))
    data["backward"] = backward_section(config, by_section.get("backward", []))
    data["cases"] = case_list
    files = []
    for path in records:
        files.append(device_records(path))
        step(f"records {path}")
    data["records"] = {"files": files}
    return data
