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

import concurrent.futures
import dataclasses
import functools
import hashlib
import json
import math
import multiprocessing
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Self, TypeAlias, cast

import jax
import jax.numpy as jnp
import mpmath
import numpy as np

from mhanum import reference
from mhanum._errors import InvalidArgument
from mhanum.attention import attention
from mhanum.bounds.attention import attention_bound
from mhanum.bounds.masking import analyze_numerics
from mhanum.formats import get_format, round_to
from mhanum.measure import errors
from mhanum.numerics import PRESETS, Numerics

__all__ = [
    "DTYPES",
    "IMPLEMENTATIONS",
    "MASKS",
    "PRECISIONS",
    "SCHEMA",
    "STRUCTURES",
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
    "summarize",
    "write_records",
]

SCHEMA = "mhanum.devices/1"
"""The schema version written in every record; :func:`read_records` refuses any other."""

Record: TypeAlias = dict[str, Any]
"""One measurement as a JSON object (see ``docs/devices.md`` for its fields)."""

STRUCTURES = ("normal", "large_norm", "outlier", "cancel")
MASKS = ("none", "causal", "padding")
PRECISIONS = (
    "default",
    "high",
    "highest",
    "BF16_BF16_F32",
    "BF16_BF16_F32_X3",
    "BF16_BF16_F32_X6",
    "TF32_TF32_F32",
)
"""``jax.default_matmul_precision`` settings: the three levels and four explicit dot algorithms."""

_ALGORITHM_DOT = {
    "BF16_BF16_F32": {"dot": "bf16x1"},
    "BF16_BF16_F32_X3": {"dot": "bf16x3"},
    "BF16_BF16_F32_X6": {"dot": "bf16x6"},
    "TF32_TF32_F32": {"operand_format": "tf32"},
}
IMPLEMENTATIONS = ("mhanum", "xla", "cudnn")
DTYPES = ("float32", "bfloat16", "float16")
PLATFORMS = ("cpu", "gpu", "tpu")

LARGE_NORM_LOGIT = 40.0
"""``large_norm``: q and k are scaled so that the largest ``|scale·q·k|`` is this."""
OUTLIER_FACTOR = 100.0
"""``outlier``: the outlier channels of q, k and v are this many times larger."""
OUTLIER_CHANNELS = 2
OUTLIER_LOGIT = 20.0
"""``outlier``: q and k are scaled down (together) so that no logit exceeds this."""
CANCEL_OFFSET = 100.0
"""``cancel``: each value row is ``±CANCEL_OFFSET`` (balanced signs) plus N(0, 1) noise."""
CANCEL_QK = 0.1
"""``cancel``: q and k are N(0, CANCEL_QK²), so the probabilities are nearly uniform."""
ONLINE_BLOCK = 64
"""The key-block size assumed for cuDNN's flash attention (an assumption, recorded)."""
BOUND_RTOL = 1e-9
"""A recomputed bound farther than this (relative) from the recorded one: "inconsistent"."""
BOUND_REVISION = 3
"""The revision of Theorem A.1's evaluation that records are written with. A record of an
earlier revision (no ``bound.revision``: 1) whose bound differs from today's is ``stale``, not
``inconsistent``: see :func:`check`. Revision 2: per-key logit errors (Lemma 4), weighted softmax
sum errors and telescoped online rescalings (papers/attention.md). Revision 3: exact per-key
extremes (Lemma 4), the float64 evaluation error in the logits, range proved on the values
(papers/attention.md, R), division modelled as a product with the reciprocal."""


# Inputs -------------------------------------------------------------------------------------------


def _shape(shape: Sequence[int]) -> tuple[int, int, int, int]:
    dims = tuple(shape)
    if len(dims) != 4 or not all(isinstance(n, int) and n >= 1 for n in dims):
        msg = f"shape: expected (batch, heads, length, d) of positive ints, got {shape!r}"
        raise InvalidArgument(msg)
    b, h, n, d = dims
    return b, h, n, d


def _choice(value: Any, name: str, allowed: Sequence[str]) -> str:
    if value not in allowed:
        msg = f"{name}: expected one of {tuple(allowed)}, got {value!r}"
        raise InvalidArgument(msg)
    return str(value)


