"""What runs where: the numerics model of each (platform, implementation, precision, dtype), and
the device and environment a record names."""

from __future__ import annotations

import platform
from typing import Any

import jax
import numpy as np

from mhanum._errors import InvalidArgument
from mhanum.inputs import DTYPES, check_choice
from mhanum.numerics import PRESETS, Numerics

__all__ = [
    "IMPLEMENTATIONS",
    "ONLINE_BLOCK",
    "PLATFORMS",
    "PRECISIONS",
    "device_for",
    "environment",
    "model_for",
]

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

_ALGORITHM_DOT: dict[str, dict[str, Any]] = {
    "BF16_BF16_F32": {"dot": "bf16x1"},
    "BF16_BF16_F32_X3": {"dot": "bf16x3"},
    "BF16_BF16_F32_X6": {"dot": "bf16x6"},
    "TF32_TF32_F32": {"operand_format": "tf32"},
}
IMPLEMENTATIONS = ("mhanum", "xla", "cudnn")
PLATFORMS = ("cpu", "gpu", "tpu")

ONLINE_BLOCK = 64
"""The key-block size assumed for cuDNN's flash attention (an assumption, recorded)."""


_XLA_HALF = {
    "score_format": "float32",
    "softmax_format": "float32",
    "mask_value": "0.7*finfo.min",
}
_TPU_DOT = {"default": "bf16x1", "high": "bf16x3", "highest": "bf16x6"}


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
            or ``"cudnn"`` outside a GPU or with float32 inputs.
    """
    impl = check_choice(implementation, "implementation", IMPLEMENTATIONS)
    check_choice(dtype, "dtype", DTYPES)
    check_choice(precision, "precision", PRECISIONS)
    check_choice(platform, "platform", PLATFORMS)
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
            return f"cudnn-{short}-online{ONLINE_BLOCK}", Numerics(**fields)
        return f"xla-{short}", Numerics(**fields)
    fields = {"input": "float32", "accum": "float32", "mask_value": "0.7*finfo.min"}
    if precision in _ALGORITHM_DOT:
        unit = _ALGORITHM_DOT[precision]
        label = unit.get("dot") or "tf32"
        return f"xla-f32-{label}", Numerics(**fields, **unit)
    if platform == "gpu" and precision != "highest":
        return "xla-f32-tf32", Numerics(**fields, operand_format="tf32")
    if platform == "tpu":
        dot = _TPU_DOT[precision]
        return f"xla-f32-{dot}", Numerics(**fields, dot=dot)
    return "xla-f32", Numerics(**fields)


def device_for(backend: str | None) -> jax.Device:
    name = jax.default_backend() if backend is None else backend
    try:
        return jax.devices(name)[0]
    except RuntimeError as exc:
        msg = f"backend: expected an available JAX backend ({jax.default_backend()!r}), got {name!r}: {exc}"
        raise InvalidArgument(msg) from None


def environment(device: jax.Device) -> dict[str, Any]:
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
