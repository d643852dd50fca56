"""``Numerics``: every numerical choice of an attention computation, named.

A :class:`Numerics` is frozen and hashable, so it can be a static argument of ``jax.jit``. It
describes a run completely: which format each stage stores its values in, how dot products and
sums are ordered and accumulated, which softmax algorithm runs, how masks are applied and where
the ``1/sqrt(d_k)`` scale is placed. Nothing in mhanum reads a global precision.

The stages of one attention head and the fields that govern them::

    q, k, v  ── rounded to ``input``
    scale on q (and/or k) ── rounded to ``scale_format`` (default: the operand's format)
    S = Q Kᵀ ── the ``dot`` unit: operands rounded to ``operand_format`` (if set), products and
                 sums in ``accum`` in the ``summation`` order (``dot="ieee"``), or split into
                 bf16 passes, or a tensor-core model; result rounded to ``score_format``
    scale on S, bias, mask ── in ``score_format``; mask by ``mask_mode`` with ``mask_value``
    softmax ── ``softmax`` algorithm; max-shift, exp, sum and division in ``softmax_format``
    P ── rounded to ``prob_format``
    O = P V ── like S; result rounded to ``output_format``

For multi-head attention the projections ``x @ w + b`` accumulate in ``accum`` (the bias is added
in ``accum``) and are rounded to ``input``; the output projection is rounded to ``output_format``.

A :class:`Numerics` is written to disk (a saved case, a search journal, a device record, a
report) as :meth:`Numerics.to_dict` and read back by :meth:`Numerics.from_dict`, which also reads
the forms earlier versions wrote; a :class:`Backward` likewise.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from mhanum._errors import InvalidArgument
from mhanum.formats import Format, get_format
from mhanum.units import (
    ACCUM_FORMATS,
    DotUnit,
    SoftmaxAlgorithm,
    SummationOrder,
    dot_unit,
    mask_mode,
    softmax_algorithm,
    summation_order,
)

__all__ = [
    "BACKWARD_ALGORITHMS",
    "PRESETS",
    "SCALE_AT",
    "Backward",
    "Numerics",
    "resolve",
    "resolve_backward",
]

_SCALES = ("scores", "q", "qk")
_EXP_FORMS = ("exp", "exp2", "exp2-folded", "exp2-scaled")
_ONLINE_SUMS = ("block", "running")
_UNDERFLOWS = ("flush", "gradual")
_FINFO = re.compile(r"^(?:(\d*\.?\d+)\s*\*\s*)?finfo\.min$")


def _bad(field: str, expected: str, got: Any) -> InvalidArgument:
    return InvalidArgument(f"numerics.{field}: expected {expected}, got {got!r}")


@dataclasses.dataclass(frozen=True)
class Numerics:
    """Every numerical choice of an attention or multi-head attention computation.

    Attributes:
        input: format q, k, v (or x) and the weights are rounded to, and the default format of
            every stored intermediate.
        accum: format in which dot-product products are rounded and summed (and bias added in
            projections). Must be at least as precise as ``input`` and ``operand_format``.
        summation: order of every sum: ``"native"`` (XLA's own dot and reduce, order unknown),
            ``"sequential"``, ``"pairwise"``, ``"blocked(b)"`` (sequential within blocks of ``b``,
            then sequential over the block sums) or ``"kahan"`` (compensated).
        softmax: ``"naive"`` (no max shift), ``"safe"`` (shift by the row maximum) or
            ``"online(B)"`` (FlashAttention-style streaming over key blocks of ``B`` with a running
            maximum and rescaling).
        softmax_format: format of the softmax arithmetic (shift, exp, sum, division).
            Default: ``accum``.
        score_format: format of the scores ``Q Kᵀ`` and of scaling, bias and mask on them.
            Default: ``input``'s storage (``float32`` for ``tf32``).
        prob_format: format the probabilities are rounded to before ``P V``. Default as
            ``score_format``.
        output_format: format of the attention (and output projection) result. Default as
            ``score_format``.
        operand_format: format dot operands are rounded to on entry to every dot (``"tf32"`` for
            TF32 tensor-core matmuls); ``None`` for no extra rounding.
        dot: the inner-product unit of every dot (``Q Kᵀ``, ``P V``, projections):
            ``"ieee"``: products rounded to ``accum`` and summed in ``summation`` order;
            ``"bf16x1"``, ``"bf16x3"``, ``"bf16x6"``: float32 operands split into one, two or
            three bfloat16 pieces and multiplied in 1, 3 or 6 passes of exact products summed in
            float32 (XLA's ``BF16_BF16_F32[_X3|_X6]`` dot algorithms and the TPU passes of
            Henry, Tang & Heinecke 2019); ``"tensor-core(<model>)"``: the inner product of an
            NVIDIA tensor core (:mod:`mhanum.units.tensorcore`; operands rounded to the model's input
            format, groups of exact products fused into a float32 accumulator). The last two
            need ``accum="float32"``; ``operand_format`` must then be unset.
        mask_mode: ``"fill"`` replaces masked logits by ``mask_value``; ``"add"`` adds it.
        mask_value: ``-inf``, a number such as ``-1e9`` (rounded to ``score_format``, where it may
            overflow to ``-inf``), ``"finfo.min"`` or ``"c*finfo.min"`` (``0 < c <= 1``; jax uses
            ``"0.7*finfo.min"``) of ``score_format``.
        scale: where ``1/sqrt(d_k)`` is applied: ``"scores"`` (on ``Q Kᵀ``), ``"q"`` (on q before
            the dot) or ``"qk"`` (``d_k**-0.25`` on both q and k, as PyTorch's math path does).
        scale_format: format of the scaled q/k (``scale`` ``"q"``/``"qk"``); default: ``input``.
            The scale constant is rounded to the format of the product it enters.
        exp_form: how the exponentials are taken: ``"exp"`` (``exp(s - m)`` of the scaled
            logits) or ``"exp2-folded"`` (FlashAttention-2/3, the Triton tutorial kernel: the
            scale and ``log2(e)`` folded into one constant ``c2 = fl(scale·log2(e))``, the scores
            left unscaled, ``exp2(fl(fl(t·c2) - fl(m·c2)))`` with ``m`` the running maximum of the
            unscaled scores ``t``, and the online rescaling ``exp2(fl(fl(m - m')·c2))``, all in
            ``softmax_format``). It needs ``scale="scores"``, the safe or online softmax and
            ``-inf`` masking (a bias is not taken: it would be scaled with the scores).
            ``"exp2-scaled"`` (the Triton tutorial kernel): the scores scaled into base 2 once,
            ``x = fl(t·c2)`` with the kernel's own constant ``c2 = fl(fl(scale)·fl(log2 e))``
            (each factor and the product rounded into ``softmax_format``), the maximum ``M`` of
            those, ``exp2(fl(x - M))`` and the rescaling ``exp2(fl(M - M'))``: the same
            exponentials as ``"exp2-folded"`` (``fl(m·c2)`` is the largest ``fl(t·c2)``,
            rounding being monotone), another rescaling. The same restrictions, and no
            ``kv_splits``. ``"exp2"`` (xFormers' memory-efficient kernel, PyTorch's
            flex_attention): the logits formed as under ``"exp"`` (scale, bias, soft-cap, mask),
            then taken into base 2 by one product with ``fl(log2 e)`` in ``softmax_format``,
            ``x = fl(s·fl(log2 e))``; the maximum of those, ``exp2(fl(x - M))`` and the
            rescaling ``exp2(fl(M - M'))``. It takes a bias and a soft-cap; the softmax must be
            safe or online, masks ``-inf``, and no sink or ``kv_splits``.
        online_sums: how the online softmax carries its sums across key blocks: ``"block"`` (each
            block's row sum and P·V product formed, then added to the running ones) or
            ``"running"`` (FlashAttention-2/3: the rescaled running sum is the first term of the
            next block's sum, and the running output the accumulator of the next block's P·V
            dot, a tensor core's C operand: one chain over every key). ``"running"`` needs the
            online softmax, the native or sequential order and no split dot.
        exp_ulps: assumed accuracy of ``exp`` (or ``exp2``) in ``softmax_format``, in units in the
            last place (used by the bounds; XLA's float32 ``exp`` is not correctly rounded).
        div_ulps: assumed accuracy of division in ``softmax_format``, in ulps: relative error
            ``(1 + u)^(2·div_ulps) - 1`` (:func:`mhanum.bounds.softmax.division_error`). The
            default 1 covers XLA, which divides by a broadcast row sum as a product with its
            correctly rounded reciprocal (two roundings; ``1/2`` is a correctly rounded
            quotient).
        kv_splits: split-KV ("flash-decoding"): the keys are cut into this many contiguous
            splits, each attended on its own by ``softmax`` (its output ``o_s`` stored in
            ``accum``, its log-sum-exp ``lse_s = fl(m_s + fl(log ℓ_s))`` in ``softmax_format``;
            a split with no attended key has ``lse_s = -inf``, ``o_s = 0``), then merged as
            FlashAttention-2's combine kernel does, in ``softmax_format``: ``M = max lse_s``,
            ``W = Σ fl(exp(fl(lse_s - M)))`` in ``summation`` order, ``Λ = fl(fl(log W) + M)``,
            ``α_s = fl(exp(fl(lse_s - Λ)))`` and ``o = Σ α_s o_s`` accumulated in ``accum``, one
            split after the other, then rounded to ``output_format``. A split holds
            ``ceil(ceil(Lk/B)/kv_splits)·B`` keys (``B`` the online softmax's block, 1 for the
            others: FlashAttention-2's rule), so fewer splits may run than asked. ``log`` is
            assumed within ``exp_ulps`` ulps. ``None`` (default): no split. A fully-masked row
            is 0 under split-KV (every ``lse_s = -inf``), as in the kernels. With
            ``exp_form="exp2-folded"`` the maximum ``m_s`` is of the unscaled scores and
            ``lse_s = fl(fl(m_s·ĉ) + fl(log fl(ℓ_s·2^-k)))``, ``ĉ = fl(scale)`` and ``k`` the
            ``prob_offset`` (FlashAttention-2's and -3's split kernels).
        tanh_ulps: assumed accuracy of ``tanh`` (logit soft-capping, ``softcap=``) in the carrier
            of ``score_format`` (float32, or float64 for float64), in its ulps; the result is then
            rounded into ``score_format``. XLA's CPU ``tanh`` measures at most 4.5 ulps in
            float32 and 6.5 in float64; a GPU kernel's ``tanh.approx.f32`` (relative error up to
            2^-11, FlashAttention-2's soft-cap) needs about 2^13.
        prob_offset: FlashAttention-3's ``Max_offset`` for fp8 probabilities: the online
            softmax's exponentials are ``exp2(fl(fl(t·c2) - fl(fl(m·c2) - k)))``, in ``[0, 2^k]``
            instead of ``[0, 1]``, so that more of them are normal numbers of a narrow
            ``prob_format`` (FlashAttention-3 takes ``k = 8`` for e4m3, whose largest value is
            448); the row sum carries the same ``2^k`` and the final division cancels it. Needs
            ``exp_form="exp2-folded"`` and the online softmax; 0 (default) for none.
        prob_underflow: what the rounding of a weight into ``prob_format`` does below that
            format's smallest normal number ``η_p``: ``"flush"`` (default) allows any value the
            rounding to nearest or a flush to zero may give (an error up to ``η_p``), which
            covers every kernel; ``"gradual"`` states IEEE gradual underflow, the nearest
            subnormal value (an error at most ``u_p·η_p``, half the subnormal spacing), as the
            conversions of XLA's and PyTorch's CPU kernels measure. The bounds read it (steps
            6 and 6k of Theorem A.1); the emulation rounds with gradual underflow under either.

    Raises:
        InvalidArgument: for an unknown format, order or algorithm, or an inconsistent combination.

    Examples:
        >>> Numerics.preset("bf16-fp32acc").accum
        'float32'
        >>> Numerics(input="bf16", summation="blocked(32)").summation
        'blocked(32)'
    """

    input: str = "float32"
    accum: str = "float32"
    summation: str = "native"
    softmax: str = "safe"
    softmax_format: str | None = None
    score_format: str | None = None
    prob_format: str | None = None
    output_format: str | None = None
    operand_format: str | None = None
    dot: str = "ieee"
    mask_mode: str = "fill"
    mask_value: float | str = -math.inf
    scale: str = "scores"
    scale_format: str | None = None
    exp_form: str = "exp"
    online_sums: str = "block"
    exp_ulps: float = 2.0
    div_ulps: float = 1.0
    kv_splits: int | None = None
    tanh_ulps: float = 8.0
    prob_offset: int = 0
    prob_underflow: str = "flush"

    def __post_init__(self) -> None:
        canon = object.__setattr__
        for field in ("input", "accum"):
            canon(self, field, get_format(getattr(self, field), argname=f"numerics.{field}").name)
        for field in ("softmax_format", "score_format", "prob_format", "output_format",
                      "operand_format", "scale_format"):  # fmt: skip
            value = getattr(self, field)
            if value is not None:
                canon(self, field, get_format(value, argname=f"numerics.{field}").name)
        if self.accum not in ACCUM_FORMATS:
            raise _bad("accum", f"one of {ACCUM_FORMATS}", self.accum)
        if self.softmax_format is not None and self.softmax_format not in ACCUM_FORMATS:
            raise _bad("softmax_format", f"one of {ACCUM_FORMATS}", self.softmax_format)
        acc = get_format(self.accum)
        for field in ("input", "operand_format"):
            value = getattr(self, field)
            if value is not None and get_format(value).precision > acc.precision:
                msg = (
                    f"numerics.accum: expected a format at least as precise as numerics.{field} "
                    f"({value}, p={get_format(value).precision}), got {self.accum} "
                    f"(p={acc.precision})"
                )
                raise InvalidArgument(msg)
        canon(self, "summation", summation_order(self.summation, "numerics.summation"))
        canon(self, "dot", dot_unit(self.dot, "numerics.dot"))
        self._check_dot()
        canon(self, "softmax", softmax_algorithm(self.softmax, "numerics.softmax"))
        canon(self, "mask_mode", mask_mode(self.mask_mode, "numerics.mask_mode"))
        canon(self, "mask_value", _canonical_mask_value(self.mask_value))
        if self.scale not in _SCALES:
            raise _bad("scale", f"one of {_SCALES}", self.scale)
        if self.exp_form not in _EXP_FORMS:
            raise _bad("exp_form", f"one of {_EXP_FORMS}", self.exp_form)
        if self.exp2:
            form = f"exp_form={self.exp_form!r}"
            if self.folds_scale and self.scale != "scores":
                raise _bad("scale", f"'scores' with {form}", self.scale)
            if self.softmax_kind == "naive":
                raise _bad("softmax", f"'safe' or 'online(B)' with {form}", self.softmax)
            if self.mask_value != -math.inf:
                raise _bad("mask_value", f"-inf with {form}", self.mask_value)
            if self.exp_form != "exp2-folded" and self.kv_splits is not None:
                raise _bad("kv_splits", f"None with {form}", self.kv_splits)
        if self.online_sums not in _ONLINE_SUMS:
            raise _bad("online_sums", f"one of {_ONLINE_SUMS}", self.online_sums)
        if self.online_sums == "running":
            if self.softmax_kind != "online":
                raise _bad("softmax", "'online(B)' with online_sums='running'", self.softmax)
            if not self.order.resumable:
                raise _bad("summation", f"{_resumable_orders()} with online_sums='running'",
                           self.summation)  # fmt: skip
            if self.dot_kind == "split":
                raise _bad("dot", "no split dot with online_sums='running'", self.dot)
        if self.kv_splits is not None:
            value = self.kv_splits
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise _bad("kv_splits", "None or an integer >= 1", value)
        offset = self.prob_offset
        if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset <= 64:
            raise _bad("prob_offset", "an integer in [0, 64]", offset)
        if offset and (self.exp_form != "exp2-folded" or self.softmax_kind != "online"):
            raise _bad("prob_offset", "0 unless exp_form='exp2-folded' with the online softmax",
                       offset)  # fmt: skip
        if self.prob_underflow not in _UNDERFLOWS:
            raise _bad("prob_underflow", f"one of {_UNDERFLOWS}", self.prob_underflow)
        for field in ("exp_ulps", "div_ulps", "tanh_ulps"):
            value = getattr(self, field)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise _bad(field, "a finite number >= 0", value)
            canon(self, field, float(value))

    def _check_dot(self) -> None:
        kind = self.dot_kind
        if kind == "ieee":
            return
        if self.accum != "float32":
            raise _bad("accum", f"'float32' with dot={self.dot!r}", self.accum)
        if self.operand_format is not None:
            raise _bad("operand_format", f"None with dot={self.dot!r} (the dot unit sets it)",
                       self.operand_format)  # fmt: skip
        if kind == "tensor-core" and not self.order.resumable:
            raise _bad("summation", f"{_resumable_orders()} with dot={self.dot!r}", self.summation)

    # Resolved formats -------------------------------------------------------------------------

    @property
    def storage_format(self) -> Format:
        """The format stored intermediates default to: ``input``, or float32 for ``tf32``."""
        fmt = get_format(self.input)
        return get_format(fmt.storage) if fmt.name == "tf32" else fmt

    def format_of(self, role: str) -> Format:
        """The resolved :class:`Format` of a stage.

        Args:
            role: one of ``input``, ``accum``, ``operand``, ``score``, ``softmax``, ``prob``,
                ``output``, ``scale``.
        """
        formats = self._formats
        if role not in formats:
            msg = f"role: expected one of {tuple(formats)}, got {role!r}"
            raise InvalidArgument(msg)
        return formats[role]

    @functools.cached_property
    def _formats(self) -> dict[str, Format]:
        """Every role's :class:`Format`, resolved once per value (the fields are frozen; the
        cache lives beside them, outside the fields that equality, hashing and records read)."""
        explicit = {
            "input": self.input,
            "accum": self.accum,
            "operand": self.operand_format or self._dot_operand(),
            "score": self.score_format,
            "softmax": self.softmax_format or self.accum,
            "prob": self.prob_format,
            "output": self.output_format,
            "scale": self.scale_format or self.input,
        }
        return {
            role: get_format(value)
            if value is not None
            else (get_format(self.input) if role == "operand" else self.storage_format)
            for role, value in explicit.items()
        }

    def _dot_operand(self) -> str | None:
        return self.dot_unit.operand_format

    @property
    def operand_rounding(self) -> Format | None:
        """The format every dot operand is rounded to on entry, if any.

        ``operand_format``; ``bfloat16`` for ``dot="bf16x1"``; the model's input format for a
        tensor core; ``None`` otherwise (``bf16x3``/``bf16x6`` split their operands instead).
        """
        name = self.operand_format or self._dot_operand()
        return None if name is None else get_format(name)

    # Typed views of the parsed choices (each field holds its unit, a str of today's spelling) ----

    @property
    def order(self) -> SummationOrder:
        """:attr:`summation` as its typed unit (:mod:`mhanum.units`)."""
        return summation_order(self.summation)

    @property
    def softmax_algorithm(self) -> SoftmaxAlgorithm:
        """:attr:`softmax` as its typed unit (:mod:`mhanum.units`)."""
        return softmax_algorithm(self.softmax)

    @property
    def dot_unit(self) -> DotUnit:
        """:attr:`dot` as its typed unit (:mod:`mhanum.units`)."""
        return dot_unit(self.dot)

    @property
    def dot_kind(self) -> str:
        """``ieee``, ``split`` (``bf16xN``, N > 1) or ``tensor-core``; ``bf16x1`` is ``ieee``."""
        return self.dot_unit.kind

    @property
    def dot_passes(self) -> int:
        """Number of bf16 passes of a split dot (1 for every other unit)."""
        return self.dot_unit.passes

    @property
    def dot_model(self) -> str | None:
        """The tensor-core model name of ``dot="tensor-core(<model>)"``, else ``None``."""
        return self.dot_unit.model

    @property
    def needs_x64(self) -> bool:
        """Whether any stage uses float64 (JAX must then run with ``jax_enable_x64``)."""
        roles = ("input", "accum", "score", "softmax", "prob", "output", "scale")
        return any(self.format_of(r).name == "float64" for r in roles)

    @property
    def summation_kind(self) -> str:
        """``native``, ``sequential``, ``pairwise``, ``blocked`` or ``kahan``."""
        return self.order.kind

    @property
    def summation_block(self) -> int | None:
        """The block size of ``blocked(b)``, else ``None``."""
        return self.order.block

    @property
    def softmax_kind(self) -> str:
        """``naive``, ``safe`` or ``online``."""
        return self.softmax_algorithm.kind

    @property
    def softmax_block(self) -> int | None:
        """The key-block size of ``online(B)``, else ``None``."""
        return self.softmax_algorithm.block

    @property
    def exp2(self) -> bool:
        """Whether the exponentials are ``exp2`` with the scale folded into their argument
        (any ``exp_form`` but ``"exp"``)."""
        return self.exp_form != "exp"

    @property
    def folds_scale(self) -> bool:
        """Whether the scores stay unscaled and the scale enters the exponent's constant
        (``exp_form`` ``"exp2-folded"`` or ``"exp2-scaled"``)."""
        return self.exp_form in ("exp2-folded", "exp2-scaled")

    @property
    def descale_format(self) -> Format:
        """The format the output is in before an fp8 descale multiplies it (``descale=``): the
        softmax format after the online softmax's division, ``accum`` after the P·V dot (or the
        split-KV merge)."""
        if self.softmax_kind == "online" and self.kv_splits is None:
            return self.format_of("softmax")
        return self.format_of("accum")

    def kv_split_size(self, n_keys: int) -> int:
        """The keys per split of ``kv_splits`` over ``n_keys`` keys (``n_keys`` when unsplit).

        FlashAttention-2's rule: ``ceil(ceil(n_keys/B)/kv_splits)`` blocks of ``B`` keys, ``B``
        the online softmax's block (1 for the others).

        Examples:
            >>> Numerics(softmax="online(64)", kv_splits=3).kv_split_size(1000)
            384
            >>> Numerics(kv_splits=3).kv_split_size(1000)
            334
        """
        if self.kv_splits is None:
            return n_keys
        block = self.softmax_block or 1
        blocks = -(-n_keys // block)
        return -(-blocks // self.kv_splits) * block

    def check_bias(self, bias: Any) -> None:
        """``exp_form="exp2-folded"`` scales the scores inside the exponent, so a bias would be
        scaled with them: none is taken (FlashAttention adds none; its ALiBi slopes come
        pre-divided by the scale).

        Raises:
            InvalidArgument: for a bias under ``exp_form="exp2-folded"``.
        """
        if bias is not None and self.folds_scale:
            msg = (
                f"bias: expected None with numerics.exp_form={self.exp_form!r} (the scale is "
                "folded into the exponent and would scale the bias too)"
            )
            raise InvalidArgument(msg)

    def check_softcap(self) -> None:
        """Logit soft-capping ``c·tanh(s/c)`` acts on the scaled scores, which
        ``exp_form="exp2-folded"`` never forms.

        Raises:
            InvalidArgument: for a soft-cap under ``exp_form="exp2-folded"``.
        """
        if self.folds_scale:
            msg = (
                f"softcap: expected None with numerics.exp_form={self.exp_form!r} (the scaled "
                "scores are not formed; a kernel's folded soft-cap is not modelled)"
            )
            raise InvalidArgument(msg)

    def check_sink(self) -> None:
        """An attention sink is a key with bias ``σ`` (:func:`mhanum.masks.with_sink`), which
        ``exp_form="exp2-folded"`` would scale with the scores.

        Raises:
            InvalidArgument: for a sink under ``exp_form="exp2-folded"``.
        """
        if self.exp2:
            msg = (
                f"sink: expected None with numerics.exp_form={self.exp_form!r} (a sink under "
                "an exp2 softmax is not modelled)"
            )
            raise InvalidArgument(msg)

    def check_problem(self, problem: Any) -> None:
        """Whether these numerics model the :class:`mhanum.problem.AttentionProblem`: its bias,
        soft-cap and sink (:meth:`check_bias`, :meth:`check_softcap`, :meth:`check_sink`), its
        scale against this placement, and its fp8 descale factors (on the scores' scale only).

        Raises:
            InvalidArgument: naming the argument these numerics cannot take.
        """
        from mhanum import _validate as V

        self.check_bias(problem.bias)
        if problem.softcap is not None:
            self.check_softcap()
        if problem.sink is not None:
            self.check_sink()
        problem.scale_value(self.scale)
        if problem.descale is not None:
            V.descale_value(problem.descale, self.scale)

    def mask_constant(self) -> float:
        """The masking constant as stored in ``score_format`` (may be ``-inf`` after overflow)."""
        from mhanum.formats import round_to

        fmt = self.format_of("score")
        value = self.mask_value
        if isinstance(value, str):
            m = _FINFO.match(value)
            assert m is not None  # canonicalised in __post_init__
            factor = float(m.group(1)) if m.group(1) else 1.0
            value = -factor * fmt.max_finite
        stored = float(round_to(value, fmt))
        if math.isnan(stored):
            msg = (
                f"numerics.mask_value: expected a constant that {fmt.name} (the score format) "
                f"represents or rounds to -inf, got {self.mask_value!r}, which becomes NaN there "
                "(the format has no infinity)"
            )
            raise InvalidArgument(msg)
        return stored

    # Construction -----------------------------------------------------------------------------

    @classmethod
    def preset(cls, name: str) -> Numerics:
        """A named preset; see :data:`PRESETS` and :meth:`presets`.

        Raises:
            InvalidArgument: for an unknown name.
        """
        if name not in PRESETS:
            msg = f"name: expected one of {', '.join(PRESETS)}, got {name!r}"
            raise InvalidArgument(msg)
        return PRESETS[name]

    @staticmethod
    def presets() -> tuple[str, ...]:
        """Names of the presets, in order."""
        return tuple(PRESETS)

    def replace(self, **changes: Any) -> Numerics:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    # Serialisation ----------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Every field as strict JSON: the formats and the units (:attr:`summation`,
        :attr:`softmax`, :attr:`dot`, ...) by their canonical spelling, ``-inf`` as the string
        ``"-inf"``, so that ``json.dumps(..., allow_nan=False)`` takes it and :meth:`from_dict`
        reads it back equal. ``prob_underflow``, added after the first records were written,
        only where it is not its default, so that a record of an earlier version is written
        back as it was.

        Examples:
            >>> Numerics.preset("bf16-fp32acc").to_dict()["mask_value"]
            '-inf'
            >>> num = Numerics(summation="blocked(8)", mask_value="0.7*finfo.min")
            >>> Numerics.from_dict(num.to_dict()) == num
            True
        """
        out = {f.name: _json_value(getattr(self, f.name)) for f in dataclasses.fields(self)}
        if self.prob_underflow == "flush":  # added later: a record of an earlier version as it was
            del out["prob_underflow"]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Numerics:
        """The :class:`Numerics` of a mapping of its fields: what :meth:`to_dict` writes, and the
        forms earlier versions wrote: ``mask_value`` as the float ``-inf`` (JSON's
        ``-Infinity``) or the string ``"-inf"``, and fields missing that were added since (they
        take their defaults).

        Raises:
            InvalidArgument: naming the field (``numerics.<field>: expected ...``), for an
                unknown field, a value of the wrong JSON type or one :class:`Numerics` refuses.

        Examples:
            >>> Numerics.from_dict({"input": "bf16", "summation": "blocked(8)"}).describe()
            "Numerics(input='bfloat16', accum='float32', summation='blocked(8)')"
            >>> Numerics.from_dict({"scale": "k"})
            Traceback (most recent call last):
            ...
            mhanum._errors.InvalidArgument: numerics.scale: expected one of ('scores', 'q', 'qk'), got 'k'
        """
        return _from_fields(cls, data, "numerics")

    def describe(self) -> str:
        """One line naming every non-default choice."""
        default = Numerics()
        parts = [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in dataclasses.fields(self)
            if f.name in ("input", "accum") or getattr(self, f.name) != getattr(default, f.name)
        ]
        return "Numerics(" + ", ".join(parts) + ")"


_Record = TypeVar("_Record", "Numerics", "Backward")

_JSON_KINDS: Mapping[Any, tuple[tuple[type, ...], str]] = {
    str: ((str,), "a string"),
    float: ((float, int), "a number"),
    int: ((int,), "an integer"),
    type(None): ((type(None),), "null"),
    tuple: ((list, tuple), "a list"),
}
"""The JSON values a field of each annotated type takes (a float field takes an integer too)."""


def _json_value(value: Any) -> Any:
    """A field's value as strict JSON: a unit as its spelling, ``-inf`` as ``"-inf"``, a tuple
    as a list."""
    if isinstance(value, str):
        return str(value)
    if isinstance(value, float) and value == -math.inf:
        return "-inf"
    if isinstance(value, tuple):
        return list(value)
    return value


def _field_kinds(cls: type) -> dict[str, tuple[tuple[type, ...], str]]:
    """Each field of ``cls``: the JSON types of the values it takes, and those types in words."""
    hints = typing.get_type_hints(cls)
    kinds = {}
    for field in dataclasses.fields(cls):
        hint = hints[field.name]
        alternatives = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        parts = [_JSON_KINDS[typing.get_origin(t) or t] for t in alternatives]
        kinds[field.name] = (
            tuple(t for accepted, _ in parts for t in accepted),
            " or ".join(words for _, words in parts),
        )
    return kinds


def _from_fields(cls: type[_Record], data: Any, prefix: str) -> _Record:
    """``cls(**data)`` for a mapping of field values read from JSON, every problem named
    ``<prefix>.<field>``."""
    if not isinstance(data, Mapping):
        msg = f"{prefix}: expected a mapping of {cls.__name__} fields, got {type(data).__name__}"
        raise InvalidArgument(msg)
    kinds = _FIELD_KINDS[cls]
    for name, value in data.items():
        if name not in kinds:
            msg = (
                f"{prefix}.{name}: expected a field of this mhanum's {cls.__name__}, got an "
                "unknown one (a newer mhanum may have written it)"
            )
            raise InvalidArgument(msg)
        accepted, words = kinds[name]
        if isinstance(value, bool) or not isinstance(value, accepted):
            msg = f"{prefix}.{name}: expected {words}, got {value!r}"
            raise InvalidArgument(msg)
    return cls(**data)


def _canonical_mask_value(value: Any) -> float | str:
    if isinstance(value, str):
        text = value.strip().replace(" ", "")
        if text in ("-inf", "-infinity"):
            return -math.inf
        m = _FINFO.match(text)
        if m and (m.group(1) is None or 0 < float(m.group(1)) <= 1):
            return text
        raise _bad(
            "mask_value", "a number <= 0, '-inf', 'finfo.min' or 'c*finfo.min' (0<c<=1)", value
        )
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad("mask_value", "a number <= 0 or a string such as 'finfo.min'", value)
    value = float(value)
    if math.isnan(value) or value > 0:
        raise _bad("mask_value", "a number <= 0 (or -inf)", value)
    return value


def _preset(input: str, accum: str, **kw: Any) -> Numerics:
    return Numerics(input=input, accum=accum, **kw)


PRESETS: Mapping[str, Numerics] = {
    "fp64": _preset("float64", "float64"),
    "fp32": _preset("float32", "float32"),
    "tf32": _preset("float32", "float32", operand_format="tf32"),
    "bf16": _preset("bfloat16", "bfloat16"),
    "bf16-fp32acc": _preset("bfloat16", "float32"),
    "fp16": _preset("float16", "float16"),
    "fp16-fp32acc": _preset("float16", "float32"),
    "tpu-bf16-1pass": _preset("float32", "float32", dot="bf16x1"),
    "tpu-bf16-3pass": _preset("float32", "float32", dot="bf16x3"),
    "tpu-bf16-6pass": _preset("float32", "float32", dot="bf16x6"),
    "tensor-core-fp16": _preset("float16", "float32", dot="tensor-core(h100-fp16)"),
    "tensor-core-bf16": _preset("bfloat16", "float32", dot="tensor-core(h100-bf16)"),
    "fp8-e4m3-fp32acc": _preset(
        "float8_e4m3fn",
        "float32",
        score_format="float32",
        prob_format="float8_e4m3fn",
        output_format="float32",
    ),
    "fp8-e5m2-fp32acc": _preset(
        "float8_e5m2",
        "float32",
        score_format="float32",
        prob_format="float8_e5m2",
        output_format="float32",
    ),
}
"""Named numerics of real modes.

* ``fp64``, ``fp32``: everything in that format.
* ``tf32``: the GPU default for float32 matmuls on Ampere and later: float32 tensors, dot operands
  rounded to tf32 (10-bit fraction), exact products, float32 accumulation.
* ``bf16``, ``fp16``: everything, accumulation and softmax included, in that format.
* ``bf16-fp32acc``, ``fp16-fp32acc``: tensors in that format, dots accumulated and the softmax
  computed in float32, results rounded back (what frameworks do with half-precision tensors).
* ``tpu-bf16-1pass``, ``tpu-bf16-3pass``, ``tpu-bf16-6pass``: float32 tensors whose every dot
  runs as 1, 3 or 6 passes of bfloat16 pieces (JAX's ``DEFAULT``, ``HIGH`` and ``HIGHEST``
  precision on TPU; ``dot="bf16xN"``).
* ``tensor-core-fp16``, ``tensor-core-bf16``: half-precision tensors whose dots run on the H100
  tensor-core model of :mod:`mhanum.units.tensorcore` (groups of 16 exact products aligned to the
  largest with 2 extra bits, truncated into a float32 accumulator; Fasi et al. 2021, Khattak &
  Mikaitis 2025; checked bit for bit on an H100), softmax in float32, results rounded back.
* ``fp8-e4m3-fp32acc``, ``fp8-e5m2-fp32acc``: fp8 q, k, v (and probabilities, rounded to the same
  fp8 format before ``P V``, as FlashAttention-3 does); products exact and accumulated in float32,
  scores, softmax and output in float32.
"""


def _resumable_orders() -> str:
    """The registered summation orders a sum can resume in (a carried value added first), as an
    error message lists them."""
    from mhanum.units import summation_orders

    names = [
        repr(order.spelling())
        for order in summation_orders()
        if any(example.resumable for example in order.examples())
    ]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def resolve(numerics: Numerics | str | None) -> Numerics:
    """``numerics`` as a :class:`Numerics`: itself, a preset by name, or the default for ``None``.

    Raises:
        InvalidArgument: for an unknown preset name or a value of another type.
    """
    if numerics is None:
        return Numerics()
    if isinstance(numerics, str):
        return Numerics.preset(numerics)
    if not isinstance(numerics, Numerics):
        msg = f"numerics: expected a Numerics or a preset name, got {type(numerics).__name__}"
        raise InvalidArgument(msg)
    return numerics


BACKWARD_ALGORITHMS = ("textbook", "flash2")
"""The backward passes :class:`Backward` models: the textbook one and FlashAttention-2's."""

SCALE_AT = ("output", "ds", "partials")
"""Where a backward pass multiplies by the scale on the scores: ``"output"``, ``dQ`` and ``dK``
after their dots, in ``accum``; ``"ds"``, ``dS`` before the dots, in the gradient format (the
transpose of ``logits *= scale`` in ``jax.nn.dot_product_attention``); ``"partials"``, each
block's partial ``dQ`` (``dK``) before it is added, in ``accum`` (a GEMM's ``alpha`` applied to
its product, as PyTorch's CPU flash backward adds ``alpha·(dS_b K_b)`` into ``dQ``)."""


@dataclasses.dataclass(frozen=True)
class Backward:
    """Every numerical choice of attention's backward pass that the forward :class:`Numerics`
    does not already make (papers/backward.md).

    The backward reads the forward's formats: q, k, v and ``d_out`` are rounded to ``input``,
    every dot runs on the forward's dot unit (``accum``, ``summation``, ``operand_format``),
    and dq, dk, dv and dbias are rounded to ``output_format``. With ``S`` the computed logits,
    ``c`` the scale, ``G = d_out`` and ``D`` a row vector:

    * ``"textbook"`` (autograd through the math path, PyTorch's ``softmax_backward``): the
      stored probabilities ``P`` (the forward's, in ``prob_format``); ``dV = Pᵀ G``,
      ``dP = G Vᵀ``, ``D = rowsum(dP ∘ P)``, ``dS = P ∘ (dP - D)``, ``dQ = c·(dS K)``,
      ``dK = c·(dSᵀ Q)``: each dot one chain over its whole length.
    * ``"flash2"`` (FlashAttention-2's backward, Dao 2023, Algorithm 2): ``P`` recomputed from
      the forward's log-sum-exp ``lse = fl(m + fl(log ℓ))`` as ``fl(exp(fl(S - lse)))`` in
      ``softmax_format`` (with the forward's ``exp_form="exp2-folded"``, as FlashAttention-2's
      ``scale_apply_exp2`` does: ``exp2(fl(fl(t·c2) - fl(lse·fl(log2 e))))`` of the unscaled
      scores ``t``, with ``lse = fl(fl(m·fl(c)) + fl(log ℓ))``);
      ``D = rowsum(G ∘ O)`` from the forward's output ``O``;
      ``dS = P ∘ (dP - D)``; ``dV`` and ``dK`` accumulated over query blocks of ``block_q``
      (each block's dot, then added to the running sum in block order), ``dQ`` as the sum of
      one partial per key block of ``block_k`` (each a dot from zero), added in ``dq_order``
      (the order of FlashAttention's ``atomicAdd`` into a float32 ``dq_accum``, which the
      hardware does not fix). The scale multiplies ``dQ`` and ``dK`` once, at the end, in
      ``accum``; ``P`` enters ``dV`` rounded to ``prob_format``.

    Attributes:
        algorithm: ``"textbook"`` or ``"flash2"``.
        block_q: query block of the ``flash2`` ``dK``/``dV`` accumulation (``>= 1``).
        block_k: key block of the ``flash2`` ``dQ`` partials (``>= 1``).
        grad_format: format of ``dP``, ``D``, ``dP - D`` and ``dS`` (one of the accumulation
            formats). Default: the forward's ``softmax_format``.
        dp_format: format ``dP = d_out vᵀ`` is rounded to as its dot's result, before ``D`` and
            ``dS`` read it in ``grad_format`` (``jax.nn``'s half-precision backward rounds the
            dot to the input type and computes ``dS`` in float32); ``None`` (default): read
            from the accumulator into ``grad_format`` directly.
        ds_format: format ``dS`` is rounded to before the ``dQ`` and ``dK`` dots. Default:
            ``input`` for ``flash2`` (FlashAttention converts ``dS`` to the input type), else
            ``grad_format``.
        dq_order: ``flash2``: the order in which the key blocks' ``dQ`` partials are added, a
            permutation of ``range(ceil(Lk/block_k))`` (checked against ``Lk`` when run);
            ``None`` for ascending.
        scale_at: where the scale on the scores multiplies (one of :data:`SCALE_AT`):
            ``"output"`` (default), ``dQ = fl(ĉ·(dS K))``, ``dK = fl(ĉ·(dSᵀ Q))`` with
            ``ĉ = fl_acc(c)``; ``"ds"``, ``dQ = fl(fl_ds(fl_grad(dS·ĉ)) K)`` with
            ``ĉ = fl_grad(c)`` (``dK`` likewise), the dots then multiplied by nothing;
            ``"partials"``, ``dQ = Σ_b fl_acc(ĉ·(dS_b K_b))`` (``flash2``'s key blocks, ``dK``'s
            query blocks) with ``ĉ = fl_acc(c)``, the sum multiplied by nothing.

    Examples:
        >>> Backward("flash2", block_k=2, dq_order=(1, 0)).dq_order
        (1, 0)
        >>> Backward(algorithm="reverse")
        Traceback (most recent call last):
        ...
        mhanum._errors.InvalidArgument: backward.algorithm: expected one of ('textbook', 'flash2'), got 'reverse'
    """

    algorithm: str = "textbook"
    block_q: int = 64
    block_k: int = 64
    grad_format: str | None = None
    ds_format: str | None = None
    dq_order: tuple[int, ...] | None = None
    scale_at: str = "output"
    dp_format: str | None = None

    def __post_init__(self) -> None:
        canon = object.__setattr__
        if self.algorithm not in BACKWARD_ALGORITHMS:
            raise _bad_backward("algorithm", f"one of {BACKWARD_ALGORITHMS}", self.algorithm)
        for field in ("block_q", "block_k"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise _bad_backward(field, "an integer >= 1", value)
        for field in ("grad_format", "ds_format", "dp_format"):
            value = getattr(self, field)
            if value is not None:
                canon(self, field, get_format(value, argname=f"backward.{field}").name)
        if self.grad_format is not None and self.grad_format not in ACCUM_FORMATS:
            raise _bad_backward("grad_format", f"one of {ACCUM_FORMATS}", self.grad_format)
        if self.scale_at not in SCALE_AT:
            raise _bad_backward("scale_at", f"one of {SCALE_AT}", self.scale_at)
        if self.dq_order is not None:
            order = self.dq_order
            if isinstance(order, (str, bytes)) or not hasattr(order, "__iter__"):
                raise _bad_backward("dq_order", "a permutation of the key blocks", order)
            order = tuple(order)
            if any(isinstance(i, bool) or not isinstance(i, int) for i in order) or sorted(
                order
            ) != list(range(len(order))):
                raise _bad_backward("dq_order", "a permutation of 0, 1, ..., n - 1", order)
            if self.algorithm != "flash2":
                raise _bad_backward("dq_order", "None with algorithm='textbook'", order)
            canon(self, "dq_order", order)

    def to_dict(self) -> dict[str, Any]:
        """Every field as strict JSON (``dq_order`` a list); :meth:`from_dict` reads it back.
        ``scale_at`` and ``dp_format``, added after the first records were written, only where
        they are not their defaults, so that a record of an earlier version is written back as
        it was.

        Examples:
            >>> Backward("flash2", block_k=2, dq_order=(1, 0)).to_dict()["dq_order"]
            [1, 0]
            >>> "scale_at" in Backward().to_dict(), Backward(scale_at="ds").to_dict()["scale_at"]
            (False, 'ds')
        """
        out = {f.name: _json_value(getattr(self, f.name)) for f in dataclasses.fields(self)}
        if self.scale_at == "output":
            del out["scale_at"]
        if self.dp_format is None:
            del out["dp_format"]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Backward:
        """The :class:`Backward` of a mapping of its fields (what :meth:`to_dict` writes; a field
        missing takes its default).

        Raises:
            InvalidArgument: naming the field (``backward.<field>: expected ...``), for an
                unknown field, a value of the wrong JSON type or one :class:`Backward` refuses.
        """
        return _from_fields(cls, data, "backward")

    def formats(self, num: Numerics) -> tuple[Format, Format]:
        """``(grad, ds)``: the resolved formats of the gradient arithmetic and of ``dS``."""
        grad = get_format(self.grad_format) if self.grad_format else num.format_of("softmax")
        if self.ds_format:
            return grad, get_format(self.ds_format)
        return grad, (num.format_of("input") if self.algorithm == "flash2" else grad)

    def dp_rounding(self) -> Format | None:
        """The format ``dP`` is rounded to as its dot's result (``dp_format``), or ``None``."""
        return get_format(self.dp_format) if self.dp_format else None

    def key_blocks(self, n_keys: int) -> tuple[int, ...]:
        """The order of the ``dQ`` partials for ``n_keys`` keys (ascending unless given).

        Raises:
            InvalidArgument: when ``dq_order`` is not a permutation of that many blocks.
        """
        count = -(-n_keys // self.block_k) if self.algorithm == "flash2" else 1
        if self.dq_order is None:
            return tuple(range(count))
        if len(self.dq_order) != count:
            msg = (
                f"backward.dq_order: expected a permutation of {count} key blocks "
                f"(ceil({n_keys}/{self.block_k})), got {self.dq_order}"
            )
            raise InvalidArgument(msg)
        return self.dq_order

    def check_forward(self, num: Numerics) -> None:
        """Refuse forward numerics the backward does not model, by the field's name (every
        scale placement is modelled: on the scores, ``dQ = c·(dS K)`` and ``dK = c·(dSᵀ Q)``;
        on ``q`` or on ``q`` and ``k``, the dots read the scaled operands and the gradients of
        the scaled ones are multiplied by the factor again, as autograd does)."""
        if num.exp_form == "exp2-folded" and self.algorithm == "flash2":
            if num.prob_offset:
                raise _bad("prob_offset", "0 for the backward pass", num.prob_offset)
        elif num.exp_form != "exp":
            raise _bad(
                "exp_form",
                "'exp' for the backward pass, or 'exp2-folded' with Backward('flash2')",
                num.exp_form,
            )
        if self.scale_at != "output" and num.scale != "scores":
            msg = (
                "backward.scale_at: expected 'output' with the scale on q or on q and k "
                f"(numerics.scale={num.scale!r}), got {self.scale_at!r}"
            )
            raise InvalidArgument(msg)
        if num.kv_splits is not None:
            raise _bad("kv_splits", "None for the backward pass", num.kv_splits)


def _bad_backward(field: str, expected: str, got: Any) -> InvalidArgument:
    return InvalidArgument(f"backward.{field}: expected {expected}, got {got!r}")


def resolve_backward(backward: Backward | str | None) -> Backward:
    """``backward`` as a :class:`Backward`: itself, ``Backward(algorithm)`` for a name, or the
    textbook default for ``None``.

    Raises:
        InvalidArgument: for an unknown algorithm or a value of another type.
    """
    if backward is None:
        return Backward()
    if isinstance(backward, str):
        return Backward(backward)
    if not isinstance(backward, Backward):
        msg = f"backward: expected a Backward or an algorithm name, got {type(backward).__name__}"
        raise InvalidArgument(msg)
    return backward


_FIELD_KINDS = {cls: _field_kinds(cls) for cls in (Numerics, Backward)}
"""What :meth:`Numerics.from_dict` and :meth:`Backward.from_dict` accept for each field."""
