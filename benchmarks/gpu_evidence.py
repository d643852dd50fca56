"""Evidence from one GPU machine, in one time-boxed run: device records, real kernels against their
descriptors, tensor-core and cuDNN probes, and the bound's cost beside the attention it bounds.

    python3 benchmarks/gpu_evidence.py --out OUT --budget-s 420   # on a GPU machine
    python3 benchmarks/gpu_evidence.py --out OUT --cpu-smoke      # every path, tiny, on the CPU

Run from the repository root with ``PYTHONPATH=.`` (mhanum need not be installed). The parts run in
order of value, each within its share of the global budget (``--budget-s``): when the budget is
near, what is left of a part is skipped and the output says so. Each part's file is written as
soon as the part is done (part 1 after every chunk of its grid), so nothing measured is lost.

1. ``records.jsonl``: :func:`mhanum.devices.measure` on every preset and kernel path of
   ``Grid.gpu()`` (the ``mhanum measure --grid gpu`` record format), in chunks of one shape,
   the certified references on ``--workers`` host processes; the ``exp`` record last. ``check.txt``: ``mhanum check`` of those records (:func:`mhanum.devices.check`).
2. ``kernels.json``: real kernels (torch SDPA's math, flash, memory-efficient and cuDNN backends,
   each forced alone with ``sdpa_kernel``; ``flex_attention``; FlashAttention-2/3 where their
   wheel imports; ``jax.nn.dot_product_attention`` with XLA and cuDNN) on bfloat16, float16,
   float32 and float8 inputs, with causal masks, grouped-query heads and soft-caps where the
   kernel has them, each judged by :func:`mhanum.testing.attention_oracle` under its descriptor:
   the worst ``|error| / tolerance``, the number of elements outside the tolerance and the median
   ``tolerance / |error|``. A kernel refusing a case (a backend that does not run it, a dtype it
   does not take) is recorded with its reason. cuDNN has no descriptor
   (``mhanum.testing.NOT_MODELLED``): it is judged against *provisional* candidates (the device
   model of ``mhanum.devices.model_for("cudnn", ...)`` and FlashAttention-style online softmaxes
   on the H100 tensor-core model), each also alone, as evidence for a descriptor.
2b. ``backward.json``: the backward passes of torch SDPA's flash backend (FlashAttention-2's
   backward; ``torch-sdpa-flash-cuda``, in the smoke run the CPU's ``torch-sdpa-flash-cpu``) and
   of FlashAttention-2 where its wheel imports, by autograd on bfloat16 and float16 inputs,
   plain and causal, and grouped heads (bfloat16, causal), each gradient judged by :func:`mhanum.testing.attention_grad_oracle` under
   the backward descriptor (Theorem B.2 with FlashAttention-2's exp2 recomputation).
3. ``probes.json``: ``mhanum.tensorcore.run_probes`` (the tensor-core models) and probes of the
   P·V accumulation inside fused attention: zero queries and keys make every probability 1, so
   the output is ``fl(Σ_j v_j) / L`` as the kernel accumulates it; values chosen at rounding ties
   of the output format tell which tensor-core model (alignment bits, group, normalisation)
   predicts each output.
4. ``speed.json``: :func:`mhanum.bounds.attention_bound` (evaluated by JAX on the default device:
   the GPU) against the attention calls it bounds (``jax.nn`` XLA and cuDNN, torch SDPA,
   ``mhanum.attention``) at L = 4,096 and 32,768, d = 128, one head, each length in a fresh
   process: wall-clock seconds and peak device memory.

``environment.json`` (nvidia-smi, versions) comes first and ``summary.txt`` (what this prints)
last. Every kernel, probe and timing runs inside ``try``: a failure is recorded, never fatal.
"""

from __future__ import annotations

import os

# JAX must allocate on demand: torch, the part 3 processes and JAX share the GPU (read by JAX when
# its first backend starts, which is after this).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse
import concurrent.futures
import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import json
import math
import platform
import shutil
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np

jax.config.update("jax_enable_x64", True)

SCHEMA = "mhanum.gpu_evidence/1"
FILES = ("environment.json", "records.jsonl", "check.txt", "kernels.json", "backward.json",
         "probes.json", "speed.json", "summary.txt")  # fmt: skip
PARTS = ("records", "kernels", "backward", "probes", "speed")
# the end of each part, as a fraction of the budget (what a part leaves goes to the next)
SHARES = {"records": 0.4, "kernels": 0.66, "backward": 0.72, "probes": 0.77, "speed": 0.97}
NP_DTYPES: dict[str, Any] = {
    "float32": np.float32,
    "bfloat16": ml_dtypes.bfloat16,
    "float16": np.float16,
    "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
}
PROVISIONAL = "cudnn (provisional candidates)"
TANH_APPROX_ULPS = 2.0**13  # a soft-cap's tanh.approx.f32 (docs/testing.md, soft-capped kernels)


# -- the budget and the printed summary ---------------------------------------------------------


class Budget:
    """Seconds since the start against the global budget; each part ends at its share."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.start = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return self.seconds - self.elapsed()

    def until(self, part: str) -> float:
        """Seconds left before ``part``'s share of the budget ends."""
        return SHARES[part] * self.seconds - self.elapsed()