def inputs(
    shape: Sequence[int], dtype: str, structure: str, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Deterministic attention inputs ``q, k, v`` of shape ``(batch, heads, length, d)``.

    Generated in float64 by numpy's ``Generator(PCG64(seed))`` (never the JAX RNG, so any machine
    regenerates the same values) and rounded to nearest into ``dtype``:

    * ``"normal"``: q, k, v ~ N(0, 1);
    * ``"large_norm"``: as normal, with q and k scaled by one common factor so that the largest
      logit ``|q·k|/sqrt(d)`` of the float64 values is :data:`LARGE_NORM_LOGIT` (40): the softmax
      is nearly one-hot and the logit errors are amplified by ``exp``;
    * ``"outlier"``: :data:`OUTLIER_CHANNELS` channels (drawn from the same generator) of q, k
      and v are :data:`OUTLIER_FACTOR` (100) times larger, as the outlier features of large
      models; q and k are then scaled by one common factor so that no logit exceeds
      :data:`OUTLIER_LOGIT` (20);
    * ``"cancel"``: q, k ~ N(0, 0.1²) (nearly uniform probabilities) and each row of v is
      ``±100`` (half the keys of each sign, in random order) plus N(0, 1) noise: the outputs
      ``Σ_j p_ij v_j`` cancel to a small fraction of ``Σ_j p_ij |v_j|``.

    Args:
        shape: ``(batch, heads, length, d)``; the same length for queries and keys.
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        structure: one of :data:`STRUCTURES`.
        seed: a nonnegative int.

    Returns:
        ``(q, k, v)``, numpy arrays of ``dtype`` (ml_dtypes for bfloat16), in mhanum's layout.

    Raises:
        InvalidArgument: for an unknown dtype or structure, or a bad shape or seed.

    Examples:
        >>> q, k, v = inputs((1, 2, 8, 4), "bfloat16", "normal", 0)
        >>> q.shape, str(q.dtype)
        ((1, 2, 8, 4), 'bfloat16')
    """
    b, h, n, d = _shape(shape)
    fmt = get_format(_choice(dtype, "dtype", DTYPES))
    _choice(structure, "structure", STRUCTURES)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        msg = f"seed: expected an int >= 0, got {seed!r}"
        raise InvalidArgument(msg)
    rng = np.random.Generator(np.random.PCG64(seed))
    q, k, v = (rng.standard_normal((b, h, n, d)) for _ in range(3))
    if structure == "large_norm":
        c = math.sqrt(LARGE_NORM_LOGIT / _max_logit(q, k))
        q, k = q * c, k * c
    elif structure == "outlier":
        channels = rng.choice(d, size=min(OUTLIER_CHANNELS, d), replace=False)
        for x in (q, k, v):
            x[..., channels] *= OUTLIER_FACTOR
        c = math.sqrt(min(1.0, OUTLIER_LOGIT / _max_logit(q, k)))
        q, k = q * c, k * c
    elif structure == "cancel":
        q, k = q * CANCEL_QK, k * CANCEL_QK
        signs = np.where(np.arange(n) % 2 == 0, 1.0, -1.0)
        order = np.argsort(rng.random((b, h, n)), axis=-1)
        v = CANCEL_OFFSET * signs[order][..., None] + v
    q, k, v = (round_to(x, fmt).astype(fmt.numpy_dtype) for x in (q, k, v))
    return q, k, v


def _max_logit(q: np.ndarray, k: np.ndarray) -> float:
    return float(np.max(np.abs(q @ np.swapaxes(k, -1, -2)))) / math.sqrt(q.shape[-1])


def mask_array(kind: str, length: int) -> np.ndarray | None:
    """The boolean mask (True = attend) of shape ``(1, 1, length, length)``, or ``None``.

    ``"causal"``: key ``j`` attended by query ``i`` iff ``j <= i``. ``"padding"``: the last
    ``length // 4`` keys are padding (key ``j`` attended iff ``j < length - length // 4``), what
    ``jax.nn.dot_product_attention(key_value_seq_lengths=...)`` masks.
    """
    _choice(kind, "mask", MASKS)
    if kind == "none":
        return None
    if kind == "causal":
        keep = np.tril(np.ones((length, length), bool))
    else:
        keep = np.broadcast_to(np.arange(length) < _padding_length(length), (length, length))
    return np.array(keep)[None, None]


def _padding_length(length: int) -> int:
    return length - length // 4


def _digest(*arrays: np.ndarray) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(str(a.dtype).encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


# Models -------------------------------------------------------------------------------------------

_XLA_HALF = {
    "score_format": "float32",
    "softmax_format": "float32",
    "mask_value": "0.7*finfo.min",
}
_TPU_DOT = {"default": "bf16x1", "high": "bf16x3", "highest": "bf16x6"}


def _numerics(fields: Mapping[str, Any]) -> Numerics:
    """A :class:`Numerics` from a field dict; a field this mhanum lacks is a clear error."""
    known = {f.name for f in dataclasses.fields(Numerics)}
    unknown = sorted(set(fields) - known)
    if unknown:
        msg = (
            f"numerics: expected fields of this mhanum's Numerics, got unknown {unknown} "
            "(a newer mhanum wrote them)"
        )
        raise InvalidArgument(msg)
    return Numerics(**fields)


def model_for(
    implementation: str, dtype: str, precision: str, platform: str, preset: str | None = None
) -> tuple[str, Numerics]:
    """The :class:`Numerics` a computation is checked under, and a short label for it.

    The table (``docs/devices.md`` gives the evidence for each row):

    * ``"mhanum"``: the preset itself (mhanum runs every dot at ``Precision.HIGHEST`` and rounds
      what the preset names, so the precision setting must not change it).
    * ``"xla"`` (``jax.nn.dot_product_attention``, ``_dot_product_attention_core``): logits by an
      einsum into float32 (``promote_types(dtype, float32)``; bf16/fp16 with the algorithm
      ``BF16_BF16_F32``/``F16_F16_F32``: exact products, float32 accumulation), scaled in float32,
      masked by filling ``-0.7·finfo(float32).max``, softmax in float32 (max-shifted),
      probabilities cast to the input dtype, ``P V`` in the input dtype (float32 accumulation)
      and its result in the input dtype. float32 inputs: all in float32, except the dots, which
      follow ``jax.default_matmul_precision``: on GPU ``default``/``high`` use TF32 operands
      (``operand_format="tf32"``), ``highest`` float32; on TPU ``default``/``high``/``highest``
      are 1/3/6 bfloat16 passes (``dot="bf16x1"``/``"bf16x3"``/``"bf16x6"``); CPU ignores it.
      bf16/fp16 inputs have a fixed algorithm: the precision does not apply.
    * ``"cudnn"`` (GPU, bf16/fp16 only): the bf16/fp16 xla model with the online softmax of
      FlashAttention over key blocks of :data:`ONLINE_BLOCK` (an assumption about cuDNN's tiling).

    Args:
        implementation: ``"mhanum"``, ``"xla"`` or ``"cudnn"``.
        dtype: the input dtype, ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        precision: ``"default"``, ``"high"``, ``"highest"`` or an explicit dot algorithm
            (``"BF16_BF16_F32"``, ``"BF16_BF16_F32_X3"``, ``"BF16_BF16_F32_X6"`` → ``dot=
            "bf16x1"/"bf16x3"/"bf16x6"``; ``"TF32_TF32_F32"`` → ``operand_format="tf32"``), the
            same on every platform.
        platform: ``"cpu"``, ``"gpu"`` or ``"tpu"``.
        preset: the preset name (required for ``"mhanum"``, ignored otherwise).

    Returns:
        ``(label, numerics)``.

    Raises:
        InvalidArgument: for an unknown argument, a ``"mhanum"`` model without a known preset,
            ``"cudnn"`` outside a GPU or with float32 inputs, or a TPU float32 model on an mhanum
            whose ``Numerics`` has no ``dot`` field.
    """
    impl = _choice(implementation, "implementation", IMPLEMENTATIONS)
    _choice(dtype, "dtype", DTYPES)
    _choice(precision, "precision", PRECISIONS)
    _choice(platform, "platform", PLATFORMS)
    if impl == "mhanum":
        if preset not in PRESETS:
            msg = f"preset: expected one of {tuple(PRESETS)} for 'mhanum', got {preset!r}"
            raise InvalidArgument(msg)
        assert preset is not None
        return preset, PRESETS[preset]
    if impl == "cudnn" and (platform != "gpu" or dtype == "float32"):
        msg = (
            "implementation: cudnn runs on a GPU with bfloat16 or float16 inputs, got "
            f"{dtype} on {platform}"
        )
        raise InvalidArgument(msg)
    short = {"float32": "f32", "bfloat16": "bf16", "float16": "fp16"}[dtype]
    if dtype != "float32":
        fields: dict[str, Any] = {
            "input": dtype,
            "accum": "float32",
            **_XLA_HALF,
            "prob_format": dtype,
            "output_format": dtype,
        }
        if impl == "cudnn":
            fields["softmax"] = f"online({ONLINE_BLOCK})"
            return f"cudnn-{short}-online{ONLINE_BLOCK}", _numerics(fields)
        return f"xla-{short}", _numerics(fields)
    fields = {"input": "float32", "accum": "float32", "mask_value": "0.7*finfo.min"}
    if precision in _ALGORITHM_DOT:
        unit = _ALGORITHM_DOT[precision]
        label = unit.get("dot") or "tf32"
        return f"xla-f32-{label}", _numerics({**fields, **unit})
    if platform == "gpu" and precision != "highest":
        return "xla-f32-tf32", _numerics({**fields, "operand_format": "tf32"})
    if platform == "tpu":
        dot = _TPU_DOT[precision]
        return f"xla-f32-{dot}", _numerics({**fields, "dot": dot})
    return "xla-f32", _numerics(fields)


def _numerics_dict(num: Numerics) -> dict[str, Any]:
    return {f.name: getattr(num, f.name) for f in dataclasses.fields(num)}


# Grid ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Grid:
    """What :func:`measure` runs: every combination of these, where it makes sense.

    ``precisions`` apply to float32 inputs only (bf16/fp16 dots have a fixed algorithm in
    ``jax.nn`` and are recorded as ``"default"``). A preset runs on the dtype that stores its
    input format (``fp32``/``tf32`` on float32, ``bf16-fp32acc`` on bfloat16, ...), or on float32
    when the grid has no such dtype (float8 presets then round float32 inputs).

    Attributes:
        shapes: ``(batch, heads, length, d)`` tuples.
        dtypes: input dtypes (:data:`DTYPES`).
        structures: input structures (:data:`STRUCTURES`).
        masks: mask kinds (:data:`MASKS`).
        precisions: ``jax.default_matmul_precision`` settings (:data:`PRECISIONS`).
        implementations: :data:`IMPLEMENTATIONS`.
        presets: the presets run by the ``"mhanum"`` implementation.
        seeds: input seeds.
        exp: whether to add the ``"exp"`` record of the backend.
    """

    shapes: tuple[tuple[int, int, int, int], ...]
    dtypes: tuple[str, ...]
    structures: tuple[str, ...]
    masks: tuple[str, ...]
    precisions: tuple[str, ...]
    implementations: tuple[str, ...]
    presets: tuple[str, ...]
    seeds: tuple[int, ...] = (0,)
    exp: bool = True

    def __post_init__(self) -> None:
        for s in self.shapes:
            _shape(s)
        for field, allowed in (
            ("dtypes", DTYPES),
            ("structures", STRUCTURES),
            ("masks", MASKS),
            ("precisions", PRECISIONS),
            ("implementations", IMPLEMENTATIONS),
            ("presets", tuple(PRESETS)),
        ):
            for value in getattr(self, field):
                _choice(value, f"grid.{field}", allowed)

    @classmethod
    def default(cls) -> Grid:
        """A small grid that runs on a CPU in about a minute (2 cores)."""
        return cls(
            shapes=((1, 2, 32, 16),),
            dtypes=("float32", "bfloat16"),
            structures=STRUCTURES,
            masks=MASKS,
            precisions=("default", "highest"),
            implementations=IMPLEMENTATIONS,
            presets=("fp32", "tf32", "bf16-fp32acc"),
        )

    @classmethod
    def gpu(cls) -> Grid:
        """The grid of a GPU session (an H100 with 16 cores: a few minutes)."""
        wanted = (
            "fp32",
            "tf32",
            "bf16-fp32acc",
            "fp16-fp32acc",
            "tpu-bf16-1pass",
            "tpu-bf16-3pass",
            "tpu-bf16-6pass",
            "tensor-core-fp16",
            "tensor-core-bf16",
            "fp8-e4m3-fp32acc",
            "fp8-e5m2-fp32acc",
        )
        return cls(
            shapes=((1, 2, 64, 64), (1, 2, 256, 64)),
            dtypes=("float32", "bfloat16", "float16"),
            structures=("normal", "large_norm", "outlier"),
            masks=("none", "causal"),
            precisions=PRECISIONS,
            implementations=IMPLEMENTATIONS,
            presets=tuple(p for p in wanted if p in PRESETS),
        )

    def with_seeds(self, seeds: Iterable[int]) -> Grid:
        """A copy with other seeds."""
        return dataclasses.replace(self, seeds=tuple(seeds))


@dataclasses.dataclass(frozen=True)
class _Task:
    implementation: str
    preset: str | None
    dtype: str
    precision: str
    shape: tuple[int, int, int, int]
    structure: str
    mask: str
    seed: int

    @property
    def input_key(self) -> tuple[Any, ...]:
        return (self.shape, self.dtype, self.structure, self.seed, self.mask)


def _preset_dtype(preset: str, dtypes: Sequence[str]) -> str:
    storage = PRESETS[preset].storage_format.name
    if storage in dtypes:
        return storage
    return "float32" if "float32" in dtypes else dtypes[0]


def _tasks(grid: Grid) -> list[_Task]:
    out = []
    for shape in grid.shapes:
        for structure in grid.structures:
            for mask in grid.masks:
                for seed in grid.seeds:
                    for dtype in grid.dtypes:
                        precisions = grid.precisions if dtype == "float32" else ("default",)
                        for impl in grid.implementations:
                            presets: Sequence[str | None] = (
                                [p for p in grid.presets if _preset_dtype(p, grid.dtypes) == dtype]
                                if impl == "mhanum"
                                else [None]
                            )
                            for preset in presets:
                                for precision in precisions:
                                    out.append(
                                        _Task(
                                            impl,
                                            preset,
                                            dtype,
                                            precision,
                                            shape,
                                            structure,
                                            mask,
                                            seed,
                                        )
                                    )
    return out


# Running ------------------------------------------------------------------------------------------


def _device(backend: str | None) -> jax.Device:
    name = jax.default_backend() if backend is None else backend
    try:
        return jax.devices(name)[0]
    except RuntimeError as exc:
        msg = f"backend: expected an available JAX backend ({jax.default_backend()!r}), got {name!r}: {exc}"
        raise InvalidArgument(msg) from None


def _environment(device: jax.Device) -> dict[str, Any]:
    import jaxlib

    from mhanum._version import __version__

    return {
        "device": {
            "platform": device.platform,
            "kind": device.device_kind,
            "name": str(device),
        },
        "versions": {
            "jax": jax.__version__,
            "jaxlib": jaxlib.__version__,
            "mhanum": __version__,
            "numpy": np.__version__,
            "python": platform.python_version(),
        },
    }


@functools.partial(jax.jit, static_argnames=("implementation", "causal"))
def _jax_nn(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    kv_lengths: jax.Array | None,
    *,
    implementation: str,
    causal: bool,
) -> jax.Array:
    """``jax.nn.dot_product_attention`` in mhanum's ``(B, N, T, H)`` layout (it uses BTNH)."""
    t = (0, 2, 1, 3)
    out = cast(Any, jax.nn.dot_product_attention)(
        q.transpose(t),
        k.transpose(t),
        v.transpose(t),
        is_causal=causal,
        key_value_seq_lengths=kv_lengths,
        implementation=implementation,
    )
    return out.transpose(t)


def _run(task: _Task, num: Numerics, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """One computation on the default device, compiled and finished; the output on the host."""
    length = task.shape[2]
    with jax.default_matmul_precision(task.precision):
        if task.implementation == "mhanum":
            out = attention(q, k, v, mask_array(task.mask, length), numerics=num)
        else:
            kv = None
            if task.mask == "padding":
                kv = jnp.full((task.shape[0],), _padding_length(length), jnp.int32)
            out = _jax_nn(
                jnp.asarray(q),
                jnp.asarray(k),
                jnp.asarray(v),
                kv,
                implementation=task.implementation,
                causal=task.mask == "causal",
            )
        out = out.block_until_ready()
    return np.asarray(out)


def _reference_job(key: tuple[Any, ...]) -> tuple[np.ndarray, float]:
    """The certified reference of one input (run in a worker process), and its time."""
    shape, dtype, structure, seed, mask = key
    start = time.perf_counter()
    q, k, v = inputs(shape, dtype, structure, seed)
    ref = reference.attention(
        *(np.asarray(x, np.float64) for x in (q, k, v)), mask=mask_array(mask, shape[2])
    )
    assert isinstance(ref, np.ndarray)
    return ref, time.perf_counter() - start


def _bound_numerics(
    num: Numerics, q: np.ndarray, k: np.ndarray, mask: np.ndarray | None
) -> tuple[Numerics, str | None]:
    """The numerics the bound is evaluated with, and why it differs from ``num`` (if it does).

    A finite fill constant gives the same computation as ``-inf`` when every masked key's
    computed probability is exactly 0 (papers/masking.md M.5, assumption U) and the row maximum is
    attended, which holds with at least one attended key per row; then the model is checked with
    ``mask_value=-inf`` (a tighter bound: no leakage term). Otherwise Theorem A.1 bounds the
    leaky computation itself (step 3', term ``mask``).
    """
    if mask is None or num.mask_value == -math.inf:
        return num, None
    scores = np.abs(q) @ np.swapaxes(np.abs(k), -1, -2) / math.sqrt(q.shape[-1])
    score_bound = 2.0 * float(np.max(scores)) + 1.0
    analysis = analyze_numerics(num, score_bound, n_keys=q.shape[-2])
    if analysis.leakage_is_zero and not analysis.overflows and num.mask_mode == "fill":
        reason = (
            f"mask_value {num.mask_value!r} checked as -inf: every masked probability is exactly "
            f"0 for |scores| <= {score_bound:.4g} (papers/masking.md M.5)"
        )
        return num.replace(mask_value=-math.inf), reason
    reason = (
        f"mask_value {num.mask_value!r} may leak (M.5): bounded with the leakage term of "
        "Theorem A.1 (papers/attention.md, step 3')"
    )
    return num, reason


def _bound(
    num: Numerics, q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None
) -> tuple[np.ndarray, dict[str, float], str, str | None]:
    """Theorem A.1 under the model: total, max of each term, dominant term, mask note."""
    checked, note = _bound_numerics(num, q, k, mask)
    b = attention_bound(q, k, v, mask, numerics=checked)
    terms = {name: float(np.max(t)) for name, t in b.terms.items()}
    return np.asarray(b.total, np.float64), terms, b.dominant(), note


def _ratio(err: np.ndarray, bound: np.ndarray) -> float:
    """``max_i err_i / bound_i`` (0/0 is 0, x/0 is inf)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(err == 0, 0.0, err / bound)
    return float(np.max(np.nan_to_num(r, nan=math.inf), initial=0.0))


def _skipped(task: _Task, reason: str, env: Mapping[str, Any]) -> Record:
    return {**_task_fields(task, env), "status": "skipped", "reason": reason}


def _task_fields(task: _Task, env: Mapping[str, Any]) -> Record:
    b, h, n, d = task.shape
    return {
        "schema": SCHEMA,
        "kind": "attention",
        **env,
        "implementation": task.implementation,
        "preset": task.preset,
        "precision": task.precision,
        "dtype": task.dtype,
        "shape": {"batch": b, "heads": h, "length": n, "d": d},
        "structure": task.structure,
        "mask": task.mask,
        "seed": task.seed,
    }


def _measured(
    task: _Task,
    label: str,
    num: Numerics,
    env: Mapping[str, Any],
    data: tuple[np.ndarray, ...],
    out: np.ndarray,
    ref: np.ndarray,
    bound: tuple[np.ndarray, dict[str, float], str, str | None],
    times: Mapping[str, float],
) -> Record:
    q, k, v = data
    total, terms, dominant, note = bound
    out64 = out.astype(np.float64)
    err = errors(out64, ref, fmt=num.format_of("output"))
    with np.errstate(invalid="ignore"):
        diff = np.where(np.isnan(ref), 0.0, np.abs(out64 - ref))
    diff = np.where(np.isfinite(out64) | np.isnan(ref), diff, math.inf)
    bound_max = float(np.max(total))
    at = tuple(err.argmax_abs)
    return {
        **_task_fields(task, env),
        "status": "measured",
        "model": {
            "label": label,
            "numerics": _numerics_dict(num),
            "description": num.describe(),
            "bound_note": note,
        },
        "inputs_sha256": _digest(q, k, v),
        "output_sha256": _digest(out),
        "errors": err.as_dict(),
        "bound": {
            "theorem": "A.1",
            "revision": BOUND_REVISION,
            "max": bound_max,
            "dominant": dominant,
            "at_argmax_error": float(total[at]) if at else 0.0,
            "terms_max": terms,
        },
        "ratio": _ratio(diff, total),
        "tightness": bound_max / err.max_abs if err.max_abs > 0 else math.inf,
        "timing_s": dict(times),
    }


def measure(
    grid: Grid | None = None,
    backend: str | None = None,
    *,
    progress: Callable[[int, int, Record], None] | None = None,
    workers: int | None = None,
) -> list[Record]:
    """Measure every computation of ``grid`` on a JAX backend; one record per measurement.

    Each computation runs jit-compiled on the backend's first device under
    ``jax.default_matmul_precision(precision)`` and is finished with ``block_until_ready``. The
    certified references run on the host in a ``ProcessPoolExecutor(workers)`` (spawned
    processes), one per distinct input, while the backend computes. A computation that cannot
    run (cuDNN off a GPU or on float32, a model this mhanum cannot state, an implementation
    error) gives a record with ``"status": "skipped"`` and the reason. The ``"exp"`` record
    (:func:`exp_record`) comes last when ``grid.exp``.

    Args:
        grid: what to run; default :meth:`Grid.default`.
        backend: ``"cpu"``, ``"gpu"``, ``"tpu"``; default ``jax.default_backend()``.
        progress: called after each record as ``progress(done, total, record)``.
        workers: reference processes; default ``os.cpu_count()``; ``0`` computes the references
            in this process (no pool).

    Returns:
        The records, in grid order.

    Raises:
        InvalidArgument: for an unavailable backend or a bad ``workers``.
    """
    grid = Grid.default() if grid is None else grid
    device = _device(backend)
    n_workers = (os.cpu_count() or 1) if workers is None else workers
    if isinstance(n_workers, bool) or not isinstance(n_workers, int) or n_workers < 0:
        msg = f"workers: expected an int >= 0, got {workers!r}"
        raise InvalidArgument(msg)
    env = _environment(device)
    tasks = _tasks(grid)
    total = len(tasks) + int(grid.exp)
    keys = list(dict.fromkeys(t.input_key for t in tasks))
    records: list[Record] = []
    with _references(keys, n_workers) as refs, jax.default_device(device):
        bounds: dict[tuple[Any, ...], Any] = {}
        for task in tasks:
            record = _measure_task(task, device.platform, env, refs, bounds)
            records.append(record)
            if progress is not None:
                progress(len(records), total, record)
    if grid.exp:
        assumed = min(
            (r["model"]["numerics"]["exp_ulps"] for r in records if r["status"] == "measured"),
            default=Numerics().exp_ulps,
        )
        records.append(exp_record(backend, assumed_ulps=assumed))
        if progress is not None:
            progress(len(records), total, records[-1])
    for i, r in enumerate(records):
        r["id"] = i
    return records


class _References:
    """Certified references by input key, computed in a process pool (or in this process)."""

    def __init__(self, keys: Sequence[tuple[Any, ...]], workers: int) -> None:
        self.pool: concurrent.futures.ProcessPoolExecutor | None = None
        self.futures: dict[tuple[Any, ...], concurrent.futures.Future[Any]] = {}
        self.done: dict[tuple[Any, ...], tuple[np.ndarray, float]] = {}
        self.keys = keys
        if workers > 0 and keys:
            context = multiprocessing.get_context("spawn")  # JAX is multithreaded: never fork
            self.pool = concurrent.futures.ProcessPoolExecutor(
                min(workers, len(keys)), mp_context=context
            )
            self.futures = {key: self.pool.submit(_reference_job, key) for key in keys}

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)

    def get(self, key: tuple[Any, ...]) -> tuple[np.ndarray, float]:
        if key not in self.done:
            future = self.futures.get(key)
            self.done[key] = future.result() if future is not None else _reference_job(key)
        return self.done[key]


def _references(keys: Sequence[tuple[Any, ...]], workers: int) -> _References:
    return _References(keys, workers)


def _measure_task(
    task: _Task,
    platform_name: str,
    env: Mapping[str, Any],
    refs: _References,
    bounds: dict[tuple[Any, ...], Any],
) -> Record:
    try:
        label, num = model_for(
            task.implementation, task.dtype, task.precision, platform_name, task.preset
        )
    except InvalidArgument as exc:
        return _skipped(task, str(exc), env)
    q, k, v = inputs(task.shape, task.dtype, task.structure, task.seed)
    start = time.perf_counter()
    try:
        out = _run(task, num, q, k, v)
    except Exception as exc:  # noqa: BLE001 (an implementation refusing a case is a result)
        return _skipped(task, f"{type(exc).__name__}: {exc}", env)
    compute = time.perf_counter() - start
    data = tuple(np.asarray(x, np.float64) for x in (q, k, v))
    mask = mask_array(task.mask, task.shape[2])
    start = time.perf_counter()
    key = (task.input_key, num)
    if key not in bounds:
        bounds[key] = _bound(num, data[0], data[1], data[2], mask)
    bound_s = time.perf_counter() - start
    ref, ref_s = refs.get(task.input_key)
    times = {"compute": compute, "bound": bound_s, "reference": ref_s}
    return _measured(task, label, num, env, (q, k, v), out, ref, bounds[key], times)


# exp ----------------------------------------------------------------------------------------------

EXP_RANGES = ((-104.0, 0.0), (-88.0, 88.0))
"""Ranges sampled densely: the shifted logits of a float32 softmax, and exp's whole finite range."""
EXP_DENSE = 2**20
"""Points per dense range (evenly spaced, rounded to float32)."""
EXP_ALL = ((-1.0, -0.5), (0.5, 1.0), (2.0**-10, 2.0**-9), (-88.0, -86.0))
"""Intervals in which every float32 value is measured (two binades near 0, one small binade, and
the values around -87.3, where float32 exp leaves the normal range)."""


def _float32_between(lo: float, hi: float) -> np.ndarray:
    """Every float32 value in ``[lo, hi)``."""
    a, b = np.float32(lo), np.float32(hi)
    if lo >= 0:
        bits = np.arange(a.view(np.uint32), b.view(np.uint32), dtype=np.uint32)
    else:  # negative floats: the bit pattern grows as the value falls
        bits = np.arange(
            (-b).view(np.uint32) + (1 if hi <= 0 else 0), (-a).view(np.uint32) + 1, dtype=np.uint32
        )
        return -bits.view(np.float32)
    return bits.view(np.float32)


def _exp_points() -> Iterable[np.ndarray]:
    for lo, hi in EXP_RANGES:
        yield np.linspace(lo, hi, EXP_DENSE).astype(np.float32)
    for lo, hi in EXP_ALL:
        x = _float32_between(lo, hi)
        for start in range(0, x.size, 2**22):
            yield x[start : start + 2**22]


@jax.jit
def _exp(x: jax.Array) -> jax.Array:
    return jnp.exp(x)


def _exact_exp_ulps(x: float, y: float) -> tuple[float, float]:
    """(ulps of float32 at exp(x), |y - exp(x)|) with exp(x) from mpmath at 80 bits."""
    ctx = mpmath.MPContext()
    ctx.prec = 80
    e = ctx.exp(ctx.mpf(float(x)))
    diff = abs(ctx.mpf(float(y)) - e)
    _, exponent = ctx.frexp(e)
    ulp = ctx.ldexp(1, max(int(exponent) - 1, -126) - 23)
    return float(diff / ulp), float(diff)


def exp_record(backend: str | None = None, *, assumed_ulps: float | None = None) -> Record:
    """The accuracy of ``jnp.exp`` in float32 on a backend, as an ``"exp"`` record.

    Every bound assumes ``exp`` within ``Numerics.exp_ulps`` ulps of the softmax format (and an
    absolute error below ``2^-126`` where the result leaves the normal range, XLA's flush to
    zero). This measures it on :data:`EXP_RANGES` densely and on every float32 value of
    :data:`EXP_ALL`, against float64 ``exp`` (whose error is below ``2^-29`` float32 ulps); the
    64 worst points are re-measured against mpmath at 80 bits, and the worst of those is reported.

    Returns:
        A record with ``max_ulps`` (ulps of float32 at the exact value, normal results),
        ``max_abs_subnormal_in_eta`` (the largest error where ``exp(x) < 2^-126``, in units of
        ``2^-126``), ``exp_zero_is_one``, and ``assumed_exp_ulps``.
    """
    device = _device(backend)
    assumed = Numerics().exp_ulps if assumed_ulps is None else float(assumed_ulps)
    tiny = 2.0**-126
    worst: list[tuple[float, float, float]] = []
    worst_tiny = (0.0, 0.0)
    n_points = 0
    start = time.perf_counter()
    with jax.default_device(device):
        one = float(np.asarray(_exp(jnp.zeros((1,), jnp.float32)))[0])
        for x in _exp_points():
            y = np.asarray(_exp(jnp.asarray(x))).astype(np.float64)
            ref = np.exp(x.astype(np.float64))
            diff = np.abs(y - ref)
            normal = ref >= tiny
            _, e = np.frexp(ref)
            ulps = np.where(normal, diff / np.ldexp(1.0, np.maximum(e - 1, -126) - 23), 0.0)
            top = np.argpartition(ulps, -64)[-64:] if ulps.size > 64 else range(ulps.size)
            worst.extend((float(ulps[i]), float(x[i]), float(y[i])) for i in top)
            worst = sorted(worst)[-64:]
            small = np.where(normal, 0.0, diff / tiny)
            i = int(np.argmax(small))
            if small[i] > worst_tiny[0]:
                worst_tiny = (float(small[i]), float(x[i]))
            n_points += x.size
    exact = [(_exact_exp_ulps(x, y)[0], x, y) for _, x, y in worst]
    max_ulps, arg, value = max(exact)
    return {
        "schema": SCHEMA,
        "kind": "exp",
        **_environment(device),
        "status": "measured",
        "dtype": "float32",
        "ranges": [list(r) for r in EXP_RANGES],
        "dense_points": EXP_DENSE,
        "all_values_in": [list(r) for r in EXP_ALL],
        "n_points": n_points,
        "max_ulps": max_ulps,
        "argmax_x": arg,
        "argmax_x_hex": float(arg).hex(),
        "computed_at_argmax": value,
        "max_abs_subnormal_in_eta": worst_tiny[0],
        "argmax_subnormal_x": worst_tiny[1],
        "exp_zero_is_one": one == 1.0,
        "assumed_exp_ulps": assumed,
        "timing_s": {"exp": time.perf_counter() - start},
    }


# Records on disk ----------------------------------------------------------------------------------


def write_records(
    path: str | os.PathLike[str], records: Iterable[Record], *, force: bool = False
) -> Path:
    """Write records as JSON lines (one object per line); never overwrite without ``force``.

    Non-finite floats are written as Python's ``json`` writes them (``Infinity``, ``NaN``).

    Raises:
        InvalidArgument: if ``path`` exists and ``force`` is false, or a record is not a dict.
    """
    p = Path(path)
    if p.exists() and not force:
        msg = f"out: expected a new file, got existing {str(p)!r} (pass force=True / --force to overwrite)"
        raise InvalidArgument(msg)
    lines = []
    for i, r in enumerate(records):
        if not isinstance(r, dict):
            msg = f"records[{i}]: expected a dict, got {type(r).__name__}"
            raise InvalidArgument(msg)
        lines.append(json.dumps(r, sort_keys=True))
    p.write_text("".join(line + "\n" for line in lines))
    return p


def read_records(path: str | os.PathLike[str]) -> list[Record]:
    """Read records written by :func:`write_records` (from any machine).

    Raises:
        InvalidArgument: for a missing file, a line that is not a JSON object, or a record of
            another schema version than :data:`SCHEMA`.
    """
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        msg = f"records: expected a readable file, got {str(p)!r}: {exc.strerror}"
        raise InvalidArgument(msg) from None
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            msg = f"records: expected JSON on line {number} of {str(p)!r}, got an error: {exc}"
            raise InvalidArgument(msg) from None
        if not isinstance(record, dict):
            msg = f"records: expected a JSON object on line {number}, got {type(record).__name__}"
            raise InvalidArgument(msg)
        _check_schema(record, f"line {number}")
        records.append(record)
    return records


def _check_schema(record: Mapping[str, Any], where: str) -> None:
    if record.get("schema") != SCHEMA:
        msg = (
            f"records: expected schema {SCHEMA!r} at {where}, got {record.get('schema')!r} "
            "(written by another mhanum version?)"
        )
        raise InvalidArgument(msg)


# Checking -----------------------------------------------------------------------------------------

VERDICTS = ("holds", "stale", "VIOLATED", "inconsistent", "vacuous", "exp-assumption", "skipped")
FAILING = ("VIOLATED", "inconsistent", "exp-assumption")


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The verdict on one record.

    Attributes:
        id: the record's ``id`` (its index when it has none).
        verdict: one of ``holds``, ``VIOLATED``, ``inconsistent``, ``vacuous``, ``exp-assumption``
            (the measured exp is less accurate than assumed), ``skipped`` (nothing measured).
        ratio: the largest ``err/bound`` the record supports (``max`` of its recorded per-entry
            ratio and its max error over the recomputed bound at that entry); NaN if none.
        tightness: recorded max bound over max error; NaN if none.
        reason: why, in words.
    """

    id: int
    verdict: str
    ratio: float
    tightness: float
    reason: str


@dataclasses.dataclass(frozen=True)
class CheckResult:
    """Verdicts of :func:`check` and their summary."""

    verdicts: tuple[Verdict, ...]
    summary: tuple[dict[str, Any], ...]

    @property
    def counts(self) -> dict[str, int]:
        """How many records got each verdict."""
        return {v: sum(x.verdict == v for x in self.verdicts) for v in VERDICTS}

    @property
    def ok(self) -> bool:
        """No violation, inconsistency or failed exp assumption."""
        return not any(v.verdict in FAILING for v in self.verdicts)

    @property
    def exit_code(self) -> int:
        """0 when :attr:`ok`, else 1."""
        return 0 if self.ok else 1

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {
            "ok": self.ok,
            "counts": self.counts,
            "summary": list(self.summary),
            "verdicts": [dataclasses.asdict(v) for v in self.verdicts],
        }

    def render(self) -> str:
        """The summary table and every record whose verdict is not ``holds``, as text."""
        lines = [render_summary(self.summary)]
        for v in self.verdicts:
            if v.verdict not in ("holds", "skipped", "stale"):
                lines.append(f"record {v.id}: {v.verdict}: {v.reason}")
        counts = ", ".join(f"{n} {v}" for v, n in self.counts.items() if n)
        lines.append(f"{len(self.verdicts)} records: {counts}")
        return "\n".join(lines)


def check(records: Sequence[Record]) -> CheckResult:
    """Judge each record by recomputing its bound on this machine.

    For an ``"attention"`` record: regenerate the inputs (:func:`inputs`, :func:`mask_array`)
    from the record's shape, dtype, structure, seed and mask; if their SHA-256 differs from the
    recorded one the record cannot be checked (``inconsistent``). Recompute Theorem A.1 from the
    record's ``model.numerics``; a bound ``inf`` anywhere is ``vacuous``; a recomputed maximum
    more than :data:`BOUND_RTOL` (relative) from the recorded one is ``inconsistent`` for a record
    of the current :data:`BOUND_REVISION`. Otherwise the ratio is the larger of the recorded
    ``max_i err_i/bound_i`` and the recorded maximum error over the recomputed bound at its entry:
    above 1 is ``VIOLATED``, else ``holds``. A record of an earlier revision whose bound changed
    is ``stale`` when both ratios are at most 1: it holds against the bound it was measured with
    (also a theorem) and at its largest error against today's, but the record keeps no per-entry
    errors, so only a new measurement judges every entry against today's bound.

    An ``"exp"`` record is ``exp-assumption`` when its ``max_ulps`` exceeds the smallest
    ``exp_ulps`` assumed by a measured record of the same device (or the record's own
    ``assumed_exp_ulps``), when an exp result below ``2^-126`` is off by more than ``2^-126``,
    or when ``exp(0) != 1``.

    Raises:
        InvalidArgument: for a record of another schema or one missing a field.
    """
    verdicts = []
    for i, record in enumerate(records):
        if not isinstance(record, Mapping):
            msg = f"records[{i}]: expected a dict, got {type(record).__name__}"
            raise InvalidArgument(msg)
        _check_schema(record, f"records[{i}]")
        rid = int(record.get("id", i))
        try:
            if record["kind"] == "exp":
                verdicts.append(_check_exp(rid, record, records))
            elif record.get("status") != "measured":
                reason = str(record.get("reason", "not measured"))
                verdicts.append(Verdict(rid, "skipped", math.nan, math.nan, reason))
            else:
                verdicts.append(_check_attention(rid, record))
        except KeyError as exc:
            msg = f"records[{i}]: expected the field {exc.args[0]!r}, got a record without it"
            raise InvalidArgument(msg) from None
    return CheckResult(tuple(verdicts), summarize(records, verdicts))


def _check_attention(rid: int, record: Mapping[str, Any]) -> Verdict:
    s = record["shape"]
    shape = (s["batch"], s["heads"], s["length"], s["d"])
    tightness = float(record["tightness"])
    q, k, v = inputs(shape, record["dtype"], record["structure"], record["seed"])
    if _digest(q, k, v) != record["inputs_sha256"]:
        reason = "the regenerated inputs differ from the recorded ones (sha256)"
        return Verdict(rid, "inconsistent", math.nan, tightness, reason)
    num = _numerics(record["model"]["numerics"])
    data = tuple(np.asarray(x, np.float64) for x in (q, k, v))
    total, _, _, _ = _bound(num, data[0], data[1], data[2], mask_array(record["mask"], shape[2]))
    recomputed = float(np.max(total))
    recorded = float(record["bound"]["max"])
    err = record["errors"]
    if not math.isfinite(recomputed):
        return Verdict(rid, "vacuous", math.nan, tightness, "the bound is inf for some entry")
    changed = not abs(recorded - recomputed) <= BOUND_RTOL * abs(recomputed)
    revision = int(record["bound"].get("revision", 1))
    if changed and revision >= BOUND_REVISION:
        reason = f"recorded bound {recorded!r}, recomputed {recomputed!r}"
        return Verdict(rid, "inconsistent", math.nan, tightness, reason)
    at = tuple(err["argmax_abs"])
    at_bound = float(total[at]) if at else 0.0
    max_abs = float(err["max_abs"])
    at_ratio = 0.0 if max_abs == 0 else (max_abs / at_bound if at_bound > 0 else math.inf)
    ratio = max(float(record["ratio"]), at_ratio)
    if ratio > 1:
        reason = f"error/bound = {ratio:.4g} > 1 (max error {max_abs:.4g} at {list(at)})"
        return Verdict(rid, "VIOLATED", ratio, tightness, reason)
    if changed:
        reason = (
            f"bound revision {revision} < {BOUND_REVISION}: recorded bound {recorded:.4g}, today "
            f"{recomputed:.4g}; holds against the recorded bound ({float(record['ratio']):.4g}) "
            f"and at the largest error against today's ({at_ratio:.4g}); re-measure to judge "
            "every entry"
        )
        return Verdict(rid, "stale", ratio, tightness, reason)
    return Verdict(rid, "holds", ratio, tightness, f"error/bound = {ratio:.4g}")


def _check_exp(rid: int, record: Mapping[str, Any], records: Sequence[Record]) -> Verdict:
    device = record["device"]
    assumed = min(
        (
            float(r["model"]["numerics"]["exp_ulps"])
            for r in records
            if r.get("kind") == "attention"
            and r.get("status") == "measured"
            and r.get("device") == device
        ),
        default=float(record["assumed_exp_ulps"]),
    )
    measured = float(record["max_ulps"])
    problems = []
    if measured > assumed:
        problems.append(f"max {measured:.4g} ulps > assumed exp_ulps {assumed:g}")
    if float(record["max_abs_subnormal_in_eta"]) > 1:
        problems.append("an exp result below 2^-126 is off by more than 2^-126")
    if not record["exp_zero_is_one"]:
        problems.append("exp(0) != 1")
    if problems:
        return Verdict(rid, "exp-assumption", measured, math.nan, "; ".join(problems))
    reason = f"max {measured:.4g} ulps <= assumed exp_ulps {assumed:g} on {device['kind']}"
    return Verdict(rid, "holds", measured, math.nan, reason)


# Summary ------------------------------------------------------------------------------------------


def summarize(
    records: Sequence[Record], verdicts: Sequence[Verdict] | None = None
) -> tuple[dict[str, Any], ...]:
    """One row per device × implementation × precision × model: count, worst ratio, tightness.

    Without ``verdicts`` the recorded ratios are used (as :func:`measure` wrote them).
    """
    groups: dict[tuple[str, ...], list[tuple[Record, Verdict | None]]] = {}
    for i, r in enumerate(records):
        if r.get("kind") != "attention":
            continue
        label = r["model"]["label"] if r.get("status") == "measured" else "-"
        key = (r["device"]["kind"], r["implementation"], r["precision"], label)
        groups.setdefault(key, []).append((r, None if verdicts is None else verdicts[i]))
    rows = []
    for (device, impl, precision, label), members in groups.items():
        measured = [(r, v) for r, v in members if r.get("status") == "measured"]
        ratios = [
            v.ratio if v is not None and not math.isnan(v.ratio) else float(r["ratio"])
            for r, v in measured
        ]
        tight = [float(r["tightness"]) for r, _ in measured]
        row: dict[str, Any] = {
            "device": device,
            "implementation": impl,
            "precision": precision,
            "model": label,
            "count": len(measured),
            "skipped": len(members) - len(measured),
            "worst_ratio": max(ratios, default=math.nan),
            "median_tightness": statistics.median(tight) if tight else math.nan,
        }
        if verdicts is not None:
            row["failing"] = sum(v is not None and v.verdict in FAILING for _, v in members)
        rows.append(row)
    return tuple(rows)


def render_summary(rows: Sequence[Mapping[str, Any]]) -> str:
    """The summary rows as a plain-text table."""
    has_failing = any("failing" in r for r in rows)
    header = (
        f"{'device':<14} {'implementation':<14} {'precision':<9} {'model':<24} "
        f"{'n':>4} {'skip':>4} {'worst err/bound':>15} {'median bound/err':>16}"
        + (f" {'failing':>7}" if has_failing else "")
    )
    lines = [header]
    for r in rows:
        lines.append(
            f"{r['device'][:14]:<14} {r['implementation']:<14} {r['precision']:<9} "
            f"{r['model'][:24]:<24} {r['count']:>4} {r['skipped']:>4} "
            f"{r['worst_ratio']:>15.4g} {r['median_tightness']:>16.4g}"
            + (f" {r.get('failing', 0):>7}" if has_failing else "")
        )
    return "\n".join(lines)
