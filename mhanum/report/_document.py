"""The report's text, tables and figures, built from its data (see ``_compute``)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from mhanum.report import _figures
from mhanum.report._render import Block, Figure, Heading, Paragraph, Table

__all__ = ["blocks"]


def _g(x: object, digits: int = 3) -> str:
    """A number for a table: 3 significant digits, ``inf``, ``nan``; ``–`` for missing."""
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, (int, float)):
        if math.isnan(x):
            return "nan"
        if math.isinf(x):
            return "inf" if x > 0 else "-inf"
        return f"{x:.{digits}g}"
    return str(x)


def _max(values: list[float] | None) -> float | None:
    """The largest of per-sample values, or ``None`` for a bound that was not evaluated."""
    return max(values) if values else None


def _grid_text(data: Mapping[str, Any]) -> str:
    c = data["config"]
    return (
        f"Grid: presets {', '.join(c['presets'])}; sequence lengths "
        f"{', '.join(map(str, c['lengths']))}; d_k = {c['d_k']}; masks {', '.join(c['masks'])} "
        f"(True = attend, applied with -inf); {c['samples']} inputs per point "
        f"(`{c['structure']}` inputs of `mhanum.devices.inputs`, float32, seed {c['seed']}). "
        "Errors are against the certified reference (`mhanum.reference`, 20 digits)."
    )


def _a_priori_text(attention: Mapping[str, Any]) -> str:
    if attention["a_priori"] is None:
        return (
            "The a-priori bound (from sizes and norms only) is absent: this mhanum has no "
            "`mhanum.bounds.attention_bound_a_priori`, so its series is not plotted."
        )
    text = (
        f"The a-priori bound (Theorem A.4, `mhanum.bounds.{attention['a_priori']}`) is evaluated "
        "for each input from its sizes and norms only: the largest row norms of q and k, the "
        "largest |v| and the fewest attended keys; it holds for every input with those sizes."
    )
    if attention["a_priori_notes"]:
        text += " It refused: " + "; ".join(f"`{r}`" for r in attention["a_priori_notes"]) + "."
    return text


def _attention(attention: Mapping[str, Any]) -> list[Block]:
    points = attention["points"]
    lam = {
        p["preset"]: (p["probabilistic_lam"], p["probabilistic_probability"])
        for p in points
        if p["probabilistic_probability"] is not None
    }
    judged = [p for p in points if p["ratio"] is not None]
    worst = max(judged, key=lambda p: max(p["ratio"])) if judged else None
    worst_text = (
        f"Largest error/bound ratio (entry by entry, Theorem A.1): {_g(max(worst['ratio']))} "
        f"for {worst['preset']} at L = {worst['length']}, mask {worst['mask']}. Every ratio "
        "must be ≤ 1."
        if worst is not None
        else "Theorem A.1 was evaluated at no grid point."
    )
    refusals = [
        Paragraph(f"Bounds refused (outside their theorem's hypotheses): `{r}`.")
        for r in attention["refusals"]
    ]
    return [
        Heading(1, "Error against sequence length"),
        Figure(
            "error_vs_length",
            _figures.error_vs_length(attention),
            "Measured max |error| over the entries (median and worst over the inputs) against "
            "the a-posteriori bound of Theorem A.1, its probabilistic variant (Theorem A.3) and "
            "the a-priori bound of Theorem A.4 when mhanum has one; bounds are the largest over "
            "the inputs.",
        ),
        Paragraph(_a_priori_text(attention)),
        Paragraph(
            "The probabilistic bound models the rounding errors of sums and dots as independent "
            "and mean-zero; its λ is chosen so that it holds with the stated probability by a "
            "union bound over every product chain of a grid point: "
            + "; ".join(f"{k}: λ = {v[0]:.3g} (p ≥ {v[1]:.6g})" for k, v in lam.items())
            + "."
        ),
        Paragraph(worst_text),
        *refusals,
        Table(
            (
                "preset",
                "mask",
                "L",
                "median err",
                "worst err",
                "A.1 bound",
                "A.3 bound",
                "a priori",
                "max err/bound",
                "dominant term",
            ),
            tuple(
                (
                    p["preset"],
                    p["mask"],
                    str(p["length"]),
                    _g(p["error_median"]),
                    _g(p["error_worst"]),
                    _g(_max(p["bound_a_posteriori"])),
                    _g(_max(p["bound_probabilistic"])),
                    _g(_max(p["bound_a_priori"])),
                    _g(_max(p["ratio"])),
                    _g(p["dominant_term"]),
                )
                for p in points
            ),
        ),
    ]


def _terms(attention: Mapping[str, Any]) -> list[Block]:
    points = attention["points"]
    names = sorted({n for p in points for n in p["terms_at_max"]})
    return [
        Heading(1, "Where the bound comes from"),
        Figure(
            "term_breakdown",
            _figures.term_breakdown(attention),
            "The terms of Theorem A.1 at the entry where the bound is largest, as shares of the "
            "bound: logits, split into the sources of the logit errors (operands: the rounding "
            "of q and k; qk_dot: the Q Kᵀ unit; scale: the scale and the score rounding; bias; "
            "mask_absorption), softmax (exp, sum, division or rescaling), probability rounding, "
            "operands (of P V), P V and the output rounding.",
        ),
        Table(
            ("preset", "mask", "L", *names),
            tuple(
                (
                    p["preset"],
                    p["mask"],
                    str(p["length"]),
                    *(_g(p["terms_at_max"].get(n)) for n in names),
                )
                for p in points
            ),
        ),
    ]


def _mask_constants(section: Mapping[str, Any]) -> list[Block]:
    out: list[Block] = [
        Heading(1, "Mask constants"),
        Paragraph(
            f"What each constant does when masked logits are handled by `{section['mode']}` "
            f"(leakage, fully-masked rows; papers/masking.md M.1, M.4–M.6) and when it is added "
            f"to a score (overflow, absorption; M.2, M.3), for attended scores |s| ≤ "
            f"{_g(section['score_bound'])} and {section['n_keys']} keys per row. The safe range "
            f"(M.7) holds the constants that stay finite when a score is added and leak at most "
            f"{_g(section['leak_tol'])}."
        ),
    ]
    for f in section["formats"]:
        r = f["safe_range"]
        safe = "empty" if r["empty"] else f"[{_g(r['low'])}, {_g(r['high'])}]"
        rec = f["recommended"]
        out += [
            Heading(2, f"{f['format']}"),
            Table(
                (
                    "constant",
                    "stored",
                    "overflows",
                    "overflows when added",
                    "absorbs scores when added (ulp)",
                    "leakage bound",
                    "fully-masked row",
                ),
                tuple(
                    (
                        c["constant"],
                        _g(c["stored"]),
                        _g(c["overflows"]),
                        _g(c["add_can_overflow"]),
                        f"{_g(c['absorbs_scores_when_added'])} ({_g(c['absorption_ulp'])})",
                        "0 (exactly)" if c["leakage_is_zero"] else _g(c["leakage_bound"]),
                        c["fully_masked_row"],
                    )
                    for c in f["constants"]
                ),
            ),
            Paragraph(
                f"Safe range: {safe}. "
                + (f"Recommended: {_g(rec['value'])}." if rec else "No constant is safe.")
            ),
        ]
    return out


def _variants(section: Mapping[str, Any]) -> list[Block]:
    return [
        Heading(1, "Today's attention variants"),
        Paragraph(
            f"Causal and sliding-window masks given as structure (`mhanum.masks`), ALiBi biases, "
            f"attention sinks, grouped-query attention, logit soft-capping and split-KV, on the "
            f"same {section['heads']} heads of {section['length']} tokens (d_k = "
            f"{section['d_k']}; the grouped row reads {section['kv_heads']} key/value heads). The "
            "first five are computed, referenced and bounded exactly as the attention they reduce "
            "to (papers/attention.md, the variants reduced to A.1 and A.2); soft-capping is A.1 "
            "with step 3c, split-KV Theorem A.6. Each row: the largest error against the "
            "certified reference, the bound (median and largest over the output) and the largest "
            "error ÷ bound."
        ),
        Table(
            (
                "variant",
                "preset",
                "max error",
                "bound median",
                "bound max",
                "max error / bound",
                "dominant term",
            ),
            tuple(
                (
                    r["variant"],
                    r["preset"],
                    _g(r["error_max"]),
                    _g(r["bound_median"]),
                    _g(r["bound_max"]),
                    _g(r["ratio_max"]),
                    r["dominant_term"],
                )
                for r in section["rows"]
            ),
        ),
    ]


def _backward(section: Mapping[str, Any]) -> list[Block]:
    out: list[Block] = [
        Heading(1, "The backward pass"),
        Paragraph(
            f"The gradients dq, dk and dv of one causal head of {section['length']} tokens "
            f"(d_k = {section['d_k']}) with a random d_out, by the textbook backward and "
            f"FlashAttention-2's (blocks of {section['block']}), against the certified reference "
            "gradients, with Theorem B.1 or B.2 (papers/backward.md: every order of "
            "FlashAttention-2's dq atomic adds). Each row: the largest error, the largest bound "
            "and the largest error ÷ bound."
        ),
        Table(
            (
                "preset",
                "algorithm",
                "gradient",
                "max error",
                "bound max",
                "max error / bound",
                "dominant term",
            ),
            tuple(
                (
                    r["preset"],
                    r["algorithm"],
                    r["gradient"],
                    _g(r["error_max"]),
                    _g(r["bound_max"]),
                    _g(r["ratio_max"]),
                    r["dominant_term"],
                )
                for r in section["rows"]
            ),
        ),
    ]
    if section["refusals"]:
        out.append(Paragraph("Not bounded: " + "; ".join(section["refusals"]) + "."))
    return out


def _heads(section: Mapping[str, Any]) -> list[Block]:
    rows = section["rows"]
    presets = list(rows[0]["presets"])
    explanation = next(
        (r["difference_to_one_head"]["explanation"] for r in rows if "difference_to_one_head" in r),
        "",
    )
    factors = []
    for preset in presets:
        for r in rows:
            p = r["presets"][preset]
            dot, proj = p["score_dot_factor"], p["output_projection_factor"]
            factors.append(
                (
                    preset,
                    str(r["num_heads"]),
                    str(r["d_k"]),
                    *(_g(dot["terms"][t] if dot else None) for t in ("per_head", "one_head")),
                    *(_g(proj["terms"][t] if proj else None) for t in ("per_head", "flat")),
                )
            )
    scales = sorted({k for r in rows for k in r["scale_exactness"]})
    return [
        Heading(1, "Head partitioning"),
        Figure(
            "heads",
            _figures.heads(section),
            "Left: measured max |error| of h-head attention, its bound (Theorem A.2) and, "
            "dotted, the a-priori bound from max |x| (Theorem A.4) at a fixed d_model. Right: the exact difference between h heads and one head with the "
            "same weights (`mhanum.bounds.heads.head_partition_difference`).",
        ),
        Paragraph(explanation),
        *(
            Paragraph(f"Bounds refused (outside their theorem's hypotheses): `{r}`.")
            for r in section["refusals"]
        ),
        Table(
            ("h", "d_k", "‖y_h − y_1‖∞/‖y_1‖∞", *(f"{p} err / bound" for p in presets)),
            tuple(
                (
                    str(r["num_heads"]),
                    str(r["d_k"]),
                    _g(r.get("difference_to_one_head", {}).get("normwise_max", 0.0)),
                    *(
                        f"{_g(r['presets'][p]['error_max_abs'])} / "
                        f"{_g(r['presets'][p]['bound_max'])}"
                        for p in presets
                    ),
                )
                for r in rows
            ),
        ),
        Paragraph(
            "Dot lengths (Theorem H.1): a head's score dot has d_k terms, not d_model, so its "
            "worst-case factor is γ_{d_k}; the output projection summed per head and then over "
            "heads is a blocked sum with factor γ_{d_v+h−1} instead of γ_{h·d_v} (Theorem H.3)."
        ),
        Table(
            (
                "preset",
                "h",
                "d_k",
                "γ score dot (per head)",
                "γ score dot (one head)",
                "γ out proj (blocked)",
                "γ out proj (flat)",
            ),
            tuple(factors),
        ),
        Paragraph(
            "Scale exactness (Theorem H.2): 1/sqrt(d_k) is a binary float iff d_k = 4^m; "
            "d_k^(-1/4) applied to q and k each (`qk`) iff d_k = 16^m. Relative error of the "
            "rounded constant:"
        ),
        Table(
            ("h", "d_k", *scales),
            tuple(
                (
                    str(r["num_heads"]),
                    str(r["d_k"]),
                    *(
                        "exact"
                        if r["scale_exactness"][s]["exact"]
                        else _g(r["scale_exactness"][s]["relative_error"])
                        for s in scales
                    ),
                )
                for r in rows
            ),
        ),
    ]


def _cases(cases: list[Mapping[str, Any]]) -> list[Block]:
    out: list[Block] = [Heading(1, "Worst cases found by search")]
    if not cases:
        return [*out, Paragraph("None given (pass case files or directories with `--cases`).")]
    return [
        *out,
        Paragraph(f"{len(cases)} saved cases, worst error/bound ratio first."),
        Table(
            (
                "preset",
                "shape",
                "seed",
                "objective",
                "error",
                "bound",
                "error/bound",
                "dominant term",
                "file",
            ),
            tuple(
                (
                    _g(c["preset"]),
                    _g(c["shape"]),
                    _g(c["seed"]),
                    _g(c["objective"]),
                    _g(c["error"]),
                    _g(c["bound"]),
                    _g(c["ratio"]),
                    _g(c["dominant_term"]),
                    c["file"],
                )
                for c in cases
            ),
        ),
    ]


def _records(section: Mapping[str, Any]) -> list[Block]:
    out: list[Block] = [Heading(1, "Device records")]
    if not section["files"]:
        return [*out, Paragraph("None given (pass `mhanum measure` records with `--records`).")]
    for f in section["files"]:
        counts = ", ".join(f"{n} {v}" for v, n in f["counts"].items() if n)
        out += [
            Paragraph(
                f"`{f['file']}`: {counts}; "
                + ("every bound holds." if f["ok"] else "SOME RECORDS FAIL (see report.json).")
            ),
            Table(
                (
                    "device",
                    "implementation",
                    "precision",
                    "model",
                    "n",
                    "skipped",
                    "worst err/bound",
                    "median bound/err",
                ),
                tuple(
                    (
                        r["device"],
                        r["implementation"],
                        r["precision"],
                        r["model"],
                        str(r["count"]),
                        str(r["skipped"]),
                        _g(r["worst_ratio"]),
                        _g(r["median_tightness"]),
                    )
                    for r in f["summary"]
                ),
            ),
        ]
    png = _figures.device_records(section)
    if png is not None:
        out.append(
            Figure(
                "device_records",
                png,
                "Measured max |error| of every device record against its bound (Theorem A.1 under the record's model).",
            )
        )
    return out


def _provenance(data: Mapping[str, Any]) -> list[Block]:
    versions = ", ".join(f"{k} {v}" for k, v in data["versions"].items())
    return [
        Heading(1, "Provenance"),
        Paragraph(
            f"Created {data['created']} in {data['seconds']:.1f} s; {versions}. Inputs come from "
            "numpy's PCG64 with the seed above, so the same config gives the same numbers; "
            "between two runs only the creation time, the timing and (on another machine) the "
            "versions differ. Every number is in report.json."
        ),
    ]


def blocks(data: Mapping[str, Any]) -> list[Block]:
    """Every section of the report, in order."""
    return [
        Paragraph(_grid_text(data)),
        *_attention(data["attention"]),
        *_terms(data["attention"]),
        *_mask_constants(data["mask_constants"]),
        *_heads(data["heads"]),
        *(_variants(data["variants"]) if "variants" in data else []),
        *(_backward(data["backward"]) if "backward" in data else []),
        *_cases(data["cases"]),
        *_records(data["records"]),
        *_provenance(data),
    ]
