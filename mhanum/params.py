"""Multi-head attention parameters in the ``y = x @ w + b`` convention."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from mhanum import _validate as V
from mhanum._errors import InvalidArgument

__all__ = ["MHAParams"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MHAParams:
    """Weights of one multi-head attention layer, ``y = x @ w + b`` for every projection.

    Shapes, with ``H`` heads of query/key size ``d_k`` and value size ``d_v``:

    * ``wq`` ``(d_q, H*d_k)``, ``wk`` ``(d_kv, H*d_k)``, ``wv`` ``(d_kv, H*d_v)``,
      ``wo`` ``(H*d_v, d_out)``;
    * ``bq`` ``(H*d_k,)``, ``bk`` ``(H*d_k,)``, ``bv`` ``(H*d_v,)``, ``bo`` ``(d_out,)``,
      each optional (``None`` means no bias and no bias addition).

    Head ``h`` uses columns ``[h*d_k, (h+1)*d_k)`` of ``wq``/``wk`` (and of ``wv`` with ``d_v``) and
    rows ``[h*d_v, (h+1)*d_v)`` of ``wo``. The number of heads is not stored: the same parameters
    can be run with any ``num_heads`` that divides ``H*d_k`` and ``H*d_v``.

    The class is a JAX pytree, so it can be passed through ``jax.jit``.
    """

    wq: np.ndarray
    wk: np.ndarray
    wv: np.ndarray
    wo: np.ndarray
    bq: np.ndarray | None = None
    bk: np.ndarray | None = None
    bv: np.ndarray | None = None
    bo: np.ndarray | None = None

    @property
    def d_q(self) -> int:
        """Width of the query input ``x_q``."""
        return int(self.wq.shape[0])

    @property
    def d_kv(self) -> int:
        """Width of the key/value input ``x_kv``."""
        return int(self.wk.shape[0])

    @property
    def qk_width(self) -> int:
        """``H*d_k``: total width of the projected queries and keys."""
        return int(self.wq.shape[1])

    @property
    def v_width(self) -> int:
        """``H*d_v``: total width of the projected values."""
        return int(self.wv.shape[1])

    @property
    def d_out(self) -> int:
        """Width of the output."""
        return int(self.wo.shape[1])

    def validate(self, num_heads: int | None = None) -> None:
        """Check shapes, finiteness and (if given) divisibility by ``num_heads``.

        Raises:
            InvalidArgument: naming the offending field, with the expected and the actual shape.
        """
        for name in ("wq", "wk", "wv", "wo"):
            w = getattr(self, name)
            if np.ndim(w) != 2:
                msg = f"params.{name}: expected a 2-D array, got shape {np.shape(w)}"
                raise InvalidArgument(msg)
        expected = {
            "wk": (None, self.qk_width),
            "wv": (self.d_kv, None),
            "wo": (self.v_width, None),
        }
        for name, (rows, cols) in expected.items():
            shape = np.shape(getattr(self, name))
            if (rows is not None and shape[0] != rows) or (cols is not None and shape[1] != cols):
                want = f"({rows if rows is not None else '*'}, {cols if cols is not None else '*'})"
                msg = f"params.{name}: expected shape {want}, got {shape}"
                raise InvalidArgument(msg)
        biases = {"bq": self.qk_width, "bk": self.qk_width, "bv": self.v_width, "bo": self.d_out}
        for name, width in biases.items():
            b = getattr(self, name)
            if b is not None and np.shape(b) != (width,):
                msg = f"params.{name}: expected shape ({width},), got {np.shape(b)}"
                raise InvalidArgument(msg)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None or isinstance(value, jax.core.Tracer):
                continue
            arr = np.asarray(value)
            if not np.issubdtype(arr.dtype, np.floating) and arr.dtype.kind != "V":
                msg = f"params.{f.name}: expected a floating-point array, got dtype {arr.dtype}"
                raise InvalidArgument(msg)
            if not np.all(np.isfinite(arr.astype(np.float64))):
                msg = f"params.{f.name}: expected finite values, got NaN or Inf"
                raise InvalidArgument(msg)
        if num_heads is not None:
            if not isinstance(num_heads, (int, np.integer)) or num_heads < 1:
                msg = f"num_heads: expected a positive integer, got {num_heads!r}"
                raise InvalidArgument(msg)
            for label, width in (
                ("H*d_k (wq columns)", self.qk_width),
                ("H*d_v (wv columns)", self.v_width),
            ):
                if width % num_heads:
                    msg = f"num_heads: expected a divisor of {label} = {width}, got {num_heads}"
                    raise InvalidArgument(msg)

    @classmethod
    def random(
        cls,
        d_model: int,
        *,
        seed: int,
        d_kv: int | None = None,
        d_out: int | None = None,
        bias: bool = True,
        kv_width: int | None = None,
    ) -> MHAParams:
        """Glorot-uniform weights and small uniform biases, float64, from an explicit seed.

        Args:
            d_model: projected width ``H*d_k = H*d_v`` and query input width.
            seed: seed of a ``numpy.random.Generator`` (PCG64); the same seed gives the same bits.
            d_kv: key/value input width (default ``d_model``).
            d_out: output width (default ``d_model``).
            bias: whether to draw biases (otherwise all biases are ``None``).
            kv_width: the key and value projections' width ``H_kv*d_k`` (default ``d_model``;
                smaller for grouped-query attention, see :meth:`expand_kv_heads`).

        Raises:
            InvalidArgument: for a non-positive width or a non-integer seed.
        """
        d_kv = d_model if d_kv is None else d_kv
        d_out = d_model if d_out is None else d_out
        kv_width = d_model if kv_width is None else kv_width
        sizes = (("d_model", d_model), ("d_kv", d_kv), ("d_out", d_out), ("kv_width", kv_width))
        for name, val in sizes:
            if not isinstance(val, (int, np.integer)) or val < 1:
                msg = f"{name}: expected a positive integer, got {val!r}"
                raise InvalidArgument(msg)
        if not isinstance(seed, (int, np.integer)):
            msg = f"seed: expected an integer, got {seed!r}"
            raise InvalidArgument(msg)
        rng = np.random.default_rng(seed)

        def glorot(fan_in: int, fan_out: int) -> np.ndarray:
            limit = np.sqrt(6.0 / (fan_in + fan_out))
            return rng.uniform(-limit, limit, size=(fan_in, fan_out))

        wq, wk, wv = glorot(d_model, d_model), glorot(d_kv, kv_width), glorot(d_kv, kv_width)
        wo = glorot(d_model, d_out)
        if not bias:
            return cls(wq, wk, wv, wo)
        b = [rng.uniform(-0.1, 0.1, size=n) for n in (d_model, kv_width, kv_width, d_out)]
        return cls(wq, wk, wv, wo, *b)

    def expand_kv_heads(self, num_heads: int, num_kv_heads: int) -> MHAParams:
        """Grouped-query attention as multi-head attention: the key and value projections of
        ``num_kv_heads`` heads repeated so that query head ``h`` reads key/value head
        ``h // (num_heads / num_kv_heads)`` (torch's ``enable_gqa``, ``repeat_interleave``).

        ``wk``, ``bk`` hold ``H_kv*d_k`` columns and ``wv``, ``bv`` ``H_kv*d_v``; each head's
        block of columns is repeated ``H / H_kv`` times. A head's projection is the same dot
        products of the same operands, so the expanded layer computes the grouped one's values
        (``num_kv_heads = 1``: multi-query attention).

        Raises:
            InvalidArgument: for head counts that are not positive, ``num_kv_heads`` not dividing
                ``num_heads``, or widths that do not fit them (each field named).

        Examples:
            >>> p = MHAParams.random(8, seed=0, kv_width=4)  # 4 heads of 2, 2 key/value heads
            >>> p.expand_kv_heads(4, 2).wk.shape
            (8, 8)
        """
        num_heads = V.positive_int(num_heads, "num_heads")
        num_kv_heads = V.positive_int(num_kv_heads, "num_kv_heads")
        if num_heads % num_kv_heads:
            msg = f"num_kv_heads: expected a divisor of num_heads = {num_heads}, got {num_kv_heads}"
            raise InvalidArgument(msg)
        group = num_heads // num_kv_heads
        widths = {"qk": np.shape(self.wq)[-1], "v": np.shape(self.wo)[0]}
        for label, width in widths.items():
            if width % num_heads:
                msg = f"num_heads: expected a divisor of the {label} width {width}, got {num_heads}"
                raise InvalidArgument(msg)
        d = {"qk": widths["qk"] // num_heads, "v": widths["v"] // num_heads}
        fields = (("wk", "qk"), ("bk", "qk"), ("wv", "v"), ("bv", "v"))
        expanded: dict[str, Any] = {}
        for name, kind in fields:
            w = getattr(self, name)
            if w is None:
                continue
            w = np.asarray(w)
            want = num_kv_heads * d[kind]
            if np.ndim(w) < 1 or w.shape[-1] != want:
                msg = (
                    f"params.{name}: expected {want} columns (num_kv_heads = {num_kv_heads} "
                    f"heads of {d[kind]}), got shape {w.shape}"
                )
                raise InvalidArgument(msg)
            blocks = w.reshape(*w.shape[:-1], num_kv_heads, d[kind])
            expanded[name] = np.repeat(blocks, group, axis=-2).reshape(*w.shape[:-1], -1)
        return dataclasses.replace(self, **expanded)