class Summary:
    """Lines printed as they come, and written to ``summary.txt`` at the end."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.lines: list[str] = []

    def say(self, line: str) -> None:
        self.lines.append(line)
        print(line, flush=True)
        self.write()  # kept up to date: a run cut short still leaves its summary

    def write(self) -> None:
        (self.out / "summary.txt").write_text("\n".join(self.lines) + "\n")


def _write_json(path: Path, doc: Any) -> None:
    path.write_text(json.dumps(doc, indent=1, sort_keys=False, default=str) + "\n")


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip()[:2000]


# -- environment --------------------------------------------------------------------------------


def _command(args: list[str], timeout: float = 30.0) -> str | None:
    if shutil.which(args[0]) is None:
        return None
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return _error(exc)
    return (done.stdout + done.stderr).strip()


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin", "torch",
            "triton", "numpy", "scipy", "mpmath", "gmpy2", "python-flint", "ml-dtypes",
            "hypothesis", "flash-attn", "flash-attn-3", "nvidia-cudnn-cu13", "nvidia-cudnn-cu12",
            "nvidia-cublas")  # fmt: skip


def environment(platform_name: str) -> dict[str, Any]:
    """The machine, the accelerator and the versions of everything that computes."""
    from mhanum._version import __version__

    env: dict[str, Any] = {
        "schema": SCHEMA,
        "platform": platform_name,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "mhanum": __version__,
        "git_commit": _command(["git", "rev-parse", "HEAD"]),
        "packages": {p: _version(p) for p in PACKAGES},
        "jax_backend": jax.default_backend(),
        "jax_devices": [
            {"name": str(d), "kind": d.device_kind, "platform": d.platform} for d in jax.devices()
        ],
        "nvidia_smi": _command(["nvidia-smi"]),
        "nvidia_smi_query": _command(
            [
                "nvidia-smi",
                "--query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem",
                "--format=csv",
            ]
        ),
        "nvcc": _command(["nvcc", "--version"]),
    }
    with contextlib.suppress(Exception):
        env["torch"] = _torch_identity()
    return env


def _torch_identity() -> dict[str, Any]:
    import torch

    cuda = torch.cuda.is_available()
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "capability": list(torch.cuda.get_device_capability(0)) if cuda else None,
        "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "math_sdp_reduced": _maybe(
            lambda: torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
        ),
    }


def _maybe(f: Callable[[], Any]) -> Any:
    try:
        return f()
    except Exception as exc:  # noqa: BLE001 (a version without it: say so)
        return _error(exc)


# -- part 1: device records ---------------------------------------------------------------------


def records_grid(smoke: bool) -> Any:
    """``Grid.gpu()``, or on the CPU a tiny grid with every implementation and two presets."""
    from mhanum import devices

    if not smoke:
        return devices.Grid.gpu()
    return devices.Grid(
        shapes=((1, 1, 8, 8), (1, 1, 16, 8)),
        dtypes=("float32", "bfloat16"),
        structures=("normal", "outlier"),
        masks=("none", "causal"),
        precisions=("default", "highest"),
        implementations=devices.IMPLEMENTATIONS,
        presets=("fp32", "bf16-fp32acc"),
    )


def _chunks(grid: Any) -> list[Any]:
    """The grid split by shape, smallest first, without ``exp``: the records come in the grid's
    order, and the references of one shape's inputs all run at once on the host workers (the
    first chunk of a shape compiles, the rest of its time is the slowest reference)."""
    shapes = sorted(grid.shapes, key=lambda s: s[2] * s[2] * s[3])
    return [dataclasses.replace(grid, shapes=(shape,), exp=False) for shape in shapes]


def part_records(ctx: Context) -> None:
    """Part 1: the records of ``Grid.gpu()`` and their check, written after every chunk."""
    from mhanum import devices

    path = ctx.out / "records.jsonl"
    grid = records_grid(ctx.smoke)
    chunks = _chunks(grid)
    records: list[dict[str, Any]] = []
    done_chunks, skipped, last = 0, [], None
    for chunk in chunks:
        length = chunk.shapes[0][2]
        # compilations and references dominate a chunk's time: about linear in L here
        estimate = 0.0 if last is None else last[1] * length / last[0]
        if estimate > ctx.budget.until("records") + 30:
            skipped.append(f"shape {chunk.shapes[0]}")
            continue
        start = time.perf_counter()
        try:
            if ctx.pool is None:
                part = devices.measure(chunk, ctx.platform, workers=0)
            else:
                part = devices.measure(chunk, ctx.platform, executor=ctx.pool)
        except Exception as exc:  # noqa: BLE001 (a chunk that fails is reported, the rest runs)
            ctx.say(f"records: the chunk of shape {chunk.shapes[0]} failed: {_error(exc)}")
            continue
        last = (length, time.perf_counter() - start)
        ctx.say(
            f"records: {len(part)} of shape {chunk.shapes[0]} in {last[1]:.0f} s "
            f"(at {ctx.budget.elapsed():.0f} s)"
        )
        records.extend(part)
        for i, r in enumerate(records):
            r["id"] = i
        devices.write_records(path, records, force=True)
        done_chunks += 1
    if grid.exp and ctx.budget.left() > 30:  # seconds on a GPU, and it checks the exp assumption
        try:
            assumed = min(
                (r["model"]["numerics"]["exp_ulps"] for r in records if r["status"] == "measured"),
                default=2.0,
            )
            records.append(devices.exp_record(ctx.platform, assumed_ulps=assumed))
            records[-1]["id"] = len(records) - 1
            devices.write_records(path, records, force=True)
        except Exception as exc:  # noqa: BLE001
            ctx.say(f"records: the exp record failed: {_error(exc)}")
    elif grid.exp:
        skipped.append("the exp record")
    measured = sum(r["status"] == "measured" for r in records)
    ratios = [r["ratio"] for r in records if r.get("kind") == "attention" and "ratio" in r]
    ctx.say(
        f"part 1: {len(records)} records ({measured} measured) from {done_chunks} of "
        f"{len(chunks)} chunks in {ctx.budget.elapsed():.0f} s; worst error/bound "
        f"{max(ratios, default=math.nan):.3g} -> {path.name}"
    )
    if skipped:
        ctx.say(f"part 1: skipped for time: {'; '.join(skipped)}")
    ctx.parts["records"] = {"records": len(records), "skipped": skipped}
    if records:
        check_records(ctx, records)


def check_records(ctx: Context, records: list[dict[str, Any]]) -> None:
    """``mhanum check`` of the records into ``check.txt`` (fast: no reference is recomputed)."""
    from mhanum import devices

    start = time.perf_counter()
    try:
        result = devices.check(records)
    except Exception as exc:  # noqa: BLE001
        (ctx.out / "check.txt").write_text(f"mhanum check failed: {_error(exc)}\n")
        ctx.say(f"check: failed: {_error(exc)}")
        return
    (ctx.out / "check.txt").write_text(result.render() + "\n")
    counts = ", ".join(f"{n} {v}" for v, n in result.counts.items() if n)
    ctx.say(
        f"check: {counts} in {time.perf_counter() - start:.0f} s "
        f"({'ok' if result.ok else 'FAILING'}) -> check.txt"
    )


# -- part 2: real kernels against their descriptors ---------------------------------------------


@dataclasses.dataclass(frozen=True)
class Config:
    """One input configuration: shapes, mask, grouped heads, soft-cap and input size."""

    name: str
    heads: int
    kv_heads: int
    length: int
    d: int
    causal: bool = False
    softcap: float | None = None
    size: float = 1.0  # q and k are drawn with this standard deviation

    @property
    def gqa(self) -> bool:
        return self.kv_heads != self.heads


def configs(smoke: bool) -> dict[str, Config]:
    n, d, big = (32, 16, 32) if smoke else (512, 64, 2048)
    return {
        c.name: c
        for c in (
            Config("plain", 4, 4, n, d),
            Config("causal", 4, 4, n, d, causal=True),
            Config("gqa-causal", 8, 2, n, d, causal=True),
            Config("d128-causal", 2, 2, n, 2 * d, causal=True),
            Config("softcap", 4, 4, n, d, softcap=20.0, size=3.0),
            Config("long-causal", 1, 1, big, 2 * d, causal=True),
        )
    }


KERNEL_NAMES = ("torch-sdpa-math", "torch-sdpa-flash", "torch-sdpa-efficient", "torch-sdpa-cudnn",
                "jax-xla", "jax-cudnn", "flash-attention-2", "flash-attention-3",
                "flex-attention")  # fmt: skip
HALF = ("bfloat16", "float16")


def cases() -> list[tuple[str, str, str, str]]:
    """``(kernel, dtype, config, precision)`` in order of value: the common paths on every
    config, float8 where it may run (not flex_attention: a compilation), FlashAttention-2's
    soft-cap, long rows, then flex_attention (a compilation each on the GPU, tens of seconds)."""
    out = []
    main = ("plain", "causal", "gqa-causal", "d128-causal")
    fixed = [k for k in KERNEL_NAMES if k != "flex-attention"]
    for config in main:
        for kernel in fixed:
            for dtype in (*HALF, "float32"):
                if kernel == "jax-xla" and dtype == "float32":
                    out += [(kernel, dtype, config, p) for p in ("default", "highest")]
                else:
                    out.append((kernel, dtype, config, "default"))
        if config == "plain":
            out += [(k, "float8_e4m3fn", config, "default") for k in fixed]
    out += [("flash-attention-2", d, "softcap", "default") for d in HALF]
    long_kernels = ("torch-sdpa-flash", "torch-sdpa-efficient", "torch-sdpa-cudnn", "jax-cudnn",
                    "jax-xla", "flash-attention-3")  # fmt: skip
    out += [(k, "bfloat16", "long-causal", "default") for k in long_kernels]
    flex = [("bfloat16", "plain"), ("bfloat16", "softcap"), ("float16", "causal"),
            ("bfloat16", "gqa-causal"), ("float32", "plain")]  # fmt: skip
    out += [("flex-attention", d, c, "default") for d, c in flex]
    return out


def case_inputs(config: Config, dtype: str, index: int) -> tuple[np.ndarray, ...]:
    """q ``(1, H, L, d)``, k and v ``(1, H_kv, L, d)``, rounded to ``dtype`` (values kept)."""
    rng = np.random.default_rng([index, list(NP_DTYPES).index(dtype)])
    shapes = ((1, config.heads, config.length, config.d),) + 2 * (
        (1, config.kv_heads, config.length, config.d),
    )
    q, k, v = (rng.standard_normal(s) for s in shapes)
    q, k = config.size * q, config.size * k
    return tuple(x.astype(np.float32).astype(NP_DTYPES[dtype]) for x in (q, k, v))


class Refused(Exception):
    """A kernel that does not run a case, with its reason."""


def _torch_dtype(dtype: str) -> Any:
    import torch

    name = {"float8_e4m3fn": "float8_e4m3fn"}.get(dtype, dtype)
    if not hasattr(torch, name):
        raise Refused(f"torch {torch.__version__} has no dtype {name}")
    return getattr(torch, name)


def _torch_tensors(q: np.ndarray, k: np.ndarray, v: np.ndarray, dtype: str, device: str) -> list:
    import torch

    td = _torch_dtype(dtype)
    return [torch.from_numpy(np.asarray(x, np.float32)).to(device).to(td) for x in (q, k, v)]


def _to_numpy(out: Any) -> np.ndarray:
    if isinstance(out, tuple):  # FlashAttention-3 may return (out, lse)
        out = out[0]
    if hasattr(out, "detach"):
        return out.detach().float().cpu().numpy().astype(np.float64)
    return np.asarray(np.asarray(out).astype(np.float32), np.float64)


_SDPA_BACKENDS = {"torch-sdpa-math": "MATH", "torch-sdpa-flash": "FLASH_ATTENTION",
                  "torch-sdpa-efficient": "EFFICIENT_ATTENTION",
                  "torch-sdpa-cudnn": "CUDNN_ATTENTION"}  # fmt: skip


def run_torch_sdpa(kernel: str, q, k, v, dtype: str, config: Config, device: str) -> np.ndarray:
    """torch SDPA with one backend forced (``sdpa_kernel([backend])``): if it returns, that
    backend ran; if it refuses, torch's warnings say why."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    name = _SDPA_BACKENDS[kernel]
    backend = getattr(SDPBackend, name, None)
    if backend is None:
        raise Refused(f"torch {torch.__version__} has no SDPBackend.{name}")
    t = _torch_tensors(q, k, v, dtype, device)
    kwargs: dict[str, Any] = {"is_causal": config.causal}
    if config.gqa:
        kwargs["enable_gqa"] = True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with torch.no_grad(), sdpa_kernel([backend]):
                out = torch.nn.functional.scaled_dot_product_attention(*t, **kwargs)
            if device == "cuda":
                torch.cuda.synchronize()
        except (RuntimeError, TypeError, NotImplementedError) as exc:
            why = " | ".join(str(w.message) for w in caught)
            raise Refused(f"{_error(exc)}{' | warnings: ' + why if why else ''}") from None
    return _to_numpy(out)


