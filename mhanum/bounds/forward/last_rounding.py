"""Step 7 and 7' of Theorem A.1 (papers/attention.md): the output's last rounding, into the
output format, of a value the other terms enclose. Its underflow is charged only where that
value may lie below the format's normal range (step 7), and the rounding to nearest may cost
far less than ``u_o|o|`` (step 7')."""

from __future__ import annotations

from typing import Any

import numpy as np

from mhanum._types import NumpyArray
from mhanum.bounds.forward.evaluation import quiet
from mhanum.formats import round_to
from mhanum.numerics import Numerics
from mhanum.units import Online

__all__ = ["nearest_output", "read_by_the_output"]


def read_by_the_output(
    terms: dict[str, Any], num: Numerics, o_ev: tuple[Any, Any], u_last: float | NumpyArray
) -> tuple[Any, Any, Any]:
    """What the last rounding reads: ``(E, E_x, flush)`` with ``E`` the other terms (``>= |x -
    o*|`` before the output's rounding; online, before the division), ``E_x >= |x - o*|`` for
    the value ``x`` the rounding into ``F_o`` reads (online ``y = fl_m(acc/l)``: ``E + u_÷(|o|
    + ε + E)`` and ``η_m`` where ``y`` may flush), and ``flush``: ``η_o`` where ``|x| >= |o| - ε -
    E_x`` may lie below ``F_o``'s smallest normal number, 0 where it is proven normal (a normal
    ``x`` rounds to a normal value, ``|fl_o(x) - x| <= u_o|x|``; a flush or a subnormal result
    only below). ``o_ev``: the float64 ``o`` and its error ``ε``. Not proven (a NaN) counts as
    below."""
    o, ev = o_ev
    eta_m = num.format_of("softmax").smallest_normal
    eta_o = num.format_of("output").smallest_normal
    e_other = sum(terms[n] for n in terms if n != "output")
    e_x = e_other
    with quiet():
        if isinstance(num.softmax_algorithm, Online):  # y = fl(acc/l) in F_m, then fl_o(y)
            # the division within u_last of the quotient acc/l (no need to round to nearest), or
            # a flush below F_m's smallest normal number: |y - o*| <= E + u_last(|o*| + E) (+ η_m)
            low = np.abs(o) - ev - e_other
            flush_m = np.where(low * (1 - u_last) >= eta_m, 0.0, eta_m)
            e_x = e_other + u_last * (np.abs(o) + ev + e_other) + flush_m
        flush = np.where(np.abs(o) - ev - e_x >= eta_o, 0.0, eta_o)
    return e_other, e_x, flush


def nearest_output(num: Numerics, o_ev: tuple[Any, Any], read: tuple[Any, Any, Any]) -> Any:
    """Step 7'. The last rounding is to nearest: the computed ``x`` (``|x - o*| <= E``, the
    other terms) rounds to a value at least as close to ``x`` as any value ``r`` of the
    format (plus ``η`` for a flush to zero), and ``r = fl(o)`` is within ``|fl(o) - o| + ε +
    E`` of ``x`` (``ε``: ``o``'s own float64 error). Where ``o`` is (nearly) a value of the
    format and ``E`` is below half its spacing, this is far below ``u|o|``. Online the output
    is first the division's ``y`` in the softmax format, within ``E_y = E + u_÷(|o| + ε + E)``
    of the exact output (``u_÷``: 0 on a one-key row's exact ``acc/1``), and ``fl_o(y)`` is
    within ``|fl_o(o) - o| + ε`` plus twice that. ``read``: :func:`read_by_the_output`."""
    o, ev = o_ev
    e_other, e_x, flush_o = read
    off_o = np.abs(round_to(o, num.format_of("output")) - o) + ev
    if isinstance(num.softmax_algorithm, Online):
        return off_o + 2 * e_x - e_other + flush_o
    return off_o + e_other + flush_o
