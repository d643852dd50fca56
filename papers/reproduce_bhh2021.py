"""Reproduce §5 of Blanchard, Higham & Higham (2021) and check mhanum's softmax bounds on its data.

Data: ``papers/data/bhh2021/data_presoftmax.mat`` (the authors' ``softmat``, 2500 pre-softmax
vectors of length 10 from an MNIST classifier; BSD licence beside it).

The paper's experiment (``chop_test_softmax.m`` in ``higham/logsumexp-softmax-tests``): round each
vector to fp16, run the basic and the shifted log-sum-exp/softmax with every operation rounded to
fp16 (Higham & Pranesh's ``chop``: round to nearest, subnormals kept, overflow to inf), and compare
with the basic algorithm in the working precision. ``softmat`` is stored in double, so MATLAB ran
every operation in double and then chopped: here every operation is done in float64 and rounded
once to fp16 with :func:`mhanum.round_to`, which is what ``chop`` does. The reference is exact
(mpmath, 100 bits) instead of the paper's double-precision basic algorithm.

Then :func:`mhanum.softmax` (fp16 numerics: naive, safe, online(4); sequential summation) and the
paper's own simulated softmaxes are checked against :func:`mhanum.bounds.softmax.softmax_bound`.

Run: ``python papers/reproduce_bhh2021.py`` (about half a minute).
"""

from __future__ import annotations

import math
import pathlib
import warnings

import jax
import mpmath
import numpy as np
import scipy.io

import mhanum
from mhanum.bounds.softmax import lse_bound, softmax_bound
from mhanum.formats import round_to

jax.config.update("jax_enable_x64", True)

DATA = pathlib.Path(__file__).parent / "data" / "bhh2021" / "data_presoftmax.mat"
U16 = 2.0**-11


def fl(x: object) -> np.ndarray:
    """One rounding to fp16 (chop)."""
    with np.errstate(over="ignore"):
        return round_to(np.asarray(x, dtype=np.float64), "float16")


def basic(x: np.ndarray) -> tuple[float, np.ndarray]:
    """BHH Algorithm 3.1 (lse_chop.m): e_i = exp(x_i), s = Σ e_i sequentially, log s, e_i/s."""
    with np.errstate(over="ignore", invalid="ignore"):
        e = fl(np.exp(x))
        s = 0.0
        for ei in e:
            s = float(fl(s + ei))
        f = float(fl(math.log(s))) if math.isfinite(s) else math.inf
        g = fl(e / s)
    return f, g


def shifted(x: np.ndarray) -> tuple[float, np.ndarray]:
    """BHH Algorithm 4.1 (lse_chopshift.m): a = max, s = Σ_{i≠k} exp(x_i - a), a + log1p(s)."""
    k = int(np.argmax(x))
    a = float(x[k])
    e = fl(np.exp(fl(x - a)))
    e[k] = 1.0
    s = 0.0
    for i, ei in enumerate(e):
        if i != k:
            s = float(fl(s + ei))
    f = float(fl(a + float(fl(math.log1p(s)))))
    g = fl(e / fl(1.0 + s))
    return f, g


def exact(x: np.ndarray, ctx: mpmath.MPContext) -> tuple[float, np.ndarray]:
    """Exact LSE (as ``m + log1p(Σ_{i≠k} e^{x_i - m})``, accurate near 0) and softmax."""
    xs = [ctx.mpf(float(v)) for v in x]
    k = int(np.argmax(x))
    m = xs[k]
    others = ctx.fsum(ctx.exp(v - m) for i, v in enumerate(xs) if i != k)
    lse = m + ctx.log1p(others)
    return float(lse), np.array([float(ctx.exp(v - m) / (1 + others)) for v in xs])


