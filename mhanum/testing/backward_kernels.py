"""Backward kernel descriptors: numerics models of other people's attention backward passes.

A :class:`BackwardKernel` says, for each input format it accepts, which pairs of forward
:class:`~mhanum.Numerics` and :class:`~mhanum.Backward` the kernel's backward pass may compute
with, and where its arithmetic departs from those models in ways that the gradient oracle
(:func:`mhanum.testing.attention_grad_oracle`) accounts for on the concrete inputs: the placement
of the logit scale, a softmax backward written as a difference of products, and gradients
accumulated in the input type across blocks. :func:`mhanum.bounds.attention_grad_bound`
(Theorems B.1, B.2) bounds every candidate; the oracle takes the largest bound, element by
element.

Every descriptor's ``evidence`` names the source it was read from. A backward pass that the
bounds cannot model yet is listed in :data:`BACKWARD_NOT_MODELLED` with the reason, rather than
given a tolerance that might not hold.

Examples:
    >>> k = get_backward_kernel("torch-sdpa-flash-cpu")
    >>> [(b.algorithm, b.block_q, b.block_k, b.scale_at) for _, b in k.candidates("float32", 100)]
    [('flash2', 32, 512, 'partials'), ('flash2', 32, 512, 'ds')]
    >>> k.candidates("float32", 200)[0][1].block_q
    64
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from mhanum._errors import InvalidArgument
from mhanum.numerics import Backward, Numerics
from mhanum.testing.kernels import KERNELS

__all__ = [
    "BACKWARD_KERNELS",
    "BACKWARD_NOT_MODELLED",
    "SCALE_RULES",
    "SOFTMAX_BACKWARDS",
    "BackwardKernel",
    "get_backward_kernel",
]

SCALE_RULES = ("any", "power-of-two", "power-of-four")
"""For which logit scales ``c`` a kernel's scale placement rounds exactly as the bounds' model
(``c`` on the scores; ``dQ = c·(dS K)``, ``dK = c·(dSᵀ Q)``):