_FLEX: dict[str, Any] = {}


def run_flex(q, k, v, dtype: str, config: Config, device: str) -> np.ndarray:
    """``flex_attention`` compiled on CUDA (the Triton kernel its descriptor models); on the CPU
    eager (the smoke run: the path, not the descriptor's kernel)."""
    import torch

    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as exc:
        raise Refused(f"torch {torch.__version__}: no flex_attention ({exc})") from None
    if device == "cuda" and "compiled" not in _FLEX:
        _FLEX["compiled"] = torch.compile(flex_attention, dynamic=False)
    fn = _FLEX.get("compiled", flex_attention) if device == "cuda" else flex_attention
    t = _torch_tensors(q, k, v, dtype, device)
    kwargs: dict[str, Any] = {}
    if config.causal:
        kwargs["block_mask"] = create_block_mask(
            lambda b, h, i, j: i >= j, None, None, config.length, config.length, device=device
        )
    if config.softcap is not None:
        cap = config.softcap
        kwargs["score_mod"] = lambda s, b, h, i, j: cap * torch.tanh(s / cap)
    if config.gqa:
        kwargs["enable_gqa"] = True
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = fn(*t, **kwargs)
    return _to_numpy(out)


def run_flash_attention(kernel: str, q, k, v, dtype: str, config: Config, device: str):
    """FlashAttention-2 (``flash_attn``) or -3 (``flash_attn_interface``), (B, L, H, d)."""
    module = "flash_attn" if kernel == "flash-attention-2" else "flash_attn_interface"
    if importlib.util.find_spec(module) is None:
        raise Refused(f"no {module} module: the {kernel} wheel is not installed")
    if device != "cuda":
        raise Refused(f"{kernel} runs on CUDA only")
    mod = importlib.import_module(module)
    t = [x.transpose(1, 2).contiguous() for x in _torch_tensors(q, k, v, dtype, device)]
    kwargs: dict[str, Any] = {"causal": config.causal}
    if config.softcap is not None:
        kwargs["softcap"] = config.softcap
    if kernel == "flash-attention-3":
        kwargs["num_splits"] = 1  # the descriptor models one split
    out = mod.flash_attn_func(*t, **kwargs)
    if isinstance(out, tuple):
        out = out[0]
    return _to_numpy(out.transpose(1, 2))


_JAX_FNS: dict[tuple[str, bool], Any] = {}


def run_jax(kernel: str, q, k, v, dtype: str, config: Config, precision: str, device: Any):
    """``jax.nn.dot_product_attention(implementation=...)`` in its (B, T, N, H) layout, jitted
    (on the CPU op by op: jax 0.10's CPU compiler refuses the F16_F16_F32 dot of float16 inputs
    under ``jax.jit``, which it runs eagerly)."""
    import inspect

    impl = "cudnn" if kernel == "jax-cudnn" else "xla"
    params = inspect.signature(jax.nn.dot_product_attention).parameters
    if "implementation" not in params:
        raise Refused(f"jax {jax.__version__}: dot_product_attention has no implementation=")

    def attend(a: Any, b: Any, c: Any) -> Any:
        return jax.nn.dot_product_attention(a, b, c, is_causal=config.causal, implementation=impl)

    key = (impl, config.causal)
    if key not in _JAX_FNS:
        _JAX_FNS[key] = jax.jit(attend)
    fn = attend if device.platform == "cpu" else _JAX_FNS[key]
    t = [jax.device_put(np.swapaxes(x, 1, 2), device) for x in (q, k, v)]
    try:
        with jax.default_matmul_precision(precision):
            out = fn(*t).block_until_ready()
    except Exception as exc:  # noqa: BLE001 (cuDNN refusing a dtype or a platform)
        raise Refused(_error(exc)) from None
    return np.swapaxes(_to_numpy(out), 1, 2)


