"""Measuring: a :class:`Grid` of shapes, dtypes, structures and masks run on a JAX backend."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Self, cast

import jax
import jax.numpy as jnp
import numpy as np

from mhanum import parallel, reference
from mhanum._errors import InvalidArgument
from mhanum.bounds.forward import attention_bound
from mhanum.bounds.masking import analyze_numerics
from mhanum.devices.exp import exp_record
from mhanum.devices.platforms import (
    IMPLEMENTATIONS,
    PRECISIONS,
    device_for,
    environment,
    model_for,
)
from mhanum.devices.records import BOUND_REVISION, SCHEMA, Record
from mhanum.emulate.attention import attention
from mhanum.inputs import (
    DTYPES,
    MASKS,
    STRUCTURES,
    check_choice,
    check_shape,
    digest,
    inputs,
    mask_array,
    padding_length,
)
from mhanum.metrics import errors
from mhanum.numerics import PRESETS, Numerics

__all__ = ["Grid", "measure", "record_bound"]


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
            check_shape(s)
        for field, allowed in (
            ("dtypes", DTYPES),
            ("structures", STRUCTURES),
            ("masks", MASKS),
            ("precisions", PRECISIONS),
            ("implementations", IMPLEMENTATIONS),
            ("presets", tuple(PRESETS)),
        ):
            for value in getattr(self, field):
                check_choice(value, f"grid.{field}", allowed)

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
                kv = jnp.full((task.shape[0],), padding_length(length), jnp.int32)
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


def record_bound(
    num: Numerics, q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None
) -> tuple[np.ndarray, dict[str, float], str, str | None]:
    """Theorem A.1 under the model: total, max of each term, dominant term, mask note."""
    checked, note = _bound_numerics(num, q, k, mask)
    # a device's kernel follows its model only to within step 6's charge for the rounded
    # weights (mhanum.testing.Kernel.known_rounding): steps 6k and 6r are not taken
    b = attention_bound(q, k, v, mask, numerics=checked, known_rounding=False)
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
            "numerics": num.to_dict(),
            "description": num.describe(),
            "bound_note": note,
        },
        "inputs_sha256": digest(q, k, v),
        "output_sha256": digest(out),
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
    executor: object = None,
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
        executor: where the references run instead of a pool of ``workers``: a
            ``concurrent.futures.Executor`` or a ``distributed.Client`` (:mod:`mhanum.parallel`;
            a Dask cluster's workers, say). The backend's computations stay in this process.

    Returns:
        The records, in grid order.

    Raises:
        InvalidArgument: for an unavailable backend, a bad ``workers``, or ``workers`` and
            ``executor`` together.
    """
    grid = Grid.default() if grid is None else grid
    device = device_for(backend)
    n_workers = (os.cpu_count() or 1) if workers is None else workers
    if isinstance(n_workers, bool) or not isinstance(n_workers, int) or n_workers < 0:
        msg = f"workers: expected an int >= 0, got {workers!r}"
        raise InvalidArgument(msg)
    if executor is not None and workers is not None:
        msg = "workers: expected None with an executor (the executor runs the references)"
        raise InvalidArgument(msg)
    pool = None if executor is None else parallel.as_executor(executor)
    env = environment(device)
    tasks = _tasks(grid)
    total = len(tasks) + int(grid.exp)
    keys = list(dict.fromkeys(t.input_key for t in tasks))
    records: list[Record] = []
    with _References(keys, n_workers, pool) as refs, jax.default_device(device):
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
    """Certified references by input key, computed on an executor (a process pool of its own
    by default, or in this process)."""

    def __init__(
        self,
        keys: Sequence[tuple[Any, ...]],
        workers: int,
        executor: concurrent.futures.Executor | None = None,
    ) -> None:
        self.pool: concurrent.futures.ProcessPoolExecutor | None = None
        self.futures: dict[tuple[Any, ...], concurrent.futures.Future[Any]] = {}
        self.done: dict[tuple[Any, ...], tuple[np.ndarray, float]] = {}
        self.keys = keys
        if executor is None and workers > 0 and keys:
            self.pool = parallel.default_executor(min(workers, len(keys)))
            executor = self.pool
        if executor is not None:
            self.futures = {key: executor.submit(_reference_job, key) for key in keys}

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        for future in self.futures.values():
            future.cancel()
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)

    def get(self, key: tuple[Any, ...]) -> tuple[np.ndarray, float]:
        if key not in self.done:
            future = self.futures.get(key)
            self.done[key] = future.result() if future is not None else _reference_job(key)
        return self.done[key]


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
        bounds[key] = record_bound(num, data[0], data[1], data[2], mask)
    bound_s = time.perf_counter() - start
    ref, ref_s = refs.get(task.input_key)
    times = {"compute": compute, "bound": bound_s, "reference": ref_s}
    return _measured(task, label, num, env, (q, k, v), out, ref, bounds[key], times)
