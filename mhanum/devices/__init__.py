"""Hardware modes: measure attention on a JAX backend, check the records against the bounds.

:func:`measure` runs mhanum's :func:`~mhanum.attention` (under its presets) and
``jax.nn.dot_product_attention`` (``implementation="xla"``, and ``"cudnn"`` on a GPU) on the
available backend under each ``jax.default_matmul_precision``, on a :class:`Grid` of shapes,
input dtypes, input structures and masks. Each measurement becomes one **record** (a JSON object,
one per line in a ``.jsonl`` file): where it ran, what ran, the :class:`~mhanum.Numerics` *model*
it is checked under (:func:`model_for`), the measured errors against the certified reference
(:func:`mhanum.reference.attention`, computed on the host in a process pool) and the bound of
Theorem A.1 (:func:`mhanum.bounds.attention_bound`) under the model. One record of kind ``"exp"``
per backend measures ``jnp.exp`` in float32, since every bound *assumes* ``Numerics.exp_ulps``.

:func:`check` judges records, also records made on another machine: it regenerates the inputs
from the record (:func:`inputs` is deterministic numpy, never the JAX RNG), recomputes the bound
on the host from the record's model and compares it with the recorded error. ``docs/devices.md``
describes the record schema field by field and the model table.
"""

from __future__ import annotations

from mhanum.devices.check import (
    FAILING,
    VERDICTS,
    CheckResult,
    Verdict,
    check,
    render_summary,
    summarize,
)
from mhanum.devices.exp import exp_record
from mhanum.devices.platforms import IMPLEMENTATIONS, ONLINE_BLOCK, PLATFORMS, PRECISIONS, model_for
from mhanum.devices.records import (
    BOUND_REVISION,
    BOUND_RTOL,
    SCHEMA,
    Record,
    read_records,
    write_records,
)
from mhanum.devices.run import Grid, measure
from mhanum.inputs import (
    CANCEL_OFFSET,
    CANCEL_QK,
    DTYPES,
    LARGE_NORM_LOGIT,
    MASKS,
    OUTLIER_CHANNELS,
    OUTLIER_FACTOR,
    OUTLIER_LOGIT,
    STRUCTURES,
    inputs,
    mask_array,
)

__all__ = [
    "BOUND_REVISION",
    "BOUND_RTOL",
    "CANCEL_OFFSET",
    "CANCEL_QK",
    "DTYPES",
    "FAILING",
    "IMPLEMENTATIONS",
    "LARGE_NORM_LOGIT",
    "MASKS",
    "ONLINE_BLOCK",
    "OUTLIER_CHANNELS",
    "OUTLIER_FACTOR",
    "OUTLIER_LOGIT",
    "PLATFORMS",
    "PRECISIONS",
    "SCHEMA",
    "STRUCTURES",
    "VERDICTS",
    "CheckResult",
    "Grid",
    "Record",
    "Verdict",
    "check",
    "exp_record",
    "inputs",
    "mask_array",
    "measure",
    "model_for",
    "read_records",
    "render_summary",
    "summarize",
    "write_records",
]