def cudnn_candidates(fmt: str) -> tuple[Any, ...]:
    """Provisional cuDNN candidates: the device model (mhanum.devices, online softmax over key
    blocks of 64) and FlashAttention-style online softmaxes on the H100 tensor-core model."""
    from mhanum import devices
    from mhanum.testing import KERNELS

    device_model = devices.model_for("cudnn", fmt, "default", "gpu")[1]
    # FlashAttention-2's models on the H100 tensor-core model, blocks of 64 and 128, with the
    # scale folded into exp2 or applied to the scores first
    flash = tuple(
        n.replace(exp_form=form)
        for n in KERNELS["flash-attention-2"].candidates(fmt)
        if n.dot.startswith("tensor-core(h100") and n.softmax in ("online(64)", "online(128)")
        for form in ("exp2-folded", "exp2")
    )
    return (device_model, *flash)


def descriptor_for(kernel: str, platform_name: str, dtype: str, precision: str) -> tuple[Any, bool]:
    """``(descriptor name, covered)``: the descriptor that judges a case (``PROVISIONAL`` for
    cuDNN, None for none) and whether it models the kernel that ran on this platform."""
    gpu = platform_name == "gpu"
    table = {
        "torch-sdpa-math": ("torch-sdpa-math", True),
        "torch-sdpa-flash": ("torch-sdpa-flash-cuda" if gpu else "torch-sdpa-flash-cpu", True),
        "torch-sdpa-efficient": ("torch-sdpa-efficient", gpu),
        "torch-sdpa-cudnn": (PROVISIONAL, gpu),
        "jax-cudnn": (PROVISIONAL, gpu),
        "flash-attention-2": ("flash-attention-2", gpu),
        "flash-attention-3": ("flash-attention-3", gpu),
        "flex-attention": ("flex-attention", gpu),
    }
    if kernel == "jax-xla":
        if not gpu:  # the weights' roundings measured to be known on XLA's CPU backend
            return "jax-xla-cpu", True
        tf32 = dtype == "float32" and precision != "highest"
        return ("jax-xla-tf32" if tf32 else "jax-xla"), True
    return table[kernel]


def descriptor_object(name: str, fmt: str) -> Any:
    """The descriptor to judge with, or None when it has no model for ``fmt``."""
    from mhanum.testing import Kernel, get_kernel

    if name == PROVISIONAL:
        if fmt not in HALF:
            return None
        return Kernel(PROVISIONAL, {fmt: cudnn_candidates(fmt)}, "zero", ("provisional",))
    kern = get_kernel(name)
    return kern if fmt in kern.formats else None


def _stats(oracle: Any, out: np.ndarray) -> dict[str, Any]:
    failing, ratio = oracle.check(out)
    err = np.abs(out - oracle.exact)
    some = (err > 0) & np.isfinite(oracle.tolerance) & np.isfinite(err)
    worst = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
    return {
        "elements": int(out.size),
        "outside": int(failing.sum()),
        "worst_ratio": float(ratio.max()),
        "median_tolerance_over_error": float(np.median(oracle.tolerance[some] / err[some]))
        if some.any()
        else None,
        "unbounded": int(oracle.unbounded.sum()),
        "max_abs_error": float(np.nanmax(np.where(np.isnan(oracle.exact), 0.0, err))),
        "worst_term": str(oracle.term[worst]),
    }


def judge(spec: dict[str, Any], q, k, v, out: np.ndarray) -> dict[str, Any]:
    """The oracle's verdict on one output (run in a host worker process)."""
    from mhanum import reference
    from mhanum.testing import Kernel, attention_oracle

    jax.config.update("jax_enable_x64", True)
    start = time.perf_counter()
    fmt, config = spec["dtype"], Config(**spec["config"])
    kw = {"is_causal": config.causal, "enable_gqa": config.gqa, "softcap": config.softcap}
    kern = None if spec["descriptor"] is None else descriptor_object(spec["descriptor"], fmt)
    result: dict[str, Any] = {}
    if kern is None:  # no descriptor for this format: the error against the exact answer only
        group = config.heads // config.kv_heads
        k64, v64 = (np.repeat(np.asarray(x, np.float64), group, axis=1) for x in (k, v))
        mask = np.tril(np.ones((config.length,) * 2, bool)) if config.causal else None
        exact = reference.attention(
            np.asarray(q, np.float64), k64, v64, mask=mask, softcap=config.softcap,
            fully_masked="zero",
        )  # fmt: skip
        result["max_abs_error"] = float(np.nanmax(np.abs(out - np.asarray(exact))))
        result["note"] = f"no descriptor models {fmt} inputs of this kernel: error only"
    else:
        oracle = attention_oracle(q, k, v, kernel=kern, dtype=fmt, **kw)
        result.update(_stats(oracle, out))
        if fmt in HALF and spec["descriptor"] == "jax-xla":  # would it earn jax-xla-cpu's rule?
            known = dataclasses.replace(kern, known_rounding=True)
            result["with_known_rounding"] = _stats(
                attention_oracle(q, k, v, kernel=known, dtype=fmt, **kw), out
            )
        if config.softcap is not None:  # tanh.approx.f32 is about 2^-11 relative: 2^13 ulps
            approx = {
                fmt: tuple(n.replace(tanh_ulps=TANH_APPROX_ULPS) for n in kern.candidates(fmt))
            }
            alt = Kernel(f"{kern.name} (tanh_ulps={TANH_APPROX_ULPS:g})", approx, kern.fully_masked,
                         kern.evidence)  # fmt: skip
            result["with_tanh_approx"] = _stats(
                attention_oracle(q, k, v, kernel=alt, dtype=fmt, **kw), out
            )
        if spec["descriptor"] == PROVISIONAL:
            result["candidates"] = []
            for n in kern.candidates(fmt):
                one = Kernel(PROVISIONAL, {fmt: (n,)}, "zero", ("provisional",))
                alone = _stats(attention_oracle(q, k, v, kernel=one, dtype=fmt, **kw), out)
                result["candidates"].append({"numerics": n.describe(), **alone})
    result["judge_s"] = time.perf_counter() - start
    return result


# -- part 2b: backward passes ------------------------------------------------------------------

BACKWARD_KERNELS = {"torch-sdpa-flash": "torch-sdpa-flash-cuda",
                    "flash-attention-2": "flash-attention-2"}  # fmt: skip
BACKWARD_CASES = (("bfloat16", "causal"), ("float16", "causal"), ("bfloat16", "plain"),
                  ("float16", "plain"), ("bfloat16", "gqa-causal"))  # fmt: skip


def backward_config(smoke: bool, name: str) -> Config:
    """A backward case's sizes: two heads of d = 64 at L = 256 (smoke: 32 queries, d = 16);
    ``gqa-causal``: four query heads on two key heads."""
    n, d = (32, 16) if smoke else (256, 64)
    heads = 4 if name == "gqa-causal" else 2
    return Config(name, heads, 2, n, d, causal=name != "plain")