* ``"any"``: the kernel places the scale as the model does;
* ``"power-of-two"``: the kernel multiplies elsewhere (``dS`` by ``c`` before the dots, each
  block's partial ``dQ`` before it is added, or wherever a BLAS applies its ``alpha``); a
  product by a power of two is exact in binary floating point (outside the subnormal range),
  so it commutes with every rounding and the kernel computes exactly what the model does;
* ``"power-of-four"``: the kernel multiplies q and k by ``sqrt(c)`` (and ``dq``, ``dk`` by
  ``sqrt(c)``): exact when ``sqrt(|c|)`` is a power of two.
"""

SOFTMAX_BACKWARDS = ("fused", "products")
"""How a kernel forms ``dS``: ``"fused"`` as ``P ∘ (dP - D)`` (the model's rounding);
``"products"`` as ``P ∘ dP - P ∘ D`` (autodiff of ``jax.nn.softmax``'s JVP rule), whose extra
roundings the oracle adds: ``|Δ| <= u(1 + u)·P̂(|dP̂| + |D̂|)`` per element of ``dS``, carried
through the dots that read ``dS``."""


@dataclasses.dataclass(frozen=True)
class BackwardKernel:
    """A named numerics model of an attention kernel's backward pass.

    Attributes:
        name: the registry name (``"torch-sdpa-math"``, ``"jax-xla"``, ...).
        models: input format name -> the candidate ``(Numerics, Backward)`` pairs (the forward
            the backward reads, and the backward's own choices). With :attr:`q_blocks`, the
            ``Backward``'s ``block_q`` is replaced by the one the kernel picks for the query
            length.
        evidence: where each modelling choice was read (files, functions, versions).
        notes: what the model leaves out or assumes.
        scale_rule: one of :data:`SCALE_RULES`.
        scale_rules: ``((format, rule), ...)``: the rule of those input formats where it
            differs from ``scale_rule`` (a kernel whose candidates model every scale placement
            for float32 inputs but not for half ones).
        softmax_backward: one of :data:`SOFTMAX_BACKWARDS`.
        q_blocks: ``((min_length, block_q), ...)``, largest first: the query block of a kernel
            that picks it from the query length (the first whose ``min_length <= Lq``);
            ``None`` to keep the candidates' ``block_q``.
        accumulates_in_input: the kernel adds the blocks' partial ``dq``, ``dk``, ``dv`` in the
            input type (PyTorch's CPU flash backward): the half formats are modelled only when
            every gradient has one block (the model accumulates in float32), and grouped heads
            only then (measured with torch 2.13: with one block, float32 grouped gradients are
            bit-identical to each head's then their sum; with several they are not).
        grouped: how ``enable_gqa`` sums a group's ``dk``, ``dv``: ``"per-head"`` (each head's
            gradient, then their sum: ``repeat_interleave``'s backward), ``"one-dot"`` (one dot
            over the group's heads and query rows, in any order: ``jax.nn``'s einsum), or
            ``None`` when grouped heads are not modelled.
        whole_queries: the kernel accumulates ``dK`` and ``dV`` in its dots' accumulator
            across the query blocks (FlashAttention-2's ``acc_dk``, ``acc_dv``: one chain over
            every query), modelled as one query block of all ``Lq`` queries.
        mask_fill: the finite value a kernel puts in place of a masked logit (``jax.nn``:
            ``-0.7·finfo(float32).max``), its candidates modelling ``-inf`` masking: the
            oracle checks on the inputs that every masked exponential is exactly 0; ``None``
            for ``-inf`` masking.
    """

    name: str
    models: Mapping[str, tuple[tuple[Numerics, Backward], ...]]
    evidence: tuple[str, ...]
    notes: str = ""
    scale_rule: str = "any"
    softmax_backward: str = "fused"
    scale_rules: tuple[tuple[str, str], ...] = ()
    q_blocks: tuple[tuple[int, int], ...] | None = None
    accumulates_in_input: bool = False
    grouped: str | None = "per-head"
    mask_fill: float | None = None
    whole_queries: bool = False

    def __post_init__(self) -> None:
        if not self.models or not all(self.models.values()):
            msg = "models: expected at least one candidate (Numerics, Backward) per input format"
            raise InvalidArgument(msg)
        for fmt, pairs in self.models.items():
            for pair in pairs:
                if not (
                    isinstance(pair, tuple)
                    and len(pair) == 2
                    and isinstance(pair[0], Numerics)
                    and isinstance(pair[1], Backward)
                ):
                    msg = f"models[{fmt!r}]: expected (Numerics, Backward) pairs, got {pair!r}"
                    raise InvalidArgument(msg)
        for rule in (self.scale_rule, *(r for _, r in self.scale_rules)):
            if rule not in SCALE_RULES:
                msg = f"scale_rule: expected one of {SCALE_RULES}, got {rule!r}"
                raise InvalidArgument(msg)
        if self.softmax_backward not in SOFTMAX_BACKWARDS:
            msg = (
                f"softmax_backward: expected one of {SOFTMAX_BACKWARDS}, "
                f"got {self.softmax_backward!r}"
            )
            raise InvalidArgument(msg)
        if self.grouped not in (None, "per-head", "one-dot"):
            msg = f"grouped: expected None, 'per-head' or 'one-dot', got {self.grouped!r}"
            raise InvalidArgument(msg)
        if self.grouped == "one-dot" and any(
            b.algorithm != "textbook" for pairs in self.models.values() for _, b in pairs
        ):
            msg = "grouped: expected 'one-dot' only with textbook candidates (one chain per dot)"
            raise InvalidArgument(msg)
        if self.mask_fill is not None and not (
            isinstance(self.mask_fill, (int, float)) and -math.inf < self.mask_fill < -1e4
        ):
            msg = f"mask_fill: expected None or a finite number below -1e4, got {self.mask_fill!r}"
            raise InvalidArgument(msg)

    @property
    def formats(self) -> tuple[str, ...]:
        """The input formats the kernel accepts."""
        return tuple(self.models)

    def block_q(self, lq: int) -> int | None:
        """The query block the kernel picks for ``lq`` queries (``None``: the candidates')."""
        if self.q_blocks is None:
            return None
        return next(block for start, block in self.q_blocks if lq >= start)

    def candidates(self, fmt: str, lq: int) -> tuple[tuple[Numerics, Backward], ...]:
        """The candidate ``(Numerics, Backward)`` pairs for ``lq`` queries of format ``fmt``.

        Raises:
            InvalidArgument: for a format the kernel does not take.
        """
        if fmt not in self.models:
            msg = f"dtype: expected one of {self.formats} for kernel {self.name!r}, got {fmt!r}"
            raise InvalidArgument(msg)
        block = max(lq, 1) if self.whole_queries else self.block_q(lq)
        if block is None:
            return self.models[fmt]
        return tuple((n, dataclasses.replace(b, block_q=block)) for n, b in self.models[fmt])

    def on_scores(
        self, pairs: tuple[tuple[Numerics, Backward], ...], scale: float
    ) -> tuple[tuple[Numerics, Backward], ...]:
        """``pairs`` with every scale on the scores, multiplying ``dQ`` and ``dK`` after the
        dots, for a theorem that models only that placement (B.6): a square root on ``q`` and
        ``k`` that is a power of two, or a power-of-two scale on ``dS``, rounds alike (outside
        the subnormal range); any other is refused.

        Raises:
            InvalidArgument: naming ``scale``, the kernel and why.
        """
        if all(n.scale == "scores" and b.scale_at == "output" for n, b in pairs):
            return pairs
        split = any(n.scale == "qk" for n, _ in pairs)
        root = math.sqrt(abs(scale)) if split else abs(scale)
        if not _is_power_of_two(root):
            why = "a power of four" if split else "a power of two"
            how = "q and k by the scale's square root" if split else "by the scale elsewhere"
            msg = (
                f"scale: expected {why} for the multi-head backward of kernel {self.name!r} "
                f"(it multiplies {how}, and Theorem B.6 models the scale on the scores, after "
                f"the dots), got {scale!r}"
            )
            raise InvalidArgument(msg)
        return tuple(
            (n.replace(scale="scores"), dataclasses.replace(b, scale_at="output")) for n, b in pairs
        )

    def check_scale(self, scale: float, fmt: str | None = None) -> None:
        """Refuse a scale whose placement in the kernel does not round as the model's (for
        inputs of ``fmt``, where :attr:`scale_rules` names a rule of its own).

        Raises:
            InvalidArgument: naming ``scale``, the kernel and why.
        """
        rule = dict(self.scale_rules).get(fmt or "", self.scale_rule)
        if rule == "any":
            return
        root = abs(scale) if rule == "power-of-two" else math.sqrt(abs(scale))
        if _is_power_of_two(root):
            return
        why = {
            "power-of-two": "a power of two (it multiplies by the scale elsewhere than the model)",
            "power-of-four": "a power of four (it multiplies q and k by its square root)",
        }[rule]
        msg = (
            f"scale: expected {why} for the backward of kernel {self.name!r}, so that its "
            f"scale placement rounds as the model's; got {scale!r}"
        )
        raise InvalidArgument(msg)

    def check_blocks(self, lq: int, lk: int, fmt: str, *, grouped: bool = False) -> None:
        """Refuse half-precision inputs that a kernel accumulating in the input type would add
        over several blocks, and grouped heads over several blocks (such a kernel may add the
        group's partials in one buffer, an order the per-head model does not cover).

        Raises:
            InvalidArgument: naming ``q`` or ``k`` (or ``enable_gqa``) and the kernel's blocks.
        """
        if not self.accumulates_in_input:
            return
        if grouped:
            for _, b in self.candidates(fmt, lq):
                if lq > b.block_q or lk > b.block_k:
                    msg = (
                        f"enable_gqa: expected False for kernel {self.name!r} with more than "
                        f"{b.block_q} queries or {b.block_k} keys (it may add a group's partial "
                        f"dk, dv block by block in one buffer, not modelled), got True with "
                        f"{lq} queries and {lk} keys"
                    )
                    raise InvalidArgument(msg)
        if fmt == "float32":
            return
        for _, b in self.candidates(fmt, lq):
            for name, length, block in (("q", lq, b.block_q), ("k", lk, b.block_k)):
                if length > block:
                    msg = (
                        f"{name}: expected at most {block} rows for {fmt} inputs to kernel "
                        f"{self.name!r} (it adds the blocks' partial gradients in {fmt}, which "
                        f"the model does not), got {length}"
                    )
                    raise InvalidArgument(msg)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready description."""
        return {
            "name": self.name,
            "models": {
                f: [{"numerics": n.describe(), "backward": b.to_dict()} for n, b in c]
                for f, c in self.models.items()
            },
            "evidence": list(self.evidence),
            "notes": self.notes,
            "scale_rule": self.scale_rule,
            "scale_rules": [list(x) for x in self.scale_rules],
            "softmax_backward": self.softmax_backward,
            "q_blocks": None if self.q_blocks is None else [list(x) for x in self.q_blocks],
            "accumulates_in_input": self.accumulates_in_input,
            "grouped": self.grouped,
            "mask_fill": self.mask_fill,
        }


def _is_power_of_two(x: float) -> bool:
    if not (math.isfinite(x) and x > 0):
        return False
    return math.frexp(x)[0] == 0.5


_HALF = ("bfloat16", "float16")

_MATH_BACKWARD = (
    "aten/src/ATen/native/transformers/attention.cpp: _scaled_dot_product_attention_math "
    "(torch 2.13): q times sqrt(scale), k times sqrt(scale), matmul, the mask added (a boolean "
    "mask as 0/-inf), _safe_softmax, matmul with v; autograd differentiates each op: "
    "dV = Pᵀ dO, dP = dO Vᵀ, _softmax_backward_data (aten/src/ATen/native/cpu/SoftMaxKernel.cpp, "
    "_vec_softmax_backward: D = sum(dP * P), then P * (dP - D)), the products' backward with "
    "the scaled operands, and the products by sqrt(scale) again (mul's backward: the gradient "
    "times the same Python scalar): dq = fl(sqrt(c)·(dS k̂')), dk = fl(sqrt(c)·(dSᵀ q̂')) with "
    "q̂' = fl(sqrt(c)·q), k̂' = fl(sqrt(c)·k), modelled by Numerics(scale='qk')"
)


def _autograd(num: Numerics) -> tuple[Numerics, Backward]:
    """The textbook backward of the forward ``num`` as it is (its scale placement kept)."""
    return num, Backward("textbook")


def _textbook(num: Numerics, **fields: Any) -> tuple[Numerics, Backward]:
    return num.replace(scale="scores"), Backward("textbook", **fields)


def _torch_sdpa_math() -> BackwardKernel:
    fwd = KERNELS["torch-sdpa-math"]
    return BackwardKernel(
        "torch-sdpa-math",
        {f: tuple(_autograd(n) for n in fwd.candidates(f)) for f in fwd.formats},
        (
            _MATH_BACKWARD,
            (
                "half inputs are upcast to float32 before the math path (the forward "
                "descriptor's evidence), so the backward runs in float32 and the conversion's "
                "backward rounds dq, dk, dv once to the input type: the model's output_format"
            ),
            "a float attn_mask (bias) receives dS, rounded to its type: dbias",
        ),
        "a negative scale multiplies q by -sqrt(|scale|): the bound of q's sign flipped with "
        "|scale| (every rounding is symmetric). The multi-head form (Theorem B.6 models the "
        "scale on the scores) takes scales with a power-of-two square root only, where the "
        "placements round alike (no subnormal intermediate assumed).",
        scale_rule="any",
    )


def _torch_sdpa_math_tf32() -> BackwardKernel:
    fwd = KERNELS["torch-sdpa-math-tf32"]
    base = _torch_sdpa_math()
    return dataclasses.replace(
        base,
        name="torch-sdpa-math-tf32",
        models={"float32": tuple(_autograd(n) for n in fwd.candidates("float32"))},
        evidence=(*base.evidence, "torch.backends.cuda.matmul.allow_tf32 = True (off by default)"),
    )


def _torch_sdpa_flash_cpu() -> BackwardKernel:
    fwd = KERNELS["torch-sdpa-flash-cpu"]
    # float32: alpha on each GEMM's product (scale_at "partials"), or, as the BLAS does not
    # document it, on its first operand (scale_at "ds"); half inputs: one block, a power of two
    placements = {"float32": ("partials", "ds")}
    models = {
        f: tuple(
            (n, Backward("flash2", block_q=32, block_k=512, scale_at=at))
            for n in fwd.candidates(f)
            for at in placements.get(f, ("output",))
        )
        for f in fwd.formats
    }
    return BackwardKernel(
        "torch-sdpa-flash-cpu",
        models,
        (
            (
                "aten/src/ATen/native/cpu/FlashAttentionKernel.cpp (torch 2.13), "
                "cpu_flash_attention_backward: per query block of q_split_size (32, 64 or 256 "
                "as the query length reaches 192 and 768) D = rowsum(grad_out * out) in "
                "accum_t from the forward's output; per key block of kv_split_size = 512: "
                "attn = gemm(alpha=scale) q kᵀ in float, the mask added, exp(attn - lse) with "
                "the forward's logsumexp (FlashAttention-2's recomputation), grad_v += attnᵀ "
                "grad_out (attn converted to the input type for half inputs), grad_attn = "
                "grad_out vᵀ, grad_attn = attn * (grad_attn - D), converted to the input type "
                "for half inputs, grad_q += scale * grad_attn k, grad_k += scale * grad_attnᵀ q "
                "(gemm with alpha = scale, beta = 1)"
            ),
            (
                "grad_q, grad_k, grad_v are tensors of the input type: gemm with beta = 1 adds "
                "each block's partial in it, so half inputs are modelled for one query block "
                "and one key block only (accumulates_in_input); each partial is scaled before "
                "it is added, and where the BLAS applies alpha is not documented: float32 "
                "inputs are modelled with alpha on the product (Backward.scale_at='partials') "
                "and on the first operand ('ds'), every scale; half inputs with a power-of-two "
                "scale (scale_rules); the CPU BLAS's GEMM "
                "accumulates each call's product from zero and adds alpha·acc + beta·C in its "
                "epilogue (assumed: each call's inner extent, <= 512, is one panel)"
            ),
            "the exponential: Vectorized<float>::exp (Sleef, 1 ulp), within the forward's 20",
            (
                "enable_gqa, measured with torch 2.13 on the CPU: with one query block and one "
                "key block, float32 dk is bit-identical to each head's dk then their sum (the "
                "per-head model, its sum within γ_(G-1)); with several blocks it is not (a "
                "group's partials added in one buffer), so that is refused"
            ),
        ),
        "the forward as 'torch-sdpa-flash-cpu'; no bias gradient (the CPU flash backward does "
        "not return one)",
        scale_rule="power-of-two",
        scale_rules=(("float32", "any"),),
        q_blocks=((768, 256), (192, 64), (0, 32)),
        accumulates_in_input=True,
    )


_JAX_BACKWARD = (
    "jax/_src/nn/functions.py (jax 0.10): _dot_product_attention_core and its autodiff: "
    "probs = softmax(logits in float32).astype(dtype), encoded = einsum(probs, value) in the "
    "input dtype, so dV = probsᵀ dO and dP = dO vᵀ are rounded to the input dtype; "
    "_softmax_jvp's rule y * (x_dot - sum(y * x_dot)) transposes to y*g - y*sum(y*g) "
    "(softmax_backward 'products'), in float32 with y the float32 probabilities; the masked "
    "logits' where() zeroes their cotangent; logits *= scale transposes to dS * scale in "
    "float32 before the dots (Backward.scale_at='ds'); the logits einsum (preferred_element_type "
    "float32, precision BF16_BF16_F32 / F16_F16_F32 for half inputs) transposes to dots of dS "
    "with k and q, converted to the input dtype (lax.py, _dot_general_transpose_lhs)"
)


def _jax_xla() -> BackwardKernel:
    fwd = KERNELS["jax-xla"]
    # the fill value -0.7·finfo(float32).max leaves exp(fill - max) = 0 exactly when the row
    # attends a key (the oracle checks the logits' range): -inf masking as the bound needs
    models = {
        "float32": (
            _textbook(fwd.candidates("float32")[0].replace(mask_value=-math.inf), scale_at="ds"),
        ),
        **{
            f: (
                _textbook(
                    fwd.candidates(f)[0].replace(mask_value=-math.inf),
                    dp_format=f,
                    ds_format=f,
                    scale_at="ds",
                ),
            )
            for f in _HALF
        },
    }
    return BackwardKernel(
        "jax-xla",
        models,
        (
            _JAX_BACKWARD,
            (
                "half inputs: dP is rounded to the input dtype (the einsum's output), read into "
                "float32; D, the softmax backward, and dS times the scale are float32; dS reaches "
                "the dots in the input dtype: dp_format = ds_format = dtype, grad_format float32; "
                "the model's dS reads the stored probabilities (the input dtype) where jax reads "
                "its float32 softmax, a value within the model's enclosure of the probabilities"
            ),
            (
                "masking: where(mask, logits, -0.7·finfo(float32).max); with a live key of "
                "logit above -1e38 the masked exponentials are exactly 0, as under -inf"
            ),
        ),
        "grouped heads (enable_gqa) are one dot over the group's heads and rows in jax.nn "
        "(grouped='one-dot'); every scale is taken (Backward.scale_at='ds'); the multi-head form (Theorem B.6, the scale "
        "after the dots) only a power-of-two scale, where the placements round alike (no "
        "subnormal intermediate assumed)",
        scale_rule="any",
        softmax_backward="products",
        grouped="one-dot",
        mask_fill=-0.7 * float(np.finfo(np.float32).max),
    )


def _jax_xla_tf32() -> BackwardKernel:
    fwd = KERNELS["jax-xla-tf32"]
    base = _jax_xla()
    num = fwd.candidates("float32")[0].replace(mask_value=-math.inf)
    return dataclasses.replace(
        base,
        name="jax-xla-tf32",
        models={"float32": (_textbook(num, scale_at="ds"),)},
        evidence=(*base.evidence, "JAX's default float32 matmul precision on Ampere+ GPUs is TF32"),
    )


_FA2_BACKWARD = (
    "flash-attention csrc/flash_attn/src/flash_bwd_kernel.h (FlashAttention-2), "
    "compute_dq_dk_dv_1colblock, one key block of kBlockN per thread block, the query blocks "
    "visited in turn: S = Q K_bᵀ on tensor cores from zero (masked with -inf), "
    "scale_apply_exp2</*scale_max=*/false>(scores, lse, scale_softmax_log2), i.e. "
    "P = exp2f(s * scale_log2 - lse * float(M_LOG2E)) from the forward's natural-log "
    "softmax_lse (softmax.h), dP = dO Vᵀ from zero, dS = P * (dP - D) in float with "
    "D = dot_do_o(dO, O) in float, P and dS converted to the input type, "
    "acc_dv += Pᵀ dO and acc_dk += dSᵀ Q as the MMA accumulators across the query blocks, "
    "acc_dq = dS K_b from zero then atomicAdd into the float32 dq_accum (any order); "
    "acc_dk *= scale_softmax_rp_dropout, and dq_accum times it in convert_dQ, then the "
    "input type"
)


def _fa2_backward(name: str, forward: str, extra: tuple[str, ...]) -> BackwardKernel:
    fwd = KERNELS[forward]
    models = {
        f: tuple(
            (n, Backward("flash2", block_q=1, block_k=block, ds_format=f))
            for n in fwd.candidates(f)
            for block in (32, 64, 128)
        )
        for f in fwd.formats
    }
    return BackwardKernel(
        name,
        models,
        (
            _FA2_BACKWARD,
            (
                "flash_bwd_launch_template.h: run_flash_bwd is run_flash_bwd_seqk_parallel; "
                "kBlockN is 128, 64 or 32 by head dimension and shared memory (the "
                "candidates' block_k); dK and dV are one accumulator chain over every query "
                "(whole_queries)"
            ),
            (
                "flash_api.cpp mha_bwd: with num_heads_k != num_heads, dk_expanded and "
                "dv_expanded are allocated with q's options (the input type, one per query "
                "head), the kernel reads key head h / (num_heads / num_heads_k), and "
                "at::sum_out(dk, reshape(dk_expanded, {b, seqlen_k, num_heads_k, group, d}), "
                "{3}) adds each group (a reduction in float32 for half inputs, in an order of "
                "its own, then the input type): grouped='per-head'"
            ),
            *extra,
        ),
        "the forward as its own descriptor's candidates (exp_form='exp2-folded'), Theorem B.2 "
        "with the recomputation's exp2 (papers/backward.md, step 3f); grouped heads as each "
        "query head's dK, dV in the input type, then their sum (grouped='per-head'); no "
        "dropout, ALiBi or bias gradient",
        scale_rule="any",
        grouped="per-head",
        whole_queries=True,
    )


def _flash_attention_2_backward() -> BackwardKernel:
    return _fa2_backward("flash-attention-2", "flash-attention-2", ())


def _torch_sdpa_flash_cuda_backward() -> BackwardKernel:
    return _fa2_backward(
        "torch-sdpa-flash-cuda",
        "torch-sdpa-flash-cuda",
        (
            (
                "aten/src/ATen/native/transformers/cuda/flash_attn/flash_bwd_kernel.h: "
                "PyTorch's copy of FlashAttention-2's backward, the same recomputation"
            ),
        ),
    )


BACKWARD_KERNELS: Mapping[str, BackwardKernel] = {
    k.name: k
    for k in (
        _torch_sdpa_math(),
        _torch_sdpa_math_tf32(),
        _torch_sdpa_flash_cpu(),
        _jax_xla(),
        _jax_xla_tf32(),
        _flash_attention_2_backward(),
        _torch_sdpa_flash_cuda_backward(),
    )
}
"""The registered backward kernels, by name."""

_EXP2 = (
    "the backward bound models exp_form='exp' and FlashAttention-2's 'exp2-folded' "
    "(Backward.check_forward); {what} recomputes the probabilities with exp_form={form!r}"
)

BACKWARD_NOT_MODELLED: Mapping[str, str] = {
    "flash-attention-3": "FlashAttention-3's backward (hopper/mainloop_bwd_sm90_tma_gmma_ws.hpp): "
    "not read to the rounding yet (its WGMMA accumulators and the dQ accumulation through "
    "shared memory and TMA atomics)",
    "torch-sdpa-efficient": _EXP2.format(
        what="xFormers' CUTLASS backward (kernel_backward.h)", form="exp2"
    ),
    "triton-tutorial": _EXP2.format(what="the Triton tutorial's _attn_bwd", form="exp2-scaled")
    + "; it also pre-scales k by sm_scale·log2(e)",
    "flex-attention": _EXP2.format(what="flex_attention's backward template", form="exp2"),
    "torch-sdpa-math-reduced": "allow_fp16_bf16_reduction_math_sdp(True): autograd's "
    "intermediates in the input type, with the scale split over q and k: not read to the "
    "rounding yet",
    "torch-sdpa-cudnn": "cuDNN's fused backward: not documented to the rounding",
    "jax-cudnn": "cuDNN's fused backward: not documented to the rounding",
}
"""Backward passes without a descriptor yet, and why."""


def get_backward_kernel(kernel: BackwardKernel | str) -> BackwardKernel:
    """A backward kernel descriptor by name (or the descriptor itself).

    Raises:
        InvalidArgument: for an unknown name (naming those that exist, and why a known but
            unmodelled one has no descriptor).
    """
    if isinstance(kernel, BackwardKernel):
        return kernel
    if isinstance(kernel, str) and kernel in BACKWARD_KERNELS:
        return BACKWARD_KERNELS[kernel]
    why = (
        f" ({kernel}'s backward is not modelled: {BACKWARD_NOT_MODELLED[kernel]})"
        if isinstance(kernel, str) and kernel in BACKWARD_NOT_MODELLED
        else ""
    )
    msg = (
        f"kernel: expected one of {', '.join(BACKWARD_KERNELS)} or a BackwardKernel, "
        f"got {kernel!r}{why}"
    )
    raise InvalidArgument(msg)
