"""The soft-capped logits in the backward pass: Theorem B.7's steps 2c and 6c, and B.9 (b)'s
slope (papers/backward.md)."""

from __future__ import annotations

import numpy as np

from mhanum.bounds.a_priori import (
    CappedLogits,
    cap_constant,
    cap_roundings,
    evaluated_constants,
)
from mhanum.bounds.enclosure import U64, Enclosure, Ranges, read_error
from mhanum.bounds.factors import compound
from mhanum.formats import Format
from mhanum.numerics import Numerics

__all__ = ["slope_a_priori", "softcap_step", "through_cap"]


def _sech2(x: np.ndarray) -> np.ndarray:
    """``sech²(x)``, 0 past float64's range (rounded up: ``(1 + 2^-50)``)."""
    with np.errstate(over="ignore"):
        return (1 + 2.0**-50) / np.cosh(np.minimum(np.abs(x), 400.0)) ** 2


def softcap_step(
    s: Enclosure, cap: float, num: Numerics, grad: Format, keep: np.ndarray, rng: Ranges
) -> tuple[Enclosure, Enclosure]:
    """Step 2c (papers/backward.md, B.7): the scaled scores ``s`` (computed ``ŝ``) capped at
    ``a = c·tanh(s/c)``, computed as ``fl_s(ĉ·fl_s(T(fl_s(ŝ·r̂))))``; and the slope
    ``σ = 1 - tanh²(s/c)`` the backward reads, computed as ``fl_g(1 - fl_g(t̂²))``.

    With ``y₀ = fl(s̃/c)``, every value in play lies within ``R`` of ``y₀``; ``tanh`` moves by at
    most ``sech²(max(0, |y₀| - R))`` per unit there, so ``|t̂ - tanh(s/c)| <= L·w + e_T`` for
    ``|x̂ - s/c| <= w = |ŝ - s| r̂ + |s||r̂ - 1/c| + u_s|ŝ|r̂ + η_s`` and ``tanh``'s rounding
    ``e_T`` (``tanh_ulps`` of its carrier, then the score format)."""
    rounded = cap_roundings(cap, num)
    fs, carrier, u_s, eta_s, u_t, eta_t = rounded[:6]
    if not rounded.finite:
        rng.check(np.inf, fs, f"softcap: the cap {cap:g} or its reciprocal in {fs.name}",
                  ("dq", "dk", "dv", "dbias"))  # fmt: skip
    c_hat, e_c, r_hat, e_r = evaluated_constants(rounded, cap)
    s_up, s_used = s.up, s.used
    rng.check(np.where(keep, s_used * r_hat * (1 + u_s) + eta_s, 0.0), fs,
              f"the scores times 1/softcap = {r_hat:.4g}", ("dq", "dk", "dv", "dbias"))  # fmt: skip
    y0 = s.mid / cap
    r_y = s.rad / cap + 2 * U64 * np.abs(y0)
    w = s.err * r_hat + s_up * e_r + u_s * s_used * r_hat + eta_s
    big_r = r_y + w
    lip = _sech2(np.maximum(0.0, np.abs(y0) - big_r))
    th0 = np.abs(np.tanh(y0)) * (1 + 2.0**-50)
    tau = np.minimum(1.0, th0 + lip * big_r)  # >= |tanh| anywhere in play
    tau_x = np.minimum(1.0, th0 + lip * r_y)  # >= |tanh(s/c)|
    e_t = u_t * tau + eta_t
    if carrier.name != fs.name:
        e_t = e_t + u_s * (tau + e_t) + eta_s
    e_tau = lip * w + e_t  # |t̂ - tanh(s/c)|
    a_mid = cap * np.tanh(y0)
    a_rad = cap * lip * r_y + 2.0**-50 * np.abs(a_mid) + 2.0**-1070
    a_err = e_c * (tau_x + e_tau) + cap * e_tau + u_s * c_hat * (tau_x + e_tau) + eta_s
    # the slope, in the gradient format
    u_g, eta_g = grad.u, grad.smallest_normal
    e_tg = e_tau + read_error(tau_x + e_tau, fs, grad)
    sq = (tau_x + e_tg) ** 2
    # |1 - fl(t̂²)| <= 1 + fl(t̂²) <= 1 + sq(1 + u_g) + η_g
    sig_err = (
        e_tg * (2 * tau_x + e_tg) + u_g * sq + eta_g + u_g * (1 + sq * (1 + u_g) + eta_g) + eta_g
    )
    low = np.maximum(0.0, np.abs(np.tanh(y0)) * (1 - 2.0**-50) - lip * r_y)
    sig_up = np.minimum(1.0, 1 - low * low + 2.0**-50)
    return Enclosure(a_mid, a_rad, a_err), Enclosure(np.zeros_like(sig_up), sig_up, sig_err)