def run_backward(kernel: str, data: tuple[np.ndarray, ...], dtype: str, config: Config,
                 device: str) -> tuple[np.ndarray, ...]:  # fmt: skip
    """``(dq, dk, dv)`` of ``<d_out, attention(q, k, v)>`` by autograd through ``kernel`` (torch
    SDPA with the flash backend forced, or ``flash_attn_func``), in the (B, H, L, d) layout."""
    import torch

    q, k, v, g = data
    t = [x.requires_grad_() for x in _torch_tensors(q, k, v, dtype, device)]
    grad = torch.from_numpy(np.asarray(g, np.float32)).to(device).to(_torch_dtype(dtype))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if kernel == "torch-sdpa-flash":
                from torch.nn.attention import SDPBackend, sdpa_kernel

                with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                    out = torch.nn.functional.scaled_dot_product_attention(
                        *t, is_causal=config.causal, enable_gqa=config.gqa
                    )
                out.backward(grad)
            else:
                if importlib.util.find_spec("flash_attn") is None:
                    raise Refused(
                        "no flash_attn module: the flash-attention-2 wheel is not installed"
                    )
                if device != "cuda":
                    raise Refused("flash-attention-2 runs on CUDA only")
                from flash_attn import flash_attn_func

                bshd = [x.transpose(1, 2) for x in t]
                out = flash_attn_func(*bshd, causal=config.causal)
                out.backward(grad.transpose(1, 2))
            if device == "cuda":
                torch.cuda.synchronize()
        except (RuntimeError, TypeError, NotImplementedError) as exc:
            why = " | ".join(str(w.message) for w in caught)
            raise Refused(f"{_error(exc)}{' | warnings: ' + why if why else ''}") from None
    return tuple(_to_numpy(x.grad) for x in t)


def judge_backward(
    spec: dict[str, Any], q, k, v, g, grads: tuple[np.ndarray, ...]
) -> dict[str, Any]:
    """The gradient oracle's verdict on ``(dq, dk, dv)`` (run in a host worker process)."""
    from mhanum.testing import attention_grad_oracle

    jax.config.update("jax_enable_x64", True)
    start = time.perf_counter()
    oracle = attention_grad_oracle(
        q,
        k,
        v,
        g,
        kernel=spec["descriptor"],
        dtype=spec["dtype"],
        is_causal=spec["causal"],
        enable_gqa=spec.get("gqa", False),
    )
    result: dict[str, Any] = {
        name: _stats(oracle.oracles[name], got)
        for name, got in zip(("dq", "dk", "dv"), grads, strict=True)
    }
    result["judge_s"] = time.perf_counter() - start
    return result


def part_backward(ctx: Context) -> None:
    """Part 2b: each backward case run on the device, judged on the host workers."""
    torch_device = "cuda" if ctx.platform == "gpu" else "cpu"
    rows: list[dict[str, Any]] = []
    futures: dict[concurrent.futures.Future[Any], dict[str, Any]] = {}
    not_run: list[str] = []
    for index, (kernel, (dtype, cname)) in enumerate(
        (k, c) for k in BACKWARD_KERNELS for c in BACKWARD_CASES
    ):
        label = f"{kernel} {dtype} {cname}"
        if ctx.budget.until("backward") < (5.0 if ctx.smoke else 15.0):
            not_run.append(label)
            continue
        descriptor = BACKWARD_KERNELS[kernel]
        if kernel == "torch-sdpa-flash" and ctx.platform != "gpu":
            descriptor = "torch-sdpa-flash-cpu"
        config = backward_config(ctx.smoke, cname)
        row: dict[str, Any] = {"kernel": kernel, "dtype": dtype, "config": cname,
                               "descriptor": descriptor}  # fmt: skip
        d_out = case_inputs(config, dtype, index + 100)[0]  # shaped like q
        data = (*case_inputs(config, dtype, index), d_out)
        print(f"backward: {label} (at {ctx.budget.elapsed():.0f} s)", flush=True)
        try:
            grads = run_backward(kernel, data, dtype, config, torch_device)
        except Refused as exc:
            rows.append({**row, "status": "refused", "reason": str(exc)})
            continue
        except Exception as exc:  # noqa: BLE001 (a kernel failing is recorded, never fatal)
            rows.append({**row, "status": "error", "reason": _error(exc),
                         "traceback": traceback.format_exc(limit=3)[-1500:]})  # fmt: skip
            continue
        spec = {"dtype": dtype, "causal": config.causal, "descriptor": descriptor,
                "gqa": config.gqa}  # fmt: skip
        data64 = tuple(np.asarray(x.astype(np.float32), np.float64) for x in data)
        _judge_case(ctx, judge_backward, (spec, *data64, grads), row, rows, futures)
    _collect(futures, rows, ctx.budget.until("backward"))
    doc = {"schema": SCHEMA, "platform": ctx.platform, "cases": rows, "not_run_for_time": not_run}
    _write_json(ctx.out / "backward.json", doc)
    judged = [r for r in rows if r["status"] == "judged"]
    outside = sum(r[g]["outside"] for r in judged for g in ("dq", "dk", "dv"))
    worst = max((r[g]["worst_ratio"] for r in judged for g in ("dq", "dk", "dv")), default=None)
    ctx.say(
        f"part 2b: {len(rows)} backward cases, {len(judged)} judged, {outside} elements outside "
        f"their tolerance, worst |error|/tolerance {_g(worst)} -> backward.json"
    )
    for r in rows:
        if r["status"] != "judged":
            ctx.say(f"  {r['kernel']} {r['dtype']} {r['config']}: {r['status']}: "
                    f"{r.get('reason', '')[:120]}")  # fmt: skip
    if not_run:
        ctx.say(f"  not run for time: {', '.join(not_run)}")


def _g(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3g}"


def _judge_case(
    ctx: Context,
    fn: Callable[..., dict[str, Any]],
    args: tuple[Any, ...],
    row: dict[str, Any],
    rows: list[dict[str, Any]],
    futures: dict[concurrent.futures.Future[Any], dict[str, Any]],
) -> None:
    """Judge one case's output by ``fn(*args)``: here, or on a host worker (``futures``)."""
    if ctx.pool is not None:
        futures[ctx.pool.submit(fn, *args)] = row
        return
    try:
        row.update(status="judged", **fn(*args))
    except Exception as exc:  # noqa: BLE001 (a judge failing is recorded, never fatal)
        row.update(status="judge-error", reason=_error(exc))
    rows.append(row)


def _collect(
    futures: dict[concurrent.futures.Future[Any], dict[str, Any]],
    rows: list[dict[str, Any]],
    seconds: float,
) -> None:
    """The host workers' verdicts, each row as judged, failed or not judged in time."""
    _, pending = concurrent.futures.wait(futures, timeout=max(seconds, 10.0))
    for future, row in futures.items():
        if future in pending:
            future.cancel()
            rows.append({**row, "status": "not-judged", "reason": "judging ran past the budget"})
            continue
        try:
            row.update(status="judged", **future.result())
        except Exception as exc:  # noqa: BLE001
            row.update(status="judge-error", reason=_error(exc))
        rows.append(row)


@dataclasses.dataclass
class Context:
    out: Path
    smoke: bool
    platform: str
    budget: Budget
    summary: Summary
    pool: concurrent.futures.Executor | None
    parts: dict[str, Any] = dataclasses.field(default_factory=dict)

    def say(self, line: str) -> None:
        self.summary.say(line)


def _run_case(kernel: str, data: tuple[np.ndarray, ...], dtype: str, config: Config,
              precision: str, ctx: Context) -> np.ndarray:  # fmt: skip
    torch_device = "cuda" if ctx.platform == "gpu" else "cpu"
    if kernel in _SDPA_BACKENDS:
        return run_torch_sdpa(kernel, *data, dtype, config, torch_device)
    if kernel == "flex-attention":
        return run_flex(*data, dtype, config, torch_device)
    if kernel.startswith("flash-attention"):
        return run_flash_attention(kernel, *data, dtype, config, torch_device)
    return run_jax(kernel, *data, dtype, config, precision, jax.devices(ctx.platform)[0])


