"""The demo: measured error of an 8-head attention layer per preset, and two findings.

:func:`run` computes everything and returns plain data; :func:`render` prints it. The defaults are
fixed (seed 0, d_model 512, 8 heads, L 64), so the same command prints the same numbers.

The findings:

1. **A float32 additive mask of −1e9 on every logit** (the polarity mistake ``mask = ones * -1e9``,
   or a mask whose "keep" entries are −1e9): ``s + (−1e9)`` is rounded to a multiple of
   ``ulp(1e9) = 64``, so every logit with ``|s| < 32`` becomes exactly ``−1e9``. The softmax is then
   uniform, not a backend difference: the output is wrong by tens of percent (max-norm relative).
2. **8 heads are not 1 head of the same width**: with the same weights, the score of a head is the
   dot product over its ``d_k`` components only; the 8-head and 1-head layers compute different
   functions, and differ by O(1).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from mhanum import metrics, reference
from mhanum._errors import CertificationError, InvalidArgument
from mhanum.emulate.attention import multi_head_attention
from mhanum.formats import get_format
from mhanum.numerics import Numerics
from mhanum.params import MHAParams

__all__ = ["DEMO_PRESETS", "DemoResult", "check_arguments", "render", "run"]

DEMO_PRESETS = ("fp32", "tf32", "bf16-fp32acc", "fp16-fp32acc", "fp16")
_BACKENDS = {
    "dd": "double-double enclosure",
    "auto": "double-double enclosure, uncertified rows recomputed",
}


@dataclasses.dataclass(frozen=True)
class DemoResult:
    """Everything the demo measured, as plain data (see :func:`run`)."""

    config: dict[str, Any]
    reference_seconds: float  # wall time: it varies with the machine and its load
    reference_backend: str  # the backend that certified the reference ("dd" or "auto")
    presets: dict[str, dict[str, Any]]
    mask_minus_1e9: dict[str, Any]
    heads: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def check_arguments(
    *,
    seed: int,
    d_model: int,
    num_heads: int,
    length: int,
    names: Mapping[str, str] | None = None,
) -> None:
    """Refuse arguments of :func:`run` that describe no layer, naming each as ``names`` spells
    it (the command passes its options: ``{"d_model": "--d-model", ...}``).

    Raises:
        InvalidArgument: ``"<name>: expected a positive integer, got -8"`` and the like.
    """
    values = {"seed": seed, "d_model": d_model, "num_heads": num_heads, "length": length}
    spelled = {name: (names or {}).get(name, name) for name in values}
    for name, value in values.items():
        smallest = 0 if name == "seed" else 1
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < smallest:
            kind = "a non-negative integer" if smallest == 0 else "a positive integer"
            msg = f"{spelled[name]}: expected {kind}, got {value!r}"
            raise InvalidArgument(msg)
    if d_model % num_heads:
        msg = (
            f"{spelled['num_heads']}: expected a divisor of {spelled['d_model']} {d_model}, "
            f"got {num_heads}"
        )
        raise InvalidArgument(msg)


def run(*, seed: int = 0, d_model: int = 512, num_heads: int = 8, length: int = 64) -> DemoResult:
    """Measure the demo's table and findings (needs ``jax_enable_x64``).

    Args:
        seed: seed of the inputs (``numpy.random.default_rng``) and of the weights.
        d_model: model width.
        num_heads: number of heads of the layer, a divisor of ``d_model``.
        length: sequence length (self-attention: ``x_q = x_kv``).

    Raises:
        InvalidArgument: for a negative ``seed``, a ``d_model``, ``num_heads`` or ``length``
            that is not a positive integer, or ``num_heads`` not dividing ``d_model``.
    """
    check_arguments(seed=seed, d_model=d_model, num_heads=num_heads, length=length)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((length, d_model))
    params = MHAParams.random(d_model, seed=seed)

    start = time.perf_counter()
    ref, backend = _certified_reference(x, params, num_heads)
    ref_seconds = time.perf_counter() - start

    presets = {}
    for name in DEMO_PRESETS:
        num = Numerics.preset(name)
        out = multi_head_attention(x, x, params, num_heads, numerics=num)
        presets[name] = metrics.errors(out, ref, fmt=num.format_of("output")).as_dict()

    every_logit = np.full((length, length), -1e9)
    shifted = multi_head_attention(x, x, params, num_heads, bias=every_logit, numerics="fp32")
    mask_case = {
        "numerics": "fp32",
        "bias": -1e9,
        "ulp_of_1e9_in_float32": 64.0,
        "errors": metrics.errors(shifted, ref).as_dict(),
    }

    one_head = reference.multi_head_attention(x, x, params, 1)
    heads = {
        "num_heads": num_heads,
        "difference": metrics.errors(one_head, ref).as_dict(),
    }
    config = {
        "seed": seed,
        "d_model": d_model,
        "num_heads": num_heads,
        "length": length,
        "inputs": "x ~ N(0, 1); MHAParams.random(d_model, seed=seed)",
    }
    return DemoResult(config, ref_seconds, backend, presets, mask_case, heads)


def _certified_reference(x: np.ndarray, params: MHAParams, num_heads: int) -> tuple[Any, str]:
    """The layer's reference, certified to 20 digits, and the backend that certified it: the
    double-double enclosure (``"dd"``) where it certifies every output, as at the default size,
    else ``"auto"``, which recomputes the rows the enclosure leaves."""
    try:
        return reference.multi_head_attention(x, x, params, num_heads, backend="dd"), "dd"
    except CertificationError:
        return reference.multi_head_attention(x, x, params, num_heads, backend="auto"), "auto"


def render(result: DemoResult) -> str:
    """The demo as text: a table of errors per preset, then the two findings."""
    c = result.config
    backend = result.reference_backend
    lines = [
        (
            f"mhanum demo: {c['num_heads']}-head self-attention, d_model {c['d_model']}, "
            f"L {c['length']}, seed {c['seed']}"
        ),
        (
            f"reference: backend {backend} ({_BACKENDS[backend]}), certified to 20 digits "
            f"({result.reference_seconds:.1f} s wall time)"
        ),
        "",
        f"{'preset':<14}{'max abs':>10}{'normwise':>10}{'= x u':>9}  {'of':<10}{'max rel':>9}",
    ]
    for name, e in result.presets.items():
        u = get_format(e["fmt"]).u
        lines.append(
            f"{name:<14}{e['max_abs']:>10.2e}{e['normwise_max']:>10.2e}"
            f"{e['normwise_max'] / u:>9.1f}  {e['fmt']:<10}{e['max_rel']:>9.2e}"
        )
    lines += [
        "normwise = max|error| / max|reference|; u = unit roundoff of the output format;",
        "max rel is componentwise and large where an output is near zero (cancellation in P V).",
    ]
    m = result.mask_minus_1e9["errors"]
    h = result.heads["difference"]
    lines += [
        "",
        "Finding 1: a float32 additive mask of -1e9 on every logit (mask = ones * -1e9)",
        f"  normwise (max-norm) relative error {m['normwise_max']:.0%}: ulp(1e9) = 64 in float32, so",
        "  s + (-1e9) rounds to -1e9 for |s| < 32 and the softmax becomes uniform.",
        "",
        f"Finding 2: {result.heads['num_heads']} heads vs 1 head with the same weights",
        f"  normwise relative difference {h['normwise_max']:.2f}: each head's scores are dot",
        "  products over its own d_k components: a different function, not a rounding effect.",
    ]
    return "\n".join(lines)