def main() -> None:
    with warnings.catch_warnings():  # the .mat holds a duplicate variable name, not ours
        warnings.simplefilter("ignore", scipy.io.matlab.MatReadWarning)
        softmat = scipy.io.loadmat(DATA, variable_names=["softmat"])["softmat"]
    xs = fl(softmat.T)  # 2500 x 10, each vector chopped to fp16
    n = xs.shape[1]
    ctx = mpmath.MPContext()
    ctx.prec = 100

    lse_b, lse_s, sm_b, sm_s, lse_x, sm_x = [], [], [], [], [], []
    for x in xs:
        fb, gb = basic(x)
        fs, gs = shifted(x)
        fx, gx = exact(x, ctx)
        lse_b.append(fb)
        lse_s.append(fs)
        sm_b.append(gb)
        sm_s.append(gs)
        lse_x.append(fx)
        sm_x.append(gx)
    lse_b_a, lse_s_a, lse_x_a = np.array(lse_b), np.array(lse_s), np.array(lse_x)
    sm_b_a, sm_s_a, sm_x_a = np.array(sm_b), np.array(sm_s), np.array(sm_x)

    overflow_basic = ~np.isfinite(lse_b_a)
    overflow_shift = ~np.isfinite(lse_s_a)
    ok = ~overflow_basic & ~overflow_shift
    err_b = np.abs(lse_b_a[ok] - lse_x_a[ok]) / (U16 * np.abs(lse_x_a[ok]))
    err_s = np.abs(lse_s_a[ok] - lse_x_a[ok]) / (U16 * np.abs(lse_x_a[ok]))
    identical = int(np.sum(lse_b_a[ok] == lse_s_a[ok]))
    ratio = err_b / err_s
    finite_ratio = ratio[np.isfinite(ratio)]
    stderr = float(np.std(finite_ratio, ddof=1) / math.sqrt(finite_ratio.size))

    # first-order bounds of BHH (leading terms, units of u), as in chop_test_softmax.m
    x_ok = xs[ok]
    bnd_lse_b = 1 + (n + 1) / np.abs(lse_x_a[ok])
    bnd_lse_s = np.abs(lse_x_a[ok] + n - x_ok.min(axis=1)) / np.abs(lse_x_a[ok])
    nw_b = np.max(np.abs(sm_b_a[ok] - sm_x_a[ok]), axis=1) / (U16 * sm_x_a[ok].max(axis=1))
    nw_s = np.max(np.abs(sm_s_a[ok] - sm_x_a[ok]), axis=1) / (U16 * sm_x_a[ok].max(axis=1))
    bnd_sm_s = n + 2 + 2 * (x_ok.max(axis=1) - x_ok.min(axis=1))

    print("Blanchard, Higham & Higham (2021), §5, fp16 (u = 2^-11); 2500 vectors of length 10")
    print(f"{'quantity':58s} {'paper':>10s} {'here':>12s}")
    rows = [
        ("overflows, basic log-sum-exp", "475", f"{int(overflow_basic.sum())}"),
        ("overflows, shifted log-sum-exp", "0", f"{int(overflow_shift.sum())}"),
        ("vectors compared (no overflow)", "2025", f"{int(ok.sum())}"),
        ("identical basic and shifted LSE errors", "1863", f"{identical}"),
        ("basic/shifted LSE error ratio, min", "0.19", f"{finite_ratio.min():.3g}"),
        ("basic/shifted LSE error ratio, max", "59", f"{finite_ratio.max():.3g}"),
        ("basic/shifted LSE error ratio, mean", "1.07", f"{finite_ratio.mean():.3g}"),
        ("basic/shifted LSE error ratio, standard error", "0.03", f"{stderr:.2g}"),
        ("ratios with a zero shifted error (left out above)", "-", f"{int(np.sum(~np.isfinite(ratio)))}"),
        ("basic LSE error > first-order bound 1+(n+1)/|y| (units u)", "0", f"{int(np.sum(err_b > bnd_lse_b))}"),
        ("shifted LSE error > first-order bound |y+n-xmin|/|y|", "0", f"{int(np.sum(err_s > bnd_lse_s))}"),
        ("basic softmax normwise error > n+3", "0", f"{int(np.sum(nw_b > n + 3))}"),
        ("shifted softmax normwise error > n+2+2(xmax-xmin)", "0", f"{int(np.sum(nw_s > bnd_sm_s))}"),
    ]  # fmt: skip
    for name, paper, here in rows:
        print(f"{name:58s} {paper:>10s} {here:>12s}")

    print()
    print(
        "mhanum's rigorous componentwise bounds (papers/softmax.md), fp16, exp_ulps=2, div_ulps=1/2"
    )
    print(
        f"{'computation':44s} {'rows':>5s} {'inf bound':>9s} {'violations':>10s} {'max err/bnd':>11s}"
    )
    checks: list[tuple[str, np.ndarray, str]] = []
    for alg in ("naive", "safe", "online(4)"):
        num = mhanum.Numerics(input="float16", accum="float16", softmax=alg, summation="sequential")
        got = np.asarray(mhanum.softmax(xs, numerics=num), dtype=np.float64)
        checks.append((f"mhanum.softmax, {alg}", got, alg))
    checks.append(("BHH basic softmax (simulated above)", sm_b_a, "naive"))
    checks.append(("BHH shifted softmax (simulated above)", sm_s_a, "safe"))
    total_violations = 0
    for name, got, alg in checks:
        num = mhanum.Numerics(input="float16", accum="float16", softmax=alg, summation="sequential")
        bound = softmax_bound(xs, num).total
        finite = np.isfinite(bound).all(axis=1)
        err = np.abs(got[finite] - sm_x_a[finite])
        with np.errstate(divide="ignore", invalid="ignore"):
            r = np.where(bound[finite] > 0, err / bound[finite], 0.0)
        violations = int(np.sum(err > bound[finite]))
        total_violations += violations
        print(
            f"{name:44s} {int(finite.sum()):5d} {int((~finite).sum()):9d} {violations:10d} "
            f"{float(r.max()):11.3f}"
        )
    # log-sum-exp: chop(log(.)) of a double log is within 1/2 ulp + 2^-52 relative: log_ulps = 1
    num = mhanum.Numerics(input="float16", accum="float16", summation="sequential")
    for name, got, alg in (
        ("BHH basic log-sum-exp (simulated above)", lse_b_a, "basic"),
        ("BHH shifted log-sum-exp (simulated above)", lse_s_a, "shifted"),
    ):
        bound = lse_bound(xs, num, algorithm=alg, log_ulps=1).total
        finite = np.isfinite(bound)
        err = np.abs(got[finite] - lse_x_a[finite])
        violations = int(np.sum(err > bound[finite]))
        total_violations += violations
        print(
            f"{name:44s} {int(finite.sum()):5d} {int((~finite).sum()):9d} {violations:10d} "
            f"{float(np.max(err / bound[finite])):11.3f}"
        )
    print(f"total violations: {total_violations} (must be 0)")
    if total_violations:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