def _identity(kernel: str, ctx: Context, precision: str) -> dict[str, Any]:
    if kernel.startswith("jax"):
        device = jax.devices(ctx.platform)[0]
        return {"jax": jax.__version__, "device": device.device_kind, "precision": precision,
                "implementation": "cudnn" if kernel == "jax-cudnn" else "xla"}  # fmt: skip
    out: dict[str, Any] = {}
    with contextlib.suppress(Exception):
        ident = _torch_identity()
        out = {"torch": ident["torch"], "device": ident["device"], "cudnn": ident["cudnn"]}
    if kernel in _SDPA_BACKENDS:
        out["backend_requested"] = _SDPA_BACKENDS[kernel]
    if kernel == "flex-attention":
        out["compiled"] = ctx.platform == "gpu"
    if kernel.startswith("flash-attention"):
        name = "flash-attn" if kernel == "flash-attention-2" else "flash-attn-3"
        out["wheel"] = _version(name)
    return out


def _min_left(kernel: str, config: str, ctx: Context) -> float:
    """Seconds a case needs before the part's end: a compilation of flex_attention on the GPU
    takes tens of seconds, and a long row's judging some more."""
    if ctx.smoke:
        return 5.0
    if kernel == "flex-attention":
        return 60.0
    return 30.0 if config.startswith("long") else 5.0


def part_kernels(ctx: Context) -> None:
    """Part 2: every case run on the device, judged on the host workers as it comes."""
    cfgs = configs(ctx.smoke)
    todo = cases()
    rows: list[dict[str, Any]] = []
    futures: dict[concurrent.futures.Future[Any], dict[str, Any]] = {}
    not_run: list[str] = []
    names = list(cfgs)
    for kernel, dtype, cname, precision in todo:
        config = cfgs[cname]
        label = f"{kernel} {dtype} {cname} {precision}"
        if ctx.budget.until("kernels") < _min_left(kernel, cname, ctx):
            not_run.append(label)
            continue
        descriptor, covered = descriptor_for(kernel, ctx.platform, dtype, precision)
        row: dict[str, Any] = {
            "kernel": kernel, "dtype": dtype, "config": cname, "precision": precision,
            "descriptor": descriptor, "covered": covered,
            "provisional": descriptor == PROVISIONAL, "identity": _identity(kernel, ctx, precision),
        }  # fmt: skip
        data = case_inputs(config, dtype, names.index(cname))
        start = time.perf_counter()
        print(f"kernels: {label} (at {ctx.budget.elapsed():.0f} s)", flush=True)  # the log only
        try:
            out = _run_case(kernel, data, dtype, config, precision, ctx)
        except Refused as exc:
            rows.append({**row, "status": "refused", "reason": str(exc)})
            continue
        except Exception as exc:  # noqa: BLE001 (a kernel failing is recorded, never fatal)
            tb = traceback.format_exc(limit=3)[-1500:]
            rows.append({**row, "status": "error", "reason": _error(exc), "traceback": tb})
            continue
        row["run_s"] = time.perf_counter() - start
        if "backend_requested" in row["identity"]:
            row["identity"]["backend_ran"] = row["identity"]["backend_requested"]
        spec = {"dtype": dtype, "config": dataclasses.asdict(config), "descriptor": descriptor}
        if dtype not in (*HALF, "float32"):
            spec["descriptor"] = None
        data64 = tuple(np.asarray(x.astype(np.float32), np.float64) for x in data)
        _judge_case(ctx, judge, (spec, *data64, out), row, rows, futures)
    _collect(futures, rows, ctx.budget.until("kernels"))
    order = {c: i for i, c in enumerate(todo)}
    rows.sort(key=lambda r: order[(r["kernel"], r["dtype"], r["config"], r["precision"])])
    doc = {
        "schema": SCHEMA,
        "platform": ctx.platform,
        "configs": {n: dataclasses.asdict(c) for n, c in cfgs.items()},
        "provisional_candidates": {f: [n.describe() for n in cudnn_candidates(f)] for f in HALF},
        "cases": rows,
        "not_run_for_time": not_run,
    }
    _write_json(ctx.out / "kernels.json", doc)
    _summarize_kernels(ctx, rows, not_run)


def _summarize_kernels(ctx: Context, rows: list[dict[str, Any]], not_run: list[str]) -> None:
    by: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(r["kernel"], []).append(r)
    ctx.say(f"part 2: {len(rows)} cases in {ctx.budget.elapsed():.0f} s -> kernels.json")
    ctx.say(f"  {'kernel':22s} {'judged':>6s} {'outside':>7s} {'worst':>8s} {'refused':>7s} "
            f"{'errors':>6s}  descriptor")  # fmt: skip
    for kernel, rs in by.items():
        judged = [r for r in rs if r["status"] == "judged" and "worst_ratio" in r]
        worst = max((r["worst_ratio"] for r in judged), default=math.nan)
        outside = sum(r["outside"] for r in judged)
        refused = sum(r["status"] == "refused" for r in rs)
        errors = sum(r["status"] in ("error", "judge-error", "not-judged") for r in rs)
        names = sorted({str(r["descriptor"]) for r in judged})
        ctx.say(f"  {kernel:22s} {len(judged):6d} {outside:7d} {worst:8.3g} {refused:7d} "
                f"{errors:6d}  {', '.join(names)}")  # fmt: skip
    known = [r["with_known_rounding"] for r in rows if "with_known_rounding" in r]
    if known:  # jax.nn's half-precision weights against the known roundings (steps 6k/6r)
        ctx.say(f"  jax-xla with known roundings: {len(known)} cases, "
                f"{sum(r['outside'] for r in known)} elements outside, worst "
                f"{max(r['worst_ratio'] for r in known):.3g}")  # fmt: skip
    if not_run:
        ctx.say(f"part 2: {len(not_run)} cases skipped for time (kernels.json: not_run_for_time)")
    ctx.parts["kernels"] = {"cases": len(rows), "not_run": len(not_run)}


# -- part 3: probes -------------------------------------------------------------------------------

# Each probe: values of the P·V column at key positions (the rest 0), with every probability 1.
# bf16 (7 fraction bits): 1 + 2^-8 is a tie of the output format; a tail 2^-k tips it up when the
# accumulator keeps it. fp16 (10 fraction bits): the tie is 1 + 2^-11.
CUDNN_PROBES: dict[str, list[tuple[str, dict[int, float], str]]] = {
    "bfloat16": [
        ("ones", dict.fromkeys(range(64), 1.0), "normalisation: every key 1, output 1"),
        ("output-rounding", {0: 1.0, 1: 3 * 2.0**-9}, "output rounding: 1 + 3·2^-9"),
        *[
            (
                f"tie-tail-2^-{t}",
                {0: 1.0, 1: 2.0**-8, 2: 2.0**-t},
                f"alignment bits in one group: does 2^-{t} survive beside 1?",
            )
            for t in (16, 20, 23, 24, 25, 26, 28)
        ],
        (
            "tie-tail-3x2^-25",
            {0: 1.0, 1: 2.0**-8, 2: 3 * 2.0**-25},
            "normalisation: 0.75 ulp of float32 rounded up (nearest) or dropped (toward zero)",
        ),
        *[
            (
                f"tie-tail-2^-{t}-at-{p}",
                {0: 1.0, 1: 2.0**-8, p: 2.0**-t},
                f"group size: 2^-{t} at key {p}, in the first group or a later one",
            )
            for t in (26, 30)
            for p in (4, 8, 16, 32)
        ],
        *[
            (
                f"cancel-2^-{t}-at-{p}",
                {0: 1.0, 1: -1.0, p: 2.0**-t},
                (
                    f"exact cancellation: 2^-{t} at key {p} kept by a sequential float32 sum, "
                    "dropped by an alignment to 1 in the same group"
                ),
            )
            for t in (30, 40)
            for p in (2, 4, 8, 16, 32)
        ],
    ],
    "float16": [
        ("ones", dict.fromkeys(range(64), 1.0), "normalisation: every key 1, output 1"),
        ("output-rounding", {0: 1.0, 1: 3 * 2.0**-12}, "output rounding: 1 + 3·2^-12"),
        *[
            (
                f"tie-tail-2^-{t}",
                {0: 1.0, 1: 2.0**-11, 2: 2.0**-t},
                f"alignment bits in one group: does 2^-{t} survive beside 1?",
            )
            for t in (16, 20, 23, 24)
        ],
        *[
            (
                f"cancel-2^-{t}-at-{p}",
                {0: 2.0**15, 1: -(2.0**15), p: 2.0**-t},
                f"exact cancellation: 2^-{t} at key {p} beside ±2^15",
            )
            for t in (12, 14)
            for p in (2, 4, 8, 16, 32)
        ],
    ],
}
PROBE_LENGTH, PROBE_D = 64, 64


