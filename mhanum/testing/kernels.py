"""Kernel descriptors: named numerics models of other people's attention kernels, with evidence.

A :class:`Kernel` says, for each input format it accepts, which :class:`~mhanum.Numerics` the
kernel may compute with, and what it returns for a query row that attends no key. Where the
numerics cannot be pinned down exactly (a library may or may not upcast, may choose its block size
at run time), the descriptor lists every candidate: :func:`mhanum.testing.attention_tolerance` takes
the largest of their bounds, element by element, so the tolerance holds whichever the kernel runs.

Every candidate is a model that mhanum's emulation runs exactly and Theorem A.1 bounds; the
``evidence`` names the source files (and versions) the model was read from and the measurements
that confirmed it. A kernel whose arithmetic mhanum cannot model yet is not listed (see
:data:`NOT_MODELLED`), rather than listed with a tolerance that might not hold.

>>> k = get_kernel("torch-sdpa-math")
>>> for n in k.candidates("float32"):
...     print(n.describe())
Numerics(input='float32', accum='float32', mask_mode='add', scale='qk', div_ulps=2.0)
>>> k.fully_masked
'zero'
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from mhanum._errors import InvalidArgument
from mhanum.numerics import Numerics

__all__ = ["FULLY_MASKED", "KERNELS", "NOT_MODELLED", "Kernel", "get_kernel"]

FULLY_MASKED = ("nan", "zero", "uniform", "unmasked")
"""What a kernel returns for a row that attends no key: NaN, zeros, the mean of the values, or the
unmasked attention (a finite constant added to every logit of the row cancels)."""

_HALF = ("bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class Kernel:
    """A named numerics model of an attention kernel.

    Attributes:
        name: the registry name (``"torch-sdpa-math"``, ``"jax-xla"``, ...).
        models: input format name -> the candidate numerics for inputs of that format.
        fully_masked: one of :data:`FULLY_MASKED`.
        evidence: where each modelling choice was read or measured (files, functions, versions).
        notes: what the model leaves out or assumes.
        mask_add: for a kernel that masks by adding this finite constant to its base-2 scaled
            scores (the Triton tutorial's ``-1.0e6``) rather than by ``-inf``: the candidates
            model ``-inf`` masking, and :func:`mhanum.testing.attention_oracle` proves on the
            concrete inputs that every masked key's exponential vanishes in the output, or
            gives its row an infinite tolerance with the reason. ``None``: ``-inf`` masking.
        max_head_dim: the largest head dimension (of q·k and of v) the candidates cover, for a
            kernel that runs another algorithm past it; ``None`` for any.
        known_rounding: whether the tolerance may take the scores' and probabilities'
            roundings as known where their value is (steps 3k, 6k and 6r of Theorem A.1): only
            for a kernel whose scores and weights before their rounding are measured to follow
            its candidates to within their stated errors. ``False`` (the default) takes step
            6's charge, which also covers a kernel whose exponential or scores deviate slightly
            from the model (as PyTorch's CPU flash kernel with AVX2 did from a model that took
            its half-precision exponential for the float32 one: a bfloat16 weight lying 5e-5
            above a rounding midpoint was rounded down, within step 6's charge but not within
            the known rounding; its descriptor now states that exponential).
    """

    name: str
    models: Mapping[str, tuple[Numerics, ...]]
    fully_masked: str
    evidence: tuple[str, ...]
    notes: str = ""
    mask_add: float | None = None
    max_head_dim: int | None = None
    known_rounding: bool = False

    def __post_init__(self) -> None:
        if self.fully_masked not in FULLY_MASKED:
            msg = f"fully_masked: expected one of {FULLY_MASKED}, got {self.fully_masked!r}"
            raise InvalidArgument(msg)
        if not isinstance(self.known_rounding, bool):
            msg = f"known_rounding: expected True or False, got {self.known_rounding!r}"
            raise InvalidArgument(msg)
        if not self.models or not all(self.models.values()):
            msg = "models: expected at least one candidate numerics for each input format"
            raise InvalidArgument(msg)
        if self.mask_add is not None and not (
            isinstance(self.mask_add, (int, float)) and -math.inf < self.mask_add < 0
        ):
            msg = f"mask_add: expected None or a finite negative number, got {self.mask_add!r}"
            raise InvalidArgument(msg)
        if self.max_head_dim is not None and not (
            isinstance(self.max_head_dim, int) and self.max_head_dim >= 1
        ):
            msg = f"max_head_dim: expected None or an integer >= 1, got {self.max_head_dim!r}"
            raise InvalidArgument(msg)

    @property
    def formats(self) -> tuple[str, ...]:
        """The input formats the kernel accepts."""
        return tuple(self.models)

    def candidates(self, fmt: str) -> tuple[Numerics, ...]:
        """The candidate numerics for inputs of format ``fmt``.

        Raises:
            InvalidArgument: for a format the kernel does not take.
        """
        if fmt not in self.models:
            msg = f"dtype: expected one of {self.formats} for kernel {self.name!r}, got {fmt!r}"
            raise InvalidArgument(msg)
        return self.models[fmt]

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready description."""
        return {
            "name": self.name,
            "models": {f: [n.describe() for n in c] for f, c in self.models.items()},
            "fully_masked": self.fully_masked,
            "evidence": list(self.evidence),
            "notes": self.notes,
            "mask_add": self.mask_add,
            "max_head_dim": self.max_head_dim,
            "known_rounding": self.known_rounding,
        }

    def check_head_dims(self, *dims: int) -> None:
        """Refuse head dimensions past :attr:`max_head_dim`.

        Raises:
            InvalidArgument: naming ``q`` and the kernel's limit.
        """
        if self.max_head_dim is not None and max(dims) > self.max_head_dim:
            msg = (
                f"q: expected head dimensions <= {self.max_head_dim} for kernel {self.name!r} "
                f"(it runs another algorithm past them), got {max(dims)}"
            )
            raise InvalidArgument(msg)


def _half_variants(base: Numerics, fmt: str, **stored: str) -> tuple[Numerics, ...]:
    """Half-precision inputs under a float32 model: upcast throughout, or stored in ``fmt``.

    The first candidate upcasts q, k, v to float32 and rounds only the output back; the second
    keeps the kernel's stored intermediates in ``fmt`` (scores, scaled operands and
    probabilities, unless ``stored`` names another format for one of them), with float32
    accumulation and a float32 softmax. Both accumulate dots in float32 (measured on the CPU: a
    bfloat16 dot of 1,024 ones is 1024 in jax and torch, not the 256 of a bfloat16 sum).
    """
    upcast = base.replace(
        input=fmt, score_format="float32", scale_format="float32", prob_format="float32",
        output_format=fmt,
    )  # fmt: skip
    fields = {"score_format": fmt, "scale_format": fmt, "prob_format": fmt, **stored}
    kept = base.replace(input=fmt, softmax_format="float32", output_format=fmt, **fields)
    return (upcast, kept)


_MATH_SOURCE = (
    "aten/src/ATen/native/transformers/attention.cpp: _scaled_dot_product_attention_math "
    "(torch 2.13): q and k each times sqrt(scale) (a negative scale: q times "
    "-sqrt(|scale|), k times sqrt(|scale|)), a boolean mask as 0/-inf added, "
    "_safe_softmax (a row that attends no key is 0), then P @ V"
)


def _torch_sdpa_math() -> Kernel:
    base = Numerics(
        input="float32", accum="float32", scale="qk", mask_mode="add",
        mask_value=-math.inf, div_ulps=2.0,
    )  # fmt: skip
    models = {"float32": (base,), **{f: _half_variants(base, f)[:1] for f in _HALF}}
    return Kernel(
        "torch-sdpa-math",
        models,
        "zero",
        (
            _MATH_SOURCE,
            (
                "half inputs are upcast to float32 and only the output is rounded back, unless "
                "torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True) (off by default; "
                "see 'torch-sdpa-math-reduced'); measured with torch 2.13 on the CPU: bfloat16 and "
                "float16 outputs bit-identical to the float32 computation rounded"
            ),
        ),
        "softmax as exp(x - max) / sum with a reciprocal (div_ulps = 2)",
    )


def _torch_sdpa_math_reduced() -> Kernel:
    base = _torch_sdpa_math().models["float32"][0]
    return Kernel(
        "torch-sdpa-math-reduced",
        {"float32": (base,), **{f: _half_variants(base, f) for f in _HALF}},
        "zero",
        (
            _MATH_SOURCE,
            (
                "torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True): the math backend "
                "may keep scores and probabilities in the input type; both that and the upcast "
                "are covered (accumulation in float32 either way)"
            ),
        ),
        "float32 inputs as 'torch-sdpa-math'",
    )


# PyTorch's CPU flash kernel, half inputs, AVX2: the float exponential's relative error is at
# most 2·exp_ulps·2^-24 = 2^-12 (measured at most 1.5e-4 = 2^-12.7:
# tests/testing/test_torch_flash_exponential.py measures it on every run)
_FAST_EXP_ULPS = 2048.0


def _gradual(num: Numerics) -> Numerics:
    """``num`` with its float16 weights rounded with gradual underflow (measured for the CPU
    kernels' float32 -> float16 conversions); other formats as they were."""
    return num.replace(prob_underflow="gradual") if num.prob_format == "float16" else num


def _torch_sdpa_flash_cpu() -> Kernel:
    base = Numerics(
        input="float32", accum="float32", scale="scores", softmax="online(512)",
        mask_mode="add", mask_value=-math.inf, div_ulps=2.0, exp_ulps=20.0,
    )  # fmt: skip
    half = {
        f: (_gradual(base.replace(input=f, score_format="float32", scale_format="float32",
                                  softmax_format="float32", prob_format=f, output_format=f,
                                  exp_ulps=_FAST_EXP_ULPS)),)
        for f in _HALF
    }  # fmt: skip
    return Kernel(
        "torch-sdpa-flash-cpu",
        {"float32": (base,), **half},
        "zero",
        (
            (
                "aten/src/ATen/native/cpu/FlashAttentionKernel.cpp (torch 2.13): key blocks of "
                "min(kv_split_size, L) = min(512, L), a running maximum and sum in accum_t (float), "
                "exp by the vectorised exp_u20 (<= 20 ulps), the output divided once at the end"
            ),
            (
                "half inputs: scores, maximum and sum in float, the probabilities converted to the "
                "input type (qk_reduced) for the P V product, accumulated in float"
            ),
            (
                "half inputs, the exponential: with AVX2 kernels (ATEN_CPU_CAPABILITY=avx2) a "
                "fast float exponential meant for outputs rounded to half precision, measured "
                "through the kernel's logsumexp (torch 2.13) within 1.5e-4 relative of exp at "
                "819,200 arguments in [-4.2, 0), six periods of its range reduction; the model "
                "takes 2^-12 (exp_ulps = "
                f"{_FAST_EXP_ULPS:g}); the AVX-512 kernels' logsumexp measured within 6e-7, but "
                "their half-precision weights are not within 512 ulps of exp (the read-back of "
                "their roundings finds one outside at exp_ulps = 512, none at 1024), so the "
                "model's 2^-12 is kept for every machine"
            ),
            (
                "the weights before their rounding to the input type follow the model (with "
                "that exponential), measured with the AVX2 and the AVX-512 kernels by reading "
                "every bfloat16 and float16 weight back through identity columns of v (163,840 "
                "weights of 40 drawn problems: 4 to 16 queries, 64 to 1,024 keys, logits "
                "spread up to 30, tied keys, causal rows), each within the rounding Lemma 6k "
                "allows, and on 60 problems of the peers' kinds with no element outside the "
                "tolerance: known_rounding=True; tests/testing/test_known_rounding_evidence.py "
                "repeats it on every run"
            ),
            (
                "float16 weights below float16's smallest normal number are rounded to the "
                "nearest subnormal (gradual underflow, prob_underflow='gradual'), not flushed: "
                "the same read-back, weights down to e^-30 of the row's largest"
            ),
        ),
        "float32 inputs: the same model as mhanum.adapters.torch.sdpa_model('flash')",
        known_rounding=True,
    )


def _jax_xla() -> Kernel:
    base = Numerics(
        input="float32", accum="float32", scale="scores", mask_mode="fill",
        mask_value="0.7*finfo.min",
    )  # fmt: skip
    half = {
        f: (base.replace(input=f, score_format="float32", scale_format="float32",
                         softmax_format="float32", prob_format=f, output_format=f),)
        for f in _HALF
    }  # fmt: skip
    return Kernel(
        "jax-xla",
        {"float32": (base,), **half},
        "uniform",
        (
            (
                "jax/_src/nn/functions.py: _dot_product_attention_xla / _dot_product_attention_core "
                "(jax 0.10): logits = einsum with preferred_element_type promote_types(dtype, "
                "float32) (half inputs: precision BF16_BF16_F32 / F16_F16_F32), scaled in that "
                "type, masked by where(mask, logits, 0.7 * finfo(float32).min), softmax in "
                "float32, probabilities cast to the input dtype, einsum with v in the input dtype"
            ),
            (
                "measured with jax 0.10 on the CPU: bfloat16 outputs bit-identical to mhanum's "
                "emulation of this model (L x d = 128x64, 96x128, 33x16); float16 identical but "
                "for one-ulp differences of summation order, which 'native' covers"
            ),
        ),
        "on a GPU, jax's default float32 matmul precision is TF32: use 'jax-xla-tf32' there",
    )


_FA2_SOURCE = (
    "flash-attention csrc/flash_attn/src (FlashAttention-2): flash_fwd_kernel.h "
    "(compute_attn_1rowblock: S = Q K_b^T on tensor cores from zero, masked with -inf, "
    "softmax_rescale_o, P converted to the input type, acc_o accumulated by gemm_rs with acc_o as "
    "the MMA accumulator; at the end acc_o times 1/row_sum, 0 for a row without keys), "
    "softmax.h (scale_apply_exp2: exp2f(x * scale_log2 - max * scale_log2), max over the "
    "unscaled scores, 0 for an all -inf row; the rescale exp2f((max_prev - max) * "
    "scale_log2); row_sum carried across blocks), flash_api.cpp (scale_softmax_log2 = "
    "softmax_scale * M_LOG2E as a float)"
)


def _fa2_models(fmt: str, blocks: tuple[int, ...] = (32, 64, 128)) -> tuple[Numerics, ...]:
    short = {"bfloat16": "bf16", "float16": "fp16"}[fmt]
    return tuple(
        Numerics(
            input=fmt,
            accum="float32",
            score_format="float32",
            softmax_format="float32",
            prob_format=fmt,
            output_format=fmt,
            dot=f"tensor-core({arch}-{short})",
            softmax=f"online({block})",
            online_sums="running",
            exp_form="exp2-folded",
            mask_mode="fill",
            mask_value=-math.inf,
            div_ulps=2.0,
            exp_ulps=4.0,
        )
        for arch in ("a100", "h100")
        for block in blocks
    )


def _fa2_kernel(name: str, extra: tuple[str, ...]) -> Kernel:
    return Kernel(
        name,
        {f: _fa2_models(f) for f in _HALF},
        "zero",
        (
            _FA2_SOURCE,
            (
                "candidates: the A100 and H100 tensor-core models (mma on float32 "
                "accumulators) and key blocks of 32, 64 and 128 (kBlockN of the head dimensions "
                "and architectures in flash_fwd_launch_template.h); the key blocks are visited "
                "last to first, which the bound, symmetric in the keys, covers"
            ),
            (
                "exp2f under --use_fast_math is ex2.approx.ftz.f32: exp_ulps = 4 (the CUDA "
                "guide states 2 ulp for exp2f), subnormal results flushed (charged as "
                "underflow); the reciprocal of the row sum (1.f / sum, rcp.approx under fast "
                "math: within 1 ulp) then a product: div_ulps = 2"
            ),
            *extra,
        ),
        "half inputs only (no float32 path); a fused multiply-add of x * scale_log2 - "
        "max_scaled rounds a subset of what the unfused model charges",
    )


def _flash_attention_2() -> Kernel:
    return _fa2_kernel("flash-attention-2", ())


def _flash_attention_3() -> Kernel:
    blocks = (64, 80, 96, 112, 128, 144, 160, 176, 192, 224)
    models = {f: tuple(n for n in _fa2_models(f, blocks) if "h100" in str(n.dot)) for f in _HALF}
    return Kernel(
        "flash-attention-3",
        models,
        "zero",
        (
            (
                "flash-attention hopper/softmax.h (FlashAttention-3): scale_apply_exp2, "
                "exp2f(x * scale_log2 - max * scale_log2) with the maximum of the unscaled "
                "scores, the rescaling exp2f((max_prev - max) * softmax_scale_log2), row_sum "
                "rescaled then each block's sum added; finalize: 1.f / sum (0 for a row whose "
                "sum is 0), the output times it (rescale_o)"
            ),
            (
                "hopper/mainloop_fwd_sm90_tma_gmma_ws.hpp: S = Q K^T and O += P V on wgmma "
                "with float32 accumulators (the H100 tensor-core model, which matches cuBLAS's "
                "wgmma products bit for bit: papers/tensorcore.md), P converted to the input "
                "type; IntraWGOverlap moves the rescaling of O after the previous block's P V "
                "in time only, the same sequence of products and sums"
            ),
            (
                "candidates: key blocks of 64 to 224 (hopper/tile_size.h, tile_size_fwd_sm90, "
                "16-bit inputs), the H100 models; div_ulps = 2 (1.f / sum under fast math) "
                "and exp_ulps = 4"
            ),
        ),
        "bfloat16 and float16 with num_splits=1 (the default 0 lets a heuristic split the keys "
        "and merge them with its own combine kernel, not modelled), no soft-cap (folded into "
        "the scale) and no fp8 (its two-level accumulation is not modelled)",
    )


def _torch_sdpa_flash_cuda() -> Kernel:
    return _fa2_kernel(
        "torch-sdpa-flash-cuda",
        (
            (
                "aten/src/ATen/native/transformers/cuda/flash_attn (torch 2.13): PyTorch's copy "
                "of FlashAttention-2, softmax.h built with UNFUSE_FMA (pytorch issue 121558): "
                "exp2f(__fmul_rn(x, scale_log2) - max_scaled), the product and the subtraction "
                "rounded separately, as mhanum's emulation of the model"
            ),
        ),
    )


def _triton_tutorial() -> Kernel:
    # FlashAttention-2's float16 candidates (tensor-core models, key blocks, running sums),
    # with the scores scaled into base 2 and a true division
    models = tuple(n.replace(exp_form="exp2-scaled") for n in _fa2_models("float16"))
    return Kernel(
        "triton-tutorial",
        {"float16": models},
        "zero",
        (
            (
                "triton python/tutorials/06-fused-attention.py (triton 3.x, _attn_fwd and "
                "_attn_fwd_inner): qk = tl.dot(q, k) in float32 from float16 operands; "
                "qk_scale = sm_scale * 1.44269504 in float32 (the literal rounds to "
                "fl32(log2 e)); off the diagonal m_ij = max(m_i, max(qk) * qk_scale) and "
                "p = exp2(qk * qk_scale - m_ij); on the causal diagonal qk * qk_scale + "
                "where(mask, 0, -1.0e6) first; alpha = exp2(m_i - m_ij); l_i = l_i * alpha + "
                "sum(p); acc = acc * alpha, then tl.dot(p.to(float16), v, acc); at the end "
                "acc / l_i, stored as float16"
            ),
            (
                "candidates: the A100 and H100 tensor-core models and key blocks of 32, 64 and "
                "128 (BLOCK_N of the autotuned configurations, with and without TMA)"
            ),
            (
                "exp_form='exp2-scaled': the maximum of the scaled scores (max fl(t*c2) = "
                "fl(max(t)*c2), rounding being monotone) and the rescaling exp2 of the "
                "difference of two such maxima; exp2 as ex2.approx (exp_ulps = 4); the "
                "division acc / l_i within 2 ulps (div.full.f32 or a correctly rounded "
                "quotient: div_ulps = 2)"
            ),
            (
                "the row sum l_i * alpha + sum(p) (a tree over the block, then the carried "
                "term, maybe fused) is one of the orders the running chain of the bound covers "
                "in the native order; a fused multiply-add rounds a subset of what the model "
                "charges"
            ),
        ),
        "float16 only (its probabilities are converted to float16); the fp8 path (float8e5 "
        "values and probabilities) is not modelled. Its causal mask adds -1.0e6 to the base-2 "
        "scores: mask_add",
        mask_add=-1.0e6,
    )


_MEM_EFF_SOURCE = (
    "aten/src/ATen/native/transformers/cuda/mem_eff_attention/kernel_forward.h (torch 2.x, "
    "xFormers' CUTLASS kernel, built with bias support): S = Q K^T on tensor cores "
    "(gemm_kernel_utils.h: DefaultGemmType of 16-bit types, OpMultiplyAdd), accum = "
    "p.scale * accum in float, the bias (the input type) added, the causal mask -inf; "
    "iterative_softmax: frag * (1.0f * kLog2e), the row maximum of those (atomicMaxFloat), "
    "exp2f(m_prime - mi) rescaling s_prime and the register accumulator, exp2f(frag - mi), "
    "the warps' partial row sums added to the rescaled s_prime; P stored in the input type "
    "(accumToSmem) for P V, accumulated into the register accumulator (kKeepOutputInRF when "
    "kMaxK <= kKeysPerBlock)"
)


def _torch_sdpa_efficient() -> Kernel:
    def models(fmt: str) -> tuple[Numerics, ...]:
        # FlashAttention-2's candidates on the A100 model, with the logits taken into base 2
        # and the reciprocal of the row sum within 2 ulps
        fa2 = _fa2_models(fmt, (64, 128))
        return tuple(n.replace(exp_form="exp2") for n in fa2 if "a100" in str(n.dot))

    return Kernel(
        "torch-sdpa-efficient",
        {f: models(f) for f in _HALF},
        "zero",
        (
            _MEM_EFF_SOURCE,
            (
                "epilogue/epilogue_rescale_output.h (MemoryEfficientAttentionNormalize): "
                "alpha = 1 / s_prime (1 for a row whose sum is 0: a row that attends no key "
                "returns 0), the output alpha * accumulator: a reciprocal then a product, "
                "div_ulps = 2 covers a correctly rounded or an approximate reciprocal"
            ),
            (
                "kernels/cutlassF*.cu: the Sm80 kernels 64x64 (head dimensions <= 64) and "
                "64x128 (<= 128) keep the output in registers (online_sums='running', key "
                "blocks 64 and 128); past 128 a 32x128 kernel accumulates in global memory "
                "through the epilogue, which is not modelled (max_head_dim = 128)"
            ),
            (
                "the row sum: the rescaled s_prime, then each warp's partial sum, is one of the "
                "orders the running chain covers in the native order; exp2f within 4 ulps "
                "(ex2.approx under fast math)"
            ),
        ),
        "half inputs; float32 runs 3xTF32 tensor-core products (OpMultiplyAddFastF32), which "
        "no dot unit of mhanum models. Hopper runs the same Sm80 kernel (mma.sync in steps of 8 "
        "products): the A100 model is assumed for it. A float bias reaches the kernel in the "
        "input type (SDPA converts it): pass it in that type",
        max_head_dim=128,
    )


def _flex_attention() -> Kernel:
    blocks = (16, 32, 64, 128)
    half = {f: tuple(n.replace(exp_form="exp2") for n in _fa2_models(f, blocks)) for f in _HALF}
    single = tuple(
        Numerics(
            input="float32",
            accum="float32",
            softmax=f"online({block})",
            online_sums="running",
            exp_form="exp2",
            mask_value=-math.inf,
            div_ulps=2.0,
            exp_ulps=4.0,
        )
        for block in blocks
    )
    return Kernel(
        "flex-attention",
        {"float32": single, **half},
        "zero",
        (
            (
                "torch/_inductor/kernel/flex/templates/common.py.jinja (torch 2.13, "
                "forward_block_mn): qk = tl.dot(q, k, input_precision=FLOAT32_PRECISION) in "
                "float32, qk *= SM_SCALE, the score_mod, masked scores -inf, then "
                "post_mod_scores *= RCP_LN2 (1.44269504, fl32(log2 e)); m_ij = max(m_i, "
                "max(post_mod_scores)), alpha = exp2(m_i - m_ij), p = exp2(post_mod_scores - "
                "m_ij) (a row with every score -inf shifted by 0), l_i = l_i * alpha + sum(p), "
                "acc = acc * alpha, then tl.dot(p.to(MATMUL_PRECISION), v, acc): the "
                "probabilities in the input type, the output carried in the dot"
            ),
            (
                "templates/flex_attention.py.jinja: l_i = 1 where it is 0 (a row that attends "
                "no key returns 0), acc / l_i (div.full.f32 or a correctly rounded quotient: "
                "div_ulps = 2), stored in the input type"
            ),
            (
                "candidates: BLOCK_N of 16, 32, 64 and 128 (template_heuristics/triton.py, the "
                "default and autotuned FlexConfigs), the A100 and H100 tensor-core models for "
                "half inputs; float32 dots with FLOAT32_PRECISION 'ieee' (the default: "
                "torch.backends.cuda.matmul.allow_tf32 off) are fused multiply-adds, a subset of "
                "the roundings of the 'ieee' dot unit"
            ),
        ),
        "the CUDA (Triton) kernel with score_mod the identity, an additive bias (bias=) or a "
        "soft-cap (softcap=), and a mask_mod (mask=, -inf); not PRESCALE_QK (q pre-scaled by "
        "scale*log2 e), not the TF32 dots of allow_tf32, not the CPU kernel (flex_cpu.py) nor "
        "the eager reference",
    )


def _jax_xla_cpu() -> Kernel:
    k = _jax_xla()
    return Kernel(
        "jax-xla-cpu",
        {f: tuple(_gradual(m) for m in models) for f, models in k.models.items()},
        k.fully_masked,
        (
            *k.evidence,
            (
                "XLA's CPU backend (jax 0.10): the float32 weights before their rounding to the "
                "input type follow the model (an exponential within exp_ulps, the sum in any "
                "order, the division within div_ulps), measured by reading every bfloat16 and "
                "float16 weight back through identity columns of v: 535,342 weights of 60 drawn "
                "problems (1 to 64 queries, 7 to 1,024 keys, logits spread up to 30, near-tied "
                "keys, causal rows), each within the rounding Lemma 6k allows; "
                "tests/testing/test_known_rounding_evidence.py repeats it on every run"
            ),
            (
                "float16 weights below float16's smallest normal number are rounded to the "
                "nearest subnormal (gradual underflow, prob_underflow='gradual'), not flushed, "
                "in the same read-back (XLA's CPU runtime flushes float32 subnormals, which the "
                "softmax format's own smallest normal number covers)"
            ),
        ),
        "'jax-xla' where the kernel runs on XLA's CPU backend: its weights' roundings to the input "
        "type are taken as known (steps 6k and 6r of Theorem A.1, known_rounding=True); on a GPU, "
        "where this is not measured, use 'jax-xla' (half inputs) or 'jax-xla-tf32'",
        known_rounding=True,
    )


def _jax_xla_tf32() -> Kernel:
    base = _jax_xla().models["float32"][0].replace(operand_format="tf32")
    return Kernel(
        "jax-xla-tf32",
        {"float32": (base,)},
        "uniform",
        (*_jax_xla().evidence, "JAX's default float32 matmul precision on Ampere+ GPUs is TF32"),
    )


def _torch_sdpa_math_tf32() -> Kernel:
    k = _torch_sdpa_math()
    base = k.models["float32"][0].replace(operand_format="tf32")
    return Kernel(
        "torch-sdpa-math-tf32",
        {"float32": (base,)},
        "zero",
        (*k.evidence, "torch.backends.cuda.matmul.allow_tf32 = True (off by default)"),
    )


KERNELS: Mapping[str, Kernel] = {
    k.name: k
    for k in (
        _torch_sdpa_math(),
        _torch_sdpa_math_reduced(),
        _torch_sdpa_math_tf32(),
        _torch_sdpa_flash_cpu(),
        _jax_xla(),
        _jax_xla_cpu(),
        _jax_xla_tf32(),
        _flash_attention_2(),
        _torch_sdpa_flash_cuda(),
        _triton_tutorial(),
        _torch_sdpa_efficient(),
        _flex_attention(),
        _flash_attention_3(),
    )
}
"""The registered kernels, by name."""

NOT_MODELLED: Mapping[str, str] = {
    "flash-attention-3-fp8": "FlashAttention-3 on fp8 inputs: its two-level accumulation "
    "(hopper/utils.h: each block's wgmma from zero, then added to the accumulator) is not "
    "modelled (its lifted probabilities are: Numerics.prob_offset; and its per-tensor "
    "descaling: descale=)",
    "flash-attention-3-split": "FlashAttention-3 with num_splits != 1 (0, the default, lets a "
    "heuristic decide): its combine kernel is not read to the rounding yet",
    "torch-sdpa-efficient-float32": "xFormers' CUTLASS kernel on float32 inputs: 3xTF32 "
    "tensor-core products (OpMultiplyAddFastF32), which no dot unit of mhanum models",
    "torch-sdpa-cudnn": "cuDNN's fused kernel: not documented to the rounding",
    "jax-cudnn": "cuDNN's fused kernel: not documented to the rounding",
    "triton-tutorial-fp8": "the Triton tutorial's fp8 path (float8e5 values, probabilities "
    "converted to float8e5): its per-tensor scaling is not read to the rounding yet",
    "flex-attention-prescaled": "flex_attention with PRESCALE_QK: q multiplied by "
    "scale*log2(e) and rounded to its type before the dot, which no scale placement models",
}
"""Kernels without a descriptor yet, and why (their tolerance could not be stated as a theorem)."""


def get_kernel(kernel: Kernel | str) -> Kernel:
    """A kernel descriptor by name (or the descriptor itself).

    Raises:
        InvalidArgument: for an unknown name (naming the kernels that exist, and why a known but
            unmodelled one has no descriptor).
    """
    if isinstance(kernel, Kernel):
        return kernel
    if isinstance(kernel, str) and kernel in KERNELS:
        return KERNELS[kernel]
    why = f" ({kernel} is not modelled: {NOT_MODELLED[kernel]})" if kernel in NOT_MODELLED else ""
    msg = f"kernel: expected one of {', '.join(KERNELS)} or a Kernel, got {kernel!r}{why}"
    raise InvalidArgument(msg)
