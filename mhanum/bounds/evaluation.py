"""The float64 evaluation of a bound in XLA: its error model (papers/evaluation.md).

A bound evaluated in float64 by XLA (``jax.jit``, on the CPU or a GPU) makes rounding errors of
its own, and they must be charged, not assumed away. This module states the model the jitted
stages charge against, Theorem E.0 of ``papers/evaluation.md``:

* ``+``, ``-``, ``*`` and ``sqrt`` round to nearest, ``|δ| <= u = 2^-53``; XLA contracts
  ``a*b + c`` into a fused multiply-add, which removes a rounding and is covered by the same
  model (no step of a bound relies on an expression being exact that contraction could change);
* every value below ``2^-1022`` in magnitude, read or produced, may be flushed to zero (XLA's CPU
  runtime runs with flush-to-zero and denormals-are-zero: an absolute error ``FLUSH`` per
  operation, and ``log`` of a subnormal is ``-inf``);
* a division by a variable is correctly rounded; a division by a constant the compiler sees is
  a product by the rounded reciprocal (two roundings);
* sums and dots of ``n`` terms are evaluated in an unknown order (vectorised, blocked,
  threaded): ``γ_{n-1}``, resp. ``γ_n``, of the sum of magnitudes, plus ``FLUSH`` per operation;
* ``exp``, ``log`` and ``tanh`` are within the relative errors of :data:`XLA_FLOAT64` in the
  normal range (their sources: XLA's own ulp budgets, CUDA's libdevice documentation, and the
  measurements of ``tests/bounds/test_evaluation_model.py``, with a margin);
* XLA's own ``log1p`` and ``expm1`` are not relied upon (on the CPU, ``jnp.log1p`` errs by more
  than 100 ulps on ``[-0.5, -0.1]``): :func:`log1p` and :func:`expm1` here compute them from
  ``log`` and ``exp`` by Goldberg's and Kahan's corrections, with the bounds of Lemmas E.1 and
  E.2.

Examples:
    >>> XLA_FLOAT64.relative("exp") == 8 * U64
    True
    >>> XLA_FLOAT64.sum_relative(3) == 2 * U64 / (1 - 2 * U64)
    True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp

from mhanum._errors import InvalidArgument

__all__ = ["FLUSH", "U64", "XLA_FLOAT64", "Float64Evaluation", "expm1", "log1p"]

U64 = 2.0**-53  # float64's unit roundoff
FLUSH = 2.0**-1022  # float64's smallest normal number: flush-to-zero's absolute error


@dataclasses.dataclass(frozen=True)
class Float64Evaluation:
    """The error model of a float64 evaluation (Theorem E.0 of papers/evaluation.md).

    Attributes:
        name: what the model describes.
        relatives: a bound on the relative error, in the normal range, of each operation and
            elementary function the stages use, by name.
        flush: the absolute error of reading or producing a value below float64's smallest
            normal number (flush-to-zero, denormals-are-zero), per operation.
        sources: where each figure of ``relatives`` comes from, by name.
    """

    name: str
    relatives: Mapping[str, float]
    flush: float
    sources: Mapping[str, str]

    def relative(self, operation: str) -> float:
        """The relative error bound of ``operation`` (a key of :attr:`relatives`).

        Raises :class:`~mhanum.InvalidArgument` for an operation the model does not cover:
        a stage may use only what the model states.
        """
        if operation not in self.relatives:
            msg = (
                f"operation: expected one of {', '.join(sorted(self.relatives))}, got {operation!r}"
            )
            raise InvalidArgument(msg)
        return self.relatives[operation]

    def sum_relative(self, n: int) -> float:
        """``γ_{n-1}`` for a sum of ``n`` terms in any order: ``|ŝ - s| <= γ_{n-1} Σ|x_i|``
        plus ``(n - 1)·flush`` (Higham 2002, (4.4); any order, blocking and threads included)."""
        return _gamma(max(n - 1, 0))

    def dot_relative(self, n: int) -> float:
        """``γ_n`` for a dot product of length ``n`` in any order, FMA contracted or not:
        ``|ŝ - s| <= γ_n Σ|a_i b_i|`` plus ``2n·flush`` (Higham 2002, (3.5))."""
        return _gamma(n)


def _gamma(n: int) -> float:
    nu = n * U64
    if nu >= 1:
        msg = f"n: expected fewer than 2^53 terms, got {n}"
        raise InvalidArgument(msg)
    return nu / (1 - nu)


XLA_FLOAT64 = Float64Evaluation(
    name="XLA float64 (CPU and GPU, fast math off)",
    relatives=MappingProxyType(
        {
            "add": U64,
            "multiply": U64,
            "sqrt": U64,
            "divide": 2 * U64 + U64**2,
            "exp": 8 * U64,
            "log": 4 * U64,
            "tanh": 16 * U64,
            "log1p": 8 * U64,
            "expm1": 16 * U64,
        }
    ),
    flush=FLUSH,
    sources=MappingProxyType(
        {
            "add": "IEEE 754 round to nearest; FMA contraction removes a rounding",
            "multiply": "IEEE 754 round to nearest; FMA contraction removes a rounding",
            "sqrt": "IEEE 754 (llvm.sqrt; CUDA: __dsqrt_rn)",
            "divide": "IEEE 754 for a variable divisor; a constant one is x·fl(1/c): two roundings",
            "exp": "XLA's ulp budget for f64 exp (1 ulp, CPU and GPU) and libdevice's 1 ulp; 4 ulps",
            "log": "libdevice's 1 ulp (GPU); measured under 1 ulp on the CPU; 2 ulps",
            "tanh": "XLA's ulp budget for f64 tanh (4 ulps CPU, 1 ulp GPU); 8 ulps",
            "log1p": "Lemma E.1: log's error + 3u + u (Goldberg's correction)",
            "expm1": "Lemma E.2: exp's and log's errors + 4u (Kahan's correction)",
        }
    ),
)
"""The model the jitted stages charge against: one for the CPU and the GPU, the larger figure
of the two wherever they differ (an ulp is at most ``2u`` relative: ``k`` ulps is ``2k·u``)."""


def _float64(x: Any) -> jax.Array:
    """``x`` as a float64 JAX array; refused outside JAX's 64-bit mode (it would be float32)."""
    if not jax.config.read("jax_enable_x64"):
        msg = (
            "x: the bound's evaluation is float64, which needs JAX's 64-bit mode; call "
            "jax.config.update('jax_enable_x64', True) at start-up"
        )
        raise InvalidArgument(msg)
    return jnp.asarray(x, jnp.float64)