def _probe_prediction(vector: list[float], fmt: str) -> dict[str, float]:
    """The output each model predicts: the accumulated sum over L (exact: L is a power of two),
    rounded to nearest into the output format."""
    from mhanum.formats import round_to
    from mhanum.units.tensorcore import MODELS

    ones = [1.0] * len(vector)
    sums = {m.name: m.dot(ones, vector, 0.0) for m in MODELS.values() if m.input_format == fmt}
    acc = np.float32(0.0)
    for x in vector:
        acc = np.float32(acc + np.float32(x))
    sums["rn-float32-sequential"] = float(acc)
    sums["exact"] = math.fsum(vector)
    return {n: float(round_to(s / len(vector), fmt)) for n, s in sums.items()}


def cudnn_probes(ctx: Context) -> dict[str, Any]:
    """Every P·V probe through the fused kernels that run here."""
    kernels = ("jax-cudnn", "torch-sdpa-cudnn", "torch-sdpa-flash", "torch-sdpa-efficient",
               "jax-xla", "torch-sdpa-math")  # fmt: skip
    config = Config("probe", 1, 1, PROBE_LENGTH, PROBE_D)
    results: dict[str, Any] = {}
    for fmt, probes in CUDNN_PROBES.items():
        for kernel in kernels:
            entry = results.setdefault(kernel, {}).setdefault(fmt, {"probes": []})
            for name, values, purpose in probes:
                vector = [values.get(i, 0.0) for i in range(PROBE_LENGTH)]
                v = np.zeros((1, 1, PROBE_LENGTH, PROBE_D))
                v[0, 0, :, 0] = vector
                zeros = np.zeros((1, 1, PROBE_LENGTH, PROBE_D))
                data = tuple(x.astype(np.float32).astype(NP_DTYPES[fmt]) for x in (zeros, zeros, v))
                try:
                    out = _run_case(kernel, data, fmt, config, "default", ctx)
                except Refused as exc:
                    entry.update(status="refused", reason=str(exc))
                    break
                except Exception as exc:  # noqa: BLE001
                    entry.update(status="error", reason=_error(exc))
                    break
                observed = float(out[0, 0, 0, 0])
                predicted = _probe_prediction(vector, fmt)
                matches = [n for n, p in predicted.items() if p == observed]
                entry["probes"].append({"name": name, "purpose": purpose, "values": values,
                                        "observed": observed, "predicted": predicted,
                                        "matches": matches})  # fmt: skip
            ran = entry["probes"]
            if ran and "status" not in entry:
                entry["status"] = "ran"
                names = set(ran[0]["predicted"])
                entry["matching_every_probe"] = sorted(
                    n for n in names if all(n in p["matches"] for p in ran)
                )
    return results


def part_probes(ctx: Context) -> None:
    """Part 3: the tensor-core probes and the P·V probes of fused attention."""
    from mhanum import tensorcore

    doc: dict[str, Any] = {"schema": SCHEMA, "platform": ctx.platform}
    try:
        results = tensorcore.run_probes(ctx.platform)
        device = jax.devices(ctx.platform)[0]
        doc["tensor_core"] = {"device_kind": device.device_kind, "jax": jax.__version__,
                              "matching_models": tensorcore.matching_models(results),
                              "probes": results}  # fmt: skip
        ctx.say(f"probes: {len(results)} tensor-core probes, matching models: "
                f"{' '.join(doc['tensor_core']['matching_models']) or 'none'}")  # fmt: skip
    except Exception as exc:  # noqa: BLE001
        doc["tensor_core"] = {"status": "error", "reason": _error(exc)}
        ctx.say(f"probes: tensor-core probes failed: {_error(exc)}")
    _write_json(ctx.out / "probes.json", doc)
    if ctx.budget.until("probes") <= 0:
        doc["fused"] = {"status": "skipped", "reason": "budget"}
        ctx.say("probes: the P·V probes of fused attention skipped for time")
    else:
        doc["fused"] = cudnn_probes(ctx)
        for kernel, by_fmt in doc["fused"].items():
            shown = []
            for fmt, e in by_fmt.items():
                if e.get("status") == "ran":
                    models = ",".join(e["matching_every_probe"]) or "no model"
                    shown.append(f"{fmt}: {models}")
                else:
                    shown.append(f"{fmt}: {e.get('status')}")
            ctx.say(f"probes: {kernel:22s} " + "; ".join(shown))
    _write_json(ctx.out / "probes.json", doc)


# -- part 4: the bound's cost on the device --------------------------------------------------------

SPEED_SCRIPT = r"""
import json, os, resource, statistics, sys, time
import numpy as np, ml_dtypes, jax
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp
import mhanum
from mhanum.bounds import attention_bound
L, D, PRESET = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
device = jax.devices()[0]
def say(**kw):
    print(json.dumps(kw), flush=True)
def peak():
    try:
        return (device.memory_stats() or {}).get("peak_bytes_in_use")
    except Exception:
        return None
def timed(f, repeat):
    start = time.perf_counter(); f(); first = time.perf_counter() - start
    times = []
    for _ in range(repeat if first < 20 else 0):
        start = time.perf_counter(); f(); times.append(time.perf_counter() - start)
    return first, (statistics.median(times) if times else None)
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((L, D)).astype(np.float32).astype(ml_dtypes.bfloat16) for _ in range(3))
say(event="start", length=L, d=D, preset=PRESET, backend=jax.default_backend(), device=device.device_kind)
def jax_nn(impl):
    a, b, c = (jax.device_put(jnp.asarray(x)[None, :, None, :], device) for x in (q, k, v))
    f = jax.jit(lambda a, b, c: jax.nn.dot_product_attention(a, b, c, implementation=impl))
    return lambda: f(a, b, c).block_until_ready()
def mhanum_attention():
    a, b, c = (jax.device_put(jnp.asarray(x), device) for x in (q, k, v))
    return lambda: jax.block_until_ready(mhanum.attention(a, b, c, numerics=PRESET))
def torch_sdpa():
    import torch
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    t = [torch.from_numpy(np.asarray(x, np.float32)).to(dev).to(torch.bfloat16)[None, None] for x in (q, k, v)]
    def f():
        with torch.no_grad():
            torch.nn.functional.scaled_dot_product_attention(*t)
        if dev == "cuda":
            torch.cuda.synchronize()
    return f
for name, make in (("jax-xla", lambda: jax_nn("xla")), ("jax-cudnn", lambda: jax_nn("cudnn")),
                   ("torch-sdpa", torch_sdpa), ("mhanum.attention", mhanum_attention)):
    try:
        first, median = timed(make(), 3)
        say(event="attention", name=name, first_s=first, median_s=median, peak_device_bytes=peak())
    except Exception as exc:
        say(event="attention", name=name, error=f"{type(exc).__name__}: {exc}"[:500])
q64, k64, v64 = (np.asarray(x, np.float64) for x in (q, k, v))
before, rss = peak(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    first, median = timed(lambda: jax.block_until_ready(attention_bound(q64, k64, v64, numerics=PRESET).total), 2)
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) / 2**20
    say(event="bound", first_s=first, median_s=median, peak_device_bytes_before=before,
        peak_device_bytes=peak(), host_rss_growth_gib=grown)
except Exception as exc:
    say(event="bound", error=f"{type(exc).__name__}: {exc}"[:500])
"""


