"""A fixed corpus of bound values: a change of the bound engine may make a bound smaller, never
larger.

``tests/data/bound_corpus.npz`` holds the totals of the forward and backward bounds on fixed
inputs (numpy's PCG64, the same bits everywhere), for several presets, masks, sinks, soft-caps
and biases. Rebuilding the engine (stages, a jitted evaluation) must keep every bound sound (the
soundness tests) and equal or smaller than these. The float64 evaluation itself may round
differently on another machine (BLAS kernels sum in other orders), by a few units of 2^-53 of
each term: the comparison allows ``2^-40`` relative, far below any change of a bound's
derivation.

Regenerate (only when a bound is made tighter on purpose, with its derivation in ``papers/``)::

    python tests/bounds/test_corpus.py
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import mhanum as mn
from mhanum import masks

CORPUS = pathlib.Path(__file__).parents[1] / "data" / "bound_corpus.npz"
SLACK = 2.0**-40


def _inputs() -> dict[str, Any]:
    rng = np.random.default_rng(20261128)
    return {
        "q": rng.standard_normal((2, 4, 8)) * 3.0,
        "k": rng.standard_normal((2, 6, 8)),
        "v": rng.standard_normal((2, 6, 5)),
        "g": rng.standard_normal((2, 4, 5)),
        "bias": rng.standard_normal((2, 4, 6)),
        "x": rng.standard_normal((4, 8)),
        "g_mha": rng.standard_normal((4, 8)),
        "params": mn.MHAParams.random(8, seed=7),
    }


def _cases() -> dict[str, Callable[[dict[str, Any]], Any]]:
    band = masks.causal(2)
    cases: dict[str, Callable[[dict[str, Any]], Any]] = {}
    for preset in ("fp32", "tf32", "bf16-fp32acc", "fp16-fp32acc", "fp16"):
        cases[f"attention_bound/{preset}/causal"] = lambda x, p=preset: (
            mn.bounds.attention_bound(x["q"], x["k"], x["v"], band, numerics=p).total
        )
    cases["attention_bound/bf16-fp32acc/sink+softcap+bias"] = lambda x: (
        mn.bounds.attention_bound(
            x["q"], x["k"], x["v"], bias=x["bias"], sink=np.array([0.5, -1.0]), softcap=5.0,
            numerics="bf16-fp32acc",
        ).total
    )  # fmt: skip
    cases["attention_bound/fp32/p=0.99"] = lambda x: (
        mn.bounds.attention_bound(
            x["q"], x["k"], x["v"], band, numerics="fp32", probability=0.99
        ).total
    )
    cases["mha_bound/bf16-fp32acc"] = lambda x: (
        mn.bounds.mha_bound(
            x["x"], x["x"], x["params"], 2, mask=masks.causal(), numerics="bf16-fp32acc"
        ).total
    )
    for algorithm in ("textbook", "flash2"):
        for preset in ("fp32", "bf16-fp32acc"):
            name = f"attention_grad_bound/{preset}/{algorithm}"
            cases[name] = lambda x, p=preset, a=algorithm: _gradients(
                mn.bounds.attention_grad_bound(
                    x["q"], x["k"], x["v"], x["g"], band, numerics=p,
                    backward=mn.Backward(a, block_q=2, block_k=2) if a == "flash2" else a,
                )
            )  # fmt: skip
    cases["mha_grad_bound/fp32"] = lambda x: np.concatenate(
        [
            np.ravel(b.total)
            for b in mn.bounds.mha_grad_bound(
                x["x"], x["x"], x["params"], 2, x["g_mha"], mask=masks.causal(), numerics="fp32"
            )[:2]
        ]
    )
    cases["schedule_difference/fp32-bf16"] = lambda x: (
        mn.bounds.schedule_difference(
            x["q"], x["k"], x["v"], band, numerics_a="fp32", numerics_b="bf16-fp32acc"
        ).total
    )
    return cases


def _gradients(bounds: Any) -> np.ndarray:
    return np.concatenate([np.ravel(b.total) for b in (bounds.dq, bounds.dk, bounds.dv)])


CASES = _cases()


def _stored() -> Any:
    if not CORPUS.exists():
        pytest.fail(f"{CORPUS}: missing; regenerate it with python {__file__}")
    return np.load(CORPUS)


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_bound_is_at_most_its_corpus_value(name: str) -> None:
    stored = _stored()
    assert name in stored.files, f"{name}: not in the corpus; regenerate it"
    now = np.asarray(CASES[name](_inputs()), np.float64)
    before = stored[name]
    assert now.shape == before.shape
    assert np.isfinite(before).all()  # the corpus bounds something everywhere
    assert (now <= before * (1 + SLACK)).all(), float(np.max(now / before))


def test_the_corpus_holds_every_case_and_no_other() -> None:
    assert sorted(_stored().files) == sorted(CASES)


if __name__ == "__main__":
    import jax

    jax.config.update("jax_enable_x64", True)
    values = {name: np.asarray(case(_inputs()), np.float64) for name, case in CASES.items()}
    CORPUS.parent.mkdir(exist_ok=True)
    np.savez_compressed(CORPUS, **values)  # type: ignore[arg-type]
    print(f"{CORPUS}: {len(values)} cases")
