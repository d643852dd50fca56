"""One attention problem, read once at the boundary.

:class:`AttentionProblem` holds what every part of mhanum computes on:
``softmax(scale · q kᵀ + bias, over the attended keys and a sink) · v`` with an optional logit
soft-cap and fp8 descale factors. Every public entry point that takes these arguments (the
emulation, the certified reference, the forward and backward bounds) builds it once with
:meth:`AttentionProblem.of`, which checks every argument against the others and raises
:class:`~mhanum.InvalidArgument` ("<argument>: expected X, got Y"); downstream code reads its
fields and never re-interprets an argument.

The shape rule is one for all: the batch dimensions are those of ``q``, ``k`` and ``v``
broadcast together, and the mask, the bias and the sink must fit them (broadcast to the scores
``(*batch, Lq, Lk)``, never enlarge them): the output's shape is that of the inputs.

Examples:
    >>> import numpy as np
    >>> from mhanum import masks
    >>> p = AttentionProblem.of(np.ones((2, 4, 8)), np.ones((6, 8)), np.ones((6, 3)),
    ...                         mask=masks.causal())
    >>> p.batch, p.scores, p.output
    ((2,), (2, 4, 6), (2, 4, 3))
    >>> AttentionProblem.of(np.ones((4, 8)), np.ones((6, 8)), np.ones((6, 3)), sink=np.zeros(3))
    Traceback (most recent call last):
    ...
    mhanum._errors.InvalidArgument: sink: expected one logit per batch element or head, a shape broadcastable to the inputs' batch dimensions (), got (3,)
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from mhanum import _validate as V
from mhanum import masks
from mhanum._errors import InvalidArgument
from mhanum.params import MHAParams

if TYPE_CHECKING:
    from types import ModuleType

    from mhanum._types import Array, ArrayLike

__all__ = ["Accumulated", "AttentionProblem", "MHAProblem", "checked_bias"]


@dataclasses.dataclass(frozen=True, eq=False)
class AttentionProblem:
    """The inputs of one attention call, checked together.

    Attributes:
        q, k, v: ``(..., Lq, d_k)``, ``(..., Lk, d_k)``, ``(..., Lk, d_v)`` floating-point arrays
            as given (numpy, or JAX arrays, which may be traced: their values are checked only
            when concrete).
        batch: the batch dimensions of ``q``, ``k`` and ``v`` broadcast together.
        mask: ``None``, a :class:`mhanum.masks.Band`, or a boolean array broadcastable to
            :attr:`scores` (:func:`mhanum.masks.normalise`).
        bias: ``None`` or a float array broadcastable to :attr:`scores` (``-inf`` excludes a
            key; no NaN, no ``+inf``), as given.
        scale: the scale as given (``None``: ``1/sqrt(d_k)``), a finite number.
        sink: ``None`` or finite sink logits broadcastable to :attr:`batch` (float64 numpy,
            or a JAX array as given).
        softcap: ``None`` or the cap ``c > 0`` of ``c·tanh(s/c)``.
        descale: ``None`` or fp8 descale factors ``(d_q, d_k, d_v)``, float32 numbers ``> 0``.
        d_out: ``None``, or for a backward pass the output's cotangent ``(..., Lq, d_v)``, as
            given; its batch dimensions join :attr:`batch`.
        rope: ``None`` or the :class:`mhanum.rope.Rope` a kernel rotates ``q`` and ``k`` with
            before the scores (papers/rope.md); ``q`` and ``k`` are then the kernel's inputs
            before the rotation, values of ``rope.rotation_format``.
        positions: with ``rope``, the positions of the queries and of the keys (int64 arrays of
            lengths ``Lq`` and ``Lk``); by default the keys' are ``0..Lk-1`` and the queries are
            the last ``Lq`` of them (a decoding step's alignment).
        kv_cache: ``None`` or the pair of :class:`mhanum.kvcache.KVQuant` a kernel stores
            ``k`` and ``v`` in (papers/kvcache.md; given as one for both, or as the pair
            ``(k's, v's)``): the attention reads them back from the cache.
    """

    q: Any
    k: Any
    v: Any
    batch: tuple[int, ...]
    mask: Any = None
    bias: Any = None
    scale: float | None = None
    sink: Any = None
    softcap: float | None = None
    descale: tuple[float, float, float] | None = None
    d_out: Any = None
    rope: Any = None
    positions: tuple[np.ndarray, np.ndarray] | None = None
    kv_cache: Any = None

    @classmethod
    def of(
        cls,
        q: ArrayLike,
        k: ArrayLike,
        v: ArrayLike,
        *,
        mask: masks.Band | ArrayLike | None = None,
        bias: ArrayLike | None = None,
        scale: float | None = None,
        sink: ArrayLike | None = None,
        softcap: float | None = None,
        descale: tuple[float, float, float] | None = None,
        d_out: ArrayLike | None = None,
        rope: object = None,
        positions: ArrayLike | tuple[ArrayLike, ArrayLike] | None = None,
        kv_cache: object = None,
    ) -> AttentionProblem:
        """The problem of these arguments, each checked once against the others.

        Raises:
            InvalidArgument: naming the first argument that does not fit: a non-float or
                non-finite input, shapes that do not chain (``k``'s ``d_k`` is ``q``'s, ``v``'s
                keys are ``k``'s), no query, no key or ``d_k = 0``, batch dimensions that do
                not broadcast or broadcast to an empty batch, a mask that is not
                boolean or a band, a bias with NaN or ``+inf``, a mask, bias or sink that would
                enlarge the batch, a scale, soft-cap or descale that is not a finite number of
                the kind expected, a rope that is not a :class:`mhanum.rope.Rope` or wider
                than ``d_k``, positions without a rope or that do not fit.
        """
        q, k, v = (V.float_array(x, n, min_ndim=2) for x, n in ((q, "q"), (k, "k"), (v, "v")))
        _check_shapes_chain(q, k, v)
        shapes = {"q": q.shape[:-2], "k": k.shape[:-2], "v": v.shape[:-2]}
        if d_out is not None:
            d_out = _cotangent(d_out, (q.shape[-2], v.shape[-1]))
            shapes["d_out"] = d_out.shape[:-2]
        batch = _nonempty_batch(shapes)
        for x, name in ((q, "q"), (k, "k"), (v, "v"), (d_out, "d_out")):
            if x is not None:
                V.check_finite(x, name)
        scores = (*batch, q.shape[-2], k.shape[-2])
        V.scale_value(scale, q.shape[-1])  # a finite number or None (placement: check())
        rope_and_positions = _rope(rope, positions, q.shape[-1], q.shape[-2], k.shape[-2])
        return cls(
            q, k, v, batch,
            mask=masks.normalise(mask, scores),
            bias=checked_bias(bias, scores),
            scale=None if scale is None else float(scale),
            sink=_sink(sink, batch),
            softcap=V.softcap_value(softcap),
            descale=V.descale_value(descale),
            d_out=d_out,
            rope=rope_and_positions[0],
            positions=rope_and_positions[1],
            kv_cache=_kv_cache(kv_cache, rope, (descale, sink)),
        )  # fmt: skip

    @property
    def scores(self) -> tuple[int, ...]:
        """The shape of the logits, ``(*batch, Lq, Lk)``."""
        return (*self.batch, self.q.shape[-2], self.k.shape[-2])

    @property
    def output(self) -> tuple[int, ...]:
        """The shape of the output, ``(*batch, Lq, d_v)``."""
        return (*self.batch, self.q.shape[-2], self.v.shape[-1])

    @property
    def d_k(self) -> int:
        """The length of the score dots."""
        return int(self.q.shape[-1])

    def scale_value(self, placement: str = "scores") -> float:
        """The scale as a float64 number (``1/sqrt(d_k)`` rounded once when none was given),
        checked against its ``placement`` (``"qk"`` applies its square root to q and k)."""
        return V.scale_value(self.scale, self.d_k, placement=placement)

    def accumulated(self) -> Accumulated | None:
        """A cache under the accumulator placement (papers/kvcache.md, K.0 item 3) read as
        the kernel computes it; ``None`` for any other problem (:class:`Accumulated`)."""
        if self.kv_cache is None or self.kv_cache[0].placement != "accumulator":
            return None
        (kc, s_k, e_k), (vc, s_v, e_v) = (
            cache.accumulated(x) for cache, x in zip(self.kv_cache, (self.k, self.v), strict=True)
        )
        # the float64 quotients rounded up, and each within one rounding (relative 2^-53, or
        # 2^-1075 absolute below the normal range) of the exact x/ŝ; a scale past the scale
        # format's range is inf, where Theorem K.1's bound e is inf too: e/ŝ is then no bound
        # (NaN), and is taken as inf (the range checks of k and v say why)
        up, tiny = 1 + 2.0**-51, 2.0**-1074
        with np.errstate(invalid="ignore", over="ignore"):
            k_over, v_over = (
                np.asarray(x, np.float64) / s for x, s in ((self.k, s_k), (self.v, s_v))
            )
            e_k_over, e_v_over = (
                np.where(np.isnan(q := e / s), np.inf, q) * up + tiny
                for e, s in ((e_k, s_k), (e_v, s_v))
            )
        return Accumulated(
            (kc, vc),
            (k_over, v_over),
            (1.0, s_k, s_v),
            (e_k_over, e_v_over),
            (2.0**-52 * np.abs(k_over) + tiny, 2.0**-52 * np.abs(v_over) + tiny),
        )


@dataclasses.dataclass(frozen=True, eq=False)
class Accumulated:
    """A cache under the accumulator placement as the kernel computes: its dots read the
    ``codes`` of k and v, and its scales act as the fp8 descale ``(1, ŝ_k, ŝ_v)`` (``ŝ_k`` joins
    the scores' constant, ``ŝ_v`` multiplies the output). Theorem A.1 then takes the exact
    attention as that of ``descale·quotients``, the float64 quotients ``k/ŝ_k`` and ``v/ŝ_v``,
    the codes within ``errors`` of them (K.1 over the scale) as the operands' errors (step 1),
    and the quotients within ``given`` of the exact ``x/ŝ`` (one float64 rounding)."""

    codes: tuple[np.ndarray, np.ndarray]
    quotients: tuple[np.ndarray, np.ndarray]
    descale: tuple[float, float, float]
    errors: tuple[np.ndarray, np.ndarray]
    given: tuple[np.ndarray, np.ndarray]


@dataclasses.dataclass(frozen=True, eq=False)
class MHAProblem:
    """The inputs of one multi-head attention layer, checked together.

    Attributes:
        x_q, x_kv: ``(..., Lq, d_q)`` and ``(..., Lk, d_kv)`` floating-point arrays as given.
        params: the layer (:class:`mhanum.MHAParams`), grouped key/value heads expanded to one
            per query head (:meth:`mhanum.MHAParams.expand_kv_heads`).
        grouped: the layer as given (``params`` itself without ``num_kv_heads``).
        num_heads: the query heads ``H``; ``num_kv_heads``: the key/value heads, or ``None``.
        batch: the batch dimensions of ``x_q`` and ``x_kv`` (and ``d_out``) broadcast together.
        mask, bias, scale, sink, softcap: as for :class:`AttentionProblem`, against the scores
            ``(*batch, H, Lq, Lk)``; a sink is one logit per head (``(H,)`` or broadcast).
        d_out: ``None``, or for a backward pass the output's cotangent ``(..., Lq, d_out)``.
        rope, positions: as for :class:`AttentionProblem`: every head's projected queries and
            keys are rotated (``rope.dim`` at most the head's ``d_k``).
    """

    x_q: Any
    x_kv: Any
    params: Any
    grouped: Any
    num_heads: int
    num_kv_heads: int | None
    batch: tuple[int, ...]
    mask: Any = None
    bias: Any = None
    scale: float | None = None
    sink: Any = None
    softcap: float | None = None
    d_out: Any = None
    rope: Any = None
    positions: tuple[np.ndarray, np.ndarray] | None = None
    descale: ClassVar[None] = None  # fp8 descale factors: single-head attention only

    @classmethod
    def of(
        cls,
        x_q: ArrayLike,
        x_kv: ArrayLike,
        params: MHAParams,
        num_heads: int,
        *,
        mask: masks.Band | ArrayLike | None = None,
        bias: ArrayLike | None = None,
        scale: float | None = None,
        sink: ArrayLike | None = None,
        softcap: float | None = None,
        num_kv_heads: int | None = None,
        d_out: ArrayLike | None = None,
        rope: object = None,
        positions: ArrayLike | tuple[ArrayLike, ArrayLike] | None = None,
    ) -> MHAProblem:
        """The problem of these arguments, each checked once against the others.

        Raises:
            InvalidArgument: naming the first argument that does not fit: ``params`` that is not
                an :class:`mhanum.MHAParams` or whose widths ``num_heads`` (``num_kv_heads``)
                does not divide, inputs whose widths are not the layer's or that are not finite
                floats, no query or no key, an empty batch, and the mask, bias, scale, sink
                and soft-cap as for :meth:`AttentionProblem.of`.
        """
        if not isinstance(params, MHAParams):
            msg = f"params: expected an MHAParams, got {type(params).__name__}"
            raise InvalidArgument(msg)
        grouped = params
        full = params if num_kv_heads is None else params.expand_kv_heads(num_heads, num_kv_heads)
        heads = V.positive_int(num_heads, "num_heads")
        full.validate(heads)
        widths = {"x_q": full.d_q, "x_kv": full.d_kv, "d_out": full.d_out}
        given = {"x_q": x_q, "x_kv": x_kv, "d_out": d_out}
        arrays = {n: _of_width(x, n, widths[n]) for n, x in given.items() if x is not None}
        if d_out is not None and arrays["d_out"].shape[-2] != arrays["x_q"].shape[-2]:
            msg = (
                f"d_out: expected the output's shape (..., {arrays['x_q'].shape[-2]}, "
                f"{full.d_out}), got {arrays['d_out'].shape}"
            )
            raise InvalidArgument(msg)
        batch = _nonempty_batch({n: a.shape[:-2] for n, a in arrays.items()})
        for name, rows in (("x_q", "query"), ("x_kv", "key")):
            if arrays[name].shape[-2] < 1:
                msg = (
                    f"{name}: expected at least one {rows} (dimension -2), got {arrays[name].shape}"
                )
                raise InvalidArgument(msg)
        scores = (*batch, heads, arrays["x_q"].shape[-2], arrays["x_kv"].shape[-2])
        V.scale_value(scale, full.qk_width // heads)
        if rope is not None and d_out is not None:
            msg = "rope: expected None for the gradients of multi-head attention (not modelled)"
            raise InvalidArgument(msg)
        rope_and_positions = _rope(rope, positions, full.qk_width // heads, scores[-2], scores[-1])
        return cls(
            arrays["x_q"], arrays["x_kv"], full, grouped, heads,
            None if num_kv_heads is None else int(num_kv_heads), batch,
            mask=masks.normalise(mask, scores),
            bias=checked_bias(bias, scores),
            scale=None if scale is None else float(scale),
            sink=None if sink is None else masks.check_sink(sink, scores[:-2], xp=_namespace(sink)),
            softcap=V.softcap_value(softcap),
            d_out=arrays.get("d_out"),
            rope=rope_and_positions[0],
            positions=rope_and_positions[1],
        )  # fmt: skip

    @property
    def scores(self) -> tuple[int, ...]:
        """The shape of the heads' logits, ``(*batch, H, Lq, Lk)``."""
        return (*self.batch, self.num_heads, self.x_q.shape[-2], self.x_kv.shape[-2])

    @property
    def d_k(self) -> int:
        """The length of a head's score dots."""
        return int(self.params.qk_width // self.num_heads)

    def scale_value(self, placement: str = "scores") -> float:
        """A head's scale as a float64 number, as :meth:`AttentionProblem.scale_value`."""
        return V.scale_value(self.scale, self.d_k, placement=placement)


def _of_width(x: ArrayLike, name: str, width: int) -> Array:
    """A finite float input ``(..., L, width)``."""
    arr = V.float_array(x, name, min_ndim=2)
    if arr.shape[-1] != width:
        msg = f"{name}: expected last dimension {width} (from params), got shape {arr.shape}"
        raise InvalidArgument(msg)
    V.check_finite(arr, name)
    return arr


def _check_shapes_chain(q: Array, k: Array, v: Array) -> None:
    if k.shape[-1] != q.shape[-1]:
        msg = f"k: expected last dimension d_k = {q.shape[-1]} (from q), got shape {k.shape}"
        raise InvalidArgument(msg)
    if v.shape[-2] != k.shape[-2]:
        msg = f"v: expected {k.shape[-2]} keys (Lk, from k) in dimension -2, got shape {v.shape}"
        raise InvalidArgument(msg)
    if q.shape[-2] < 1 or k.shape[-2] < 1 or q.shape[-1] < 1:
        msg = f"k: expected at least one query, one key and d_k >= 1, got q {q.shape}, k {k.shape}"
        raise InvalidArgument(msg)


def _nonempty_batch(shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    """The named batch shapes broadcast together, each dimension at least 1: an empty batch
    holds no problem to bound, and is refused like an empty row (no query, no key)."""
    batch = V.broadcast(shapes)
    if 0 in batch:
        described = ", ".join(f"{n} {s}" for n, s in shapes.items())
        msg = f"{', '.join(shapes)}: expected batch dimensions of at least 1, got {described}"
        raise InvalidArgument(msg)
    return batch


def _cotangent(d_out: ArrayLike, rows: tuple[int, int]) -> Array:
    """The output's cotangent, shaped like the output ``(..., Lq, d_v)``."""
    g = V.float_array(d_out, "d_out", min_ndim=2)
    if tuple(g.shape[-2:]) != rows:
        msg = f"d_out: expected the output's shape (..., {rows[0]}, {rows[1]}), got {g.shape}"
        raise InvalidArgument(msg)
    return g


def checked_bias(bias: ArrayLike | None, scores: tuple[int, ...]) -> Array | None:
    """``bias`` checked against the ``scores`` shape: ``None``, or a float array broadcastable to
    it, ``-inf`` allowed (an excluded key), as given.

    Raises:
        InvalidArgument: for a non-float bias, a NaN or ``+inf`` entry, or a shape that does
            not broadcast to ``scores``.
    """
    if bias is None:
        return None
    arr = V.float_array(bias, "bias")
    V.check_finite(arr, "bias", allow_neg_inf=True)
    V.check_broadcastable_to(arr, "bias", scores)
    return arr


def _rope(
    rope: object,
    positions: ArrayLike | tuple[ArrayLike, ArrayLike] | None,
    d_k: int,
    q_len: int,
    k_len: int,
) -> tuple[object, tuple[np.ndarray, np.ndarray] | None]:
    """The rope and the queries' and keys' positions, checked by the rope itself
    (:meth:`mhanum.rope.Rope.positions_for`: this module does no arithmetic of its own)."""
    if rope is None:
        if positions is not None:
            msg = "positions: expected only with rope= (the positions of a rotary embedding)"
            raise InvalidArgument(msg)
        return None, None
    checker = getattr(rope, "positions_for", None)
    if not callable(checker):
        msg = f"rope: expected a mhanum.rope.Rope, got {type(rope).__name__}"
        raise InvalidArgument(msg)
    return rope, checker(positions, d_k=d_k, q_len=q_len, k_len=k_len)


def _kv_cache(cache: object, rope: object, others: tuple[object, object]) -> tuple[Any, Any] | None:
    """The caches of k and of v (:class:`mhanum.kvcache.KVQuant`, checked when made): one for
    both, or a pair ``(k's, v's)``; or ``None``. Under the accumulator placement both are
    read so, each with one scale (its products by the scales are the fp8 descale's). With
    RoPE the kernel caches its rotated keys, whose scales must be given (Corollary K.3)."""
    if cache is None:
        return None
    pair = tuple(cache) if isinstance(cache, (tuple, list)) else (cache, cache)
    if len(pair) != 2 or not all(callable(getattr(c, "read", None)) for c in pair):
        msg = (
            "kv_cache: expected a mhanum.kvcache.KVQuant or a pair of them (k's, v's), got "
            f"{type(cache).__name__}"
        )
        raise InvalidArgument(msg)
    placements = [getattr(c, "placement", "operand") for c in pair]
    if rope is not None and (placements[0] != "operand" or getattr(pair[0], "scale", 0) is None):
        msg = (
            "kv_cache: expected K's cache with given scales (KVQuant(scale=...)) under the "
            "operand placement with rope= (the kernel caches its rotated keys: dynamic scales "
            f"would depend on its rotation), got placement={placements[0]!r}, "
            f"scale={getattr(pair[0], 'scale', None)!r}"
        )
        raise InvalidArgument(msg)
    if "accumulator" in placements:
        grains = [getattr(c, "granularity", "tensor") for c in pair]
        if placements != ["accumulator"] * 2 or grains != ["tensor"] * 2:
            msg = (
                "kv_cache: expected the accumulator placement for both k and v, each with "
                f"granularity='tensor', got placements {placements} and granularities {grains}"
            )
            raise InvalidArgument(msg)
        descale, sink = others
        if descale is not None:
            msg = (
                "descale: expected None with a cache under the accumulator placement (its "
                f"scales are the descale factors), got {descale!r}"
            )
            raise InvalidArgument(msg)
        if sink is not None:
            msg = "sink: expected None with a cache under the accumulator placement, got sinks"
            raise InvalidArgument(msg)
    return (pair[0], pair[1])


def _sink(sink: ArrayLike | None, batch: tuple[int, ...]) -> Array | None:
    """Finite sink logits that fit the batch (a sink never adds batch dimensions): float64
    numpy, or a JAX array as given."""
    if sink is None:
        return None
    return masks.check_sink(sink, batch, xp=_namespace(sink))


def _namespace(x: object) -> ModuleType:
    import jax
    import jax.numpy as jnp

    return jnp if isinstance(x, jax.Array) else np