def _speed_length(length: int, d: int, preset: str, timeout: float) -> dict[str, Any]:
    path = os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    env.pop("JAX_PLATFORMS", None)  # set for the host workers only
    if _JAX_PLATFORMS is not None:
        env["JAX_PLATFORMS"] = _JAX_PLATFORMS
    args = [sys.executable, "-c", SPEED_SCRIPT, str(length), str(d), preset]
    start = time.perf_counter()
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env,
                              check=False)  # fmt: skip
        stdout, status = done.stdout, f"exit {done.returncode}"
        stderr = done.stderr
    except subprocess.TimeoutExpired as exc:
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        stderr = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        status = f"timed out after {timeout:.0f} s (what it printed before is kept)"
    events = []
    for line in stdout.splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            events.append(json.loads(line))
    row: dict[str, Any] = {"length": length, "d": d, "preset": preset, "status": status,
                           "wall_s": time.perf_counter() - start, "events": events}  # fmt: skip
    if not any(e.get("event") == "bound" for e in events):
        row["stderr_tail"] = stderr[-2000:]
    bound = next((e for e in events if e.get("event") == "bound" and "error" not in e), None)
    for e in events:
        if e.get("event") == "attention" and "error" not in e and bound is not None:
            t_a = e["median_s"] or e["first_s"]
            t_b = bound["median_s"] or bound["first_s"]
            e["bound_over_attention"] = t_b / t_a if t_a > 0 else None
    return row


def part_speed(ctx: Context) -> None:
    """Part 4: bound ÷ attention at two lengths, each in a fresh process, time-boxed."""
    lengths = (256, 512) if ctx.smoke else (4096, 32768)
    d, preset = 128, "bf16-fp32acc"
    rows, skipped = [], []
    for i, length in enumerate(lengths):
        left = ctx.budget.until("speed")
        if left < 20:
            skipped.append(length)
            continue
        timeout = left if i == len(lengths) - 1 else min(left, 0.4 * left + 60)
        rows.append(_speed_length(length, d, preset, timeout))
        _write_json(ctx.out / "speed.json", {"schema": SCHEMA, "rows": rows, "skipped": skipped})
    _write_json(ctx.out / "speed.json", {"schema": SCHEMA, "rows": rows, "skipped": skipped})
    for row in rows:
        bound = next((e for e in row["events"] if e.get("event") == "bound"), {})
        parts = [f"L={row['length']}: bound {_seconds(bound)}"]
        for e in row["events"]:
            if e.get("event") == "attention":
                ratio = e.get("bound_over_attention")
                shown = f" (bound/attention {ratio:.3g})" if ratio else ""
                parts.append(f"{e['name']} {_seconds(e)}{shown}")
        peak = bound.get("peak_device_bytes")
        if peak:
            parts.append(f"peak device memory {peak / 2**30:.2f} GiB")
        ctx.say(f"speed: {'; '.join(parts)} [{row['status']}]")
    if skipped:
        ctx.say(f"speed: skipped for time: L = {', '.join(map(str, skipped))}")


def _seconds(event: dict[str, Any]) -> str:
    if not event:
        return "not measured"
    if "error" in event:
        return f"failed ({event['error'][:80]})"
    t = event.get("median_s") or event.get("first_s")
    return f"{t:.3g} s"


# -- the run ------------------------------------------------------------------------------------

_ROOT = Path(__file__).resolve().parents[1]
_JAX_PLATFORMS = os.environ.get("JAX_PLATFORMS")  # as given, before the host pool sets it


def _has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


@contextlib.contextmanager
def _host_pool(workers: int) -> Iterator[concurrent.futures.Executor | None]:
    """Spawned host workers for the references and the oracles, kept off the GPU."""
    if workers == 0:
        yield None
        return
    from mhanum import parallel

    os.environ["JAX_PLATFORMS"] = "cpu"  # read by each worker's JAX (this one's has started)
    pool = parallel.default_executor(workers)
    try:
        yield pool
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        os.environ.pop("JAX_PLATFORMS", None)
        if _JAX_PLATFORMS is not None:
            os.environ["JAX_PLATFORMS"] = _JAX_PLATFORMS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the folder the files go to")
    parser.add_argument("--budget-s", type=float, default=420.0, help="the global budget (420)")
    parser.add_argument(
        "--cpu-smoke", action="store_true",
        help="tiny sizes on the CPU backends (also without it when no GPU is present)",
    )  # fmt: skip
    parser.add_argument(
        "--workers", type=int, default=None, help="host worker processes (CPU count; 0: none)"
    )
    parser.add_argument(
        "--parts", default=",".join(PARTS),
        help=f"comma-separated, in this order: {','.join(PARTS)}",
    )  # fmt: skip
    args = parser.parse_args(argv)
    budget = Budget(args.budget_s)
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"--parts: expected names among {PARTS}, got {unknown}")
    if args.workers is not None and args.workers < 0:
        parser.error(f"--workers: expected an integer >= 0, got {args.workers}")
    gpu = _has_gpu()
    smoke = args.cpu_smoke or not gpu
    platform_name = "gpu" if gpu and not args.cpu_smoke else "cpu"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = Summary(out)
    summary.say(
        f"gpu_evidence: platform {platform_name}{' (smoke sizes)' if smoke else ''}, "
        f"budget {args.budget_s:.0f} s, parts {','.join(parts)}"
    )
    _write_json(out / "environment.json", environment(platform_name))
    workers = (os.cpu_count() or 1) if args.workers is None else args.workers
    functions = {"records": part_records, "kernels": part_kernels, "backward": part_backward,
                 "probes": part_probes, "speed": part_speed}  # fmt: skip
    with _host_pool(workers) as pool:
        ctx = Context(out, smoke, platform_name, budget, summary, pool)
        for name in PARTS:
            if name not in parts:
                continue
            if budget.left() < 5:
                ctx.say(f"{name}: skipped: the budget is spent")
                continue
            try:
                functions[name](ctx)
            except Exception:  # noqa: BLE001 (a part that fails leaves the others to run)
                ctx.say(f"{name}: failed:\n{traceback.format_exc(limit=4)}")
        ctx.say(f"gpu_evidence: done in {budget.elapsed():.0f} s; files in {out}: "
                + ", ".join(f for f in FILES if (out / f).exists()))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