def log1p(x: Any) -> jax.Array:
    """``log(1 + x)`` within :data:`XLA_FLOAT64` ``.relative("log1p")``, from ``log`` alone
    (Lemma E.1 of papers/evaluation.md; Goldberg 1991, Theorem 4).

    ``s = fl(1 + x)`` and ``w = s - 1`` (exact for ``x > -1``), then ``log(s)·(x / w)``: the
    factor ``x / w`` corrects for the rounding of ``1 + x``. The optimisation barrier keeps the
    compiler from rewriting ``log(1 + x)`` or reading ``w`` as ``x``.

    Examples:
        >>> jax.config.update("jax_enable_x64", True)  # the bounds evaluate in float64
        >>> float(log1p(jnp.float64(1e-300))) == 1e-300
        True
        >>> abs(float(log1p(jnp.float64(-0.25))) - (-0.2876820724517809)) < 1e-16
        True
    """
    x = _float64(x)
    s = jax.lax.optimization_barrier(1.0 + x)
    w = s - 1.0
    ratio = jnp.where(jnp.isinf(w), 1.0, x / jnp.where(w == 0, 1.0, w))
    return jnp.where(s == 1.0, x, jnp.log(s) * ratio)


def expm1(x: Any) -> jax.Array:
    """``exp(x) - 1`` within :data:`XLA_FLOAT64` ``.relative("expm1")``, from ``exp`` and
    ``log`` (Lemma E.2 of papers/evaluation.md; Kahan's correction, Higham 2002, §1.14.1).

    ``e = fl(exp(x))`` and ``w = fl(e - 1)``, then ``w·(x / log(e))``: the factor corrects for
    the rounding of ``exp``. The optimisation barrier keeps the compiler from rewriting
    ``exp(x) - 1``.

    Examples:
        >>> jax.config.update("jax_enable_x64", True)  # the bound evaluates in float64
        >>> float(expm1(jnp.float64(1e-300))) == 1e-300
        True
        >>> float(expm1(jnp.float64(-800.0)))
        -1.0
    """
    x = _float64(x)
    e = jax.lax.optimization_barrier(jnp.exp(x))
    w = e - 1.0
    log_e = jnp.log(e)
    ratio = x / jnp.where(log_e == 0, 1.0, log_e)
    general = jnp.where(jnp.isinf(e), e, w * ratio)
    return jnp.where(e == 1.0, x, jnp.where(w == -1.0, -1.0, general))