def through_cap(
    ds_up: np.ndarray,
    ds_err: np.ndarray,
    slope: Enclosure,
    cap: float,
    grad: Format,
    rng: Ranges,
) -> tuple[np.ndarray, np.ndarray]:
    """``|dA|`` and ``|dÂ - dA|`` for ``dA = dS·σ`` computed as ``fl(fl(fl(dŜ·ĉ)·σ̂)·r̂)`` in
    the gradient format: ``dŜσ̂ĉr̂ - dSσ = (dŜ - dS)σ̂(1 + ρ) + dS(σ̂ - σ)(1 + ρ) + dSσρ`` with
    ``ĉr̂ = 1 + ρ``, and three roundings."""
    u_g, eta_g = grad.u, grad.smallest_normal
    c_hat, e_c = cap_constant(cap, grad)
    r_hat, e_r = cap_constant(1.0 / cap, grad)
    rho = e_c * r_hat + cap * e_r
    sig_up, sig_err = slope.up, slope.err
    sig_used = sig_up + sig_err
    ds_used = ds_up + ds_err
    carried = (ds_err * sig_used + ds_up * sig_err) * (1 + rho) + ds_up * sig_up * rho
    magnitude = ds_used * c_hat * sig_used * r_hat
    own = compound(powers=((u_g, 3),)) * magnitude + eta_g * (
        sig_used * r_hat * (1 + u_g) ** 2 + r_hat * (1 + u_g) + 1
    )
    for stage, upper in (
        ("dS times the soft-cap", ds_used * c_hat * (1 + u_g) + eta_g),
        ("dS through the soft-cap's tanh", ds_used * c_hat * sig_used * (1 + u_g) ** 2 + 2 * eta_g),
    ):
        rng.check(upper, grad, stage, ("dq", "dk"))
    return ds_up * sig_up, carried + own


def slope_a_priori(capped: CappedLogits, num: Numerics, grad: Format) -> Enclosure:
    """B.9 (b): ``σ = sech²(s/c) <= 1`` and ``σ̂ = fl_G(1 - fl_G(t̂_G²))`` from the capped
    logits' ``tanh`` (``|t̂ - tanh| <= e_τ``, ``|t̂| <= t_used``) read into the gradient format.

    B.7's ``|σ̂ - σ| <= e_g(2τ + e_g) + u_G(τ + e_g)² + u_G(1 + (τ + e_g)²) + 2η_G`` with
    ``τ + e_g`` no more than ``|t̂_G|``'s bound; and, since ``0 <= σ <= 1`` and rounding is
    monotone (``fl(t̂²) >= 0``, so ``σ̂ <= 1``; ``σ̂ >= -m``), ``|σ̂ - σ| <= 1 + m``."""
    fs = num.format_of("score")
    u_g, eta_g = grad.u, grad.smallest_normal
    tau = capped.tau
    read = float(np.max(read_error(np.asarray(capped.t_used), fs, grad)))
    e_g = capped.e_tau + read
    t_g = min(tau + e_g, capped.t_used + read)  # >= |t̂_G|
    square = t_g**2 * (1 + u_g) + eta_g  # >= fl(t̂_G²) >= 0
    lipschitz = e_g * (2 * tau + e_g) + u_g * t_g**2 + eta_g + u_g * (1 + square) + eta_g
    below = max(0.0, square - 1) * (1 + u_g) + eta_g  # σ̂ >= -below
    err = min(lipschitz, 1 + below)
    return Enclosure(np.zeros(()), np.ones(()), np.asarray(err))
