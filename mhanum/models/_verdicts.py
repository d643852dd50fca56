"""A preset's verdict against a tolerance (certified, probable, measured within, or not), the
masking constants' verdicts, and what the audit reads when given nothing (its sentences)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from mhanum import bounds
from mhanum._errors import InvalidArgument
from mhanum.formats import get_format
from mhanum.models._records import LayerAudit, MaskVerdict, Verdict
from mhanum.numerics import Numerics

DEFAULT_SENTENCES = (
    "A man is eating food.",
    "The new movie is awesome, and everyone loved it!",
)
"""The sentences audited when none are given: two short ones of different lengths, so that the
default audit also runs a padded batch."""


SCORE_MARGIN = 1.0 + 2.0**-4
"""The score bound ``B`` of the masking analysis is the largest ``|scaled logit|`` of the float64
forward times this factor, a cushion for the logits' rounding in the audited formats (at most a
few ``2^-8`` relative in bfloat16 for these layers; the measured logit error is far below)."""


def layer_tolerance(scale: float | None, tolerance: float | None, rtol: float | None) -> float:
    """A layer's tolerance ``min(tolerance, rtol·scale)`` of those given.

    Args:
        scale: the layer's output scale, ``max |exact output|`` (:attr:`LayerAudit.output_scale`).
        tolerance: an absolute tolerance, or ``None``.
        rtol: a tolerance relative to ``scale``, or ``None``.

    Raises:
        InvalidArgument: without either tolerance, or ``rtol`` without a ``scale``.
    """
    if tolerance is None and rtol is None:
        msg = "tolerance: expected an absolute tolerance, an rtol or both, got neither"
        raise InvalidArgument(msg)
    limits = [] if tolerance is None else [tolerance]
    if rtol is not None:
        if scale is None:
            msg = "scale: expected the layer's output scale for an rtol, got None"
            raise InvalidArgument(msg)
        limits.append(rtol * scale)
    return min(limits)


def _worst(values: Sequence[float | None], tols: Sequence[float]) -> tuple[float | None, int]:
    """The largest ``value / tol`` and its index; ``None`` if a value is missing."""
    if any(v is None for v in values):
        return None, 0
    ratios = [float(v) / t for v, t in zip(values, tols, strict=True)]  # type: ignore[arg-type]
    i = max(range(len(ratios)), key=ratios.__getitem__)
    return ratios[i], i


def verdict(
    preset: str,
    layers: Sequence[LayerAudit],
    *,
    tolerance: float | None = None,
    rtol: float | None = None,
) -> Verdict:
    """The :class:`Verdict` of ``preset`` over ``layers`` (its rules are there).

    Args:
        preset: a preset audited on every layer.
        layers: the audited layers (:attr:`Audit.layers`).
        tolerance: an absolute tolerance on every component of a layer's attention output.
        rtol: a tolerance relative to each layer's output scale (``max |exact output|``).

    Raises:
        InvalidArgument: for no layers, no tolerance, or a preset not audited.

    Examples:
        >>> from mhanum.models import LayerAudit, PresetAudit, verdict
        >>> p = PresetAudit("fp32", 1e-6, 1e-6, 4e-3, 2.5e-4, "attention.logits", None, ())
        >>> layer = LayerAudit(0, 10.0, (), (p,), (), output_scale=2.0)
        >>> verdict("fp32", [layer], tolerance=1e-2).verdict
        'certified'
        >>> verdict("fp32", [layer], rtol=1e-3).verdict  # τ = 1e-3 · 2.0 = 2e-3 < 4e-3
        'measured'
    """
    if not layers:
        msg = "layers: expected at least one audited layer, got none"
        raise InvalidArgument(msg)
    tols = [layer_tolerance(layer.output_scale, tolerance, rtol) for layer in layers]
    audits = [layer.preset(preset) for layer in layers]
    error_ratio, error_at = _worst([p.error for p in audits], tols)
    bound_ratio, bound_at = _worst([p.bound for p in audits], tols)
    probable_ratio, probable_at = _worst([p.probable_bound for p in audits], tols)
    assert error_ratio is not None  # errors are always measured
    have_p = all(p.probability is not None for p in audits)
    probability = (
        max(0.0, 1.0 - math.fsum(1.0 - float(p.probability or 0.0) for p in audits))
        if have_p
        else None
    )
    if error_ratio > 1:
        name, ratio, at = "not within", error_ratio, error_at
    elif bound_ratio is not None and bound_ratio <= 1:
        name, ratio, at = "certified", bound_ratio, bound_at
    elif probable_ratio is not None and probable_ratio <= 1:
        name, ratio, at = "probable", probable_ratio, probable_at
    else:
        name, ratio, at = "measured", error_ratio, error_at
    heads = audits[at].heads
    key = (lambda h: h.error) if name in ("measured", "not within") else (lambda h: h.bound)
    head = max(heads, key=key).head if heads else None
    return Verdict(
        preset=preset,
        verdict=name,
        ratio=ratio,
        layer=layers[at].layer,
        head=head,
        error_ratio=error_ratio,
        bound_ratio=bound_ratio,
        probable_ratio=probable_ratio,
        probability=probability,
        assumptions=audits[0].probable_assumptions,
    )


def mask_verdicts(
    score_bound: float, n_keys: int, presets: Iterable[str], constants: Iterable[float | str]
) -> tuple[MaskVerdict, ...]:
    """:class:`MaskVerdict` of each constant in each preset's score and softmax formats, for
    scores ``|s| <= score_bound·SCORE_MARGIN`` and rows of ``n_keys`` keys."""
    out = []
    b = score_bound * SCORE_MARGIN
    for preset in presets:
        num = Numerics.preset(preset)
        fs = num.format_of("softmax")
        u = get_format(fs).u
        for c in constants:
            a = bounds.analyze_mask(
                num.format_of("score"), c, "add", b, softmax_format=fs, n_keys=n_keys,
                softmax=num.softmax, exp_ulps=num.exp_ulps, div_ulps=num.div_ulps,
            )  # fmt: skip
            leak = 0.0 if a.leakage_is_zero else float(a.leakage_bound or 0.0)
            finite = not (isinstance(c, float) and math.isinf(c))
            safe = leak <= u and not (finite and a.overflows)
            out.append(MaskVerdict(preset, c, a.stored_value, leak, safe))
    return tuple(out)
