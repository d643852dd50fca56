"""mhanum.units' registry of summation orders: an order registered at run time, with no edit to
the library, parses, runs, is bounded and goes away; and what adding one to the library edits."""

from __future__ import annotations

import ast
import gc
import math
import pathlib
import re
import weakref
from fractions import Fraction

import jax
import numpy as np
import pytest
from hypothesis import find, given, settings
from hypothesis import strategies as st

import mhanum as mn
from mhanum import InvalidArgument, Numerics, reference, round_to, units
from mhanum.bounds import attention_bound
from mhanum.bounds.summation import dot_bound, sum_bound, tree_height
from mhanum.emulate import summation
from mhanum.strategies import numerics as numerics_strategy

ROOT = pathlib.Path(__file__).resolve().parents[1]
E = 2.0**-24  # half an ulp of 1 in float32


def _reverse_class() -> type[units.SummationOrder]:
    class Reverse(units.SummationOrder):
        """Right to left, ``((t_{n-1} + t_{n-2}) + ...) + t_0``: a tree of height ``n - 1``."""

        __slots__ = ()
        kind = "reverse"

        def __new__(cls):
            return super().__new__(cls, "reverse")

        def height(self, n):
            return n - 1

        def emulate(self, terms):
            return terms.fold(terms.ar.add, terms.start(), reverse=True)

    return Reverse


@pytest.fixture(scope="module")
def reverse():
    """The order registered for the tests of this module; afterwards unregistered, and the class
    gone (the tests read it from the registry, so that only the registry holds it)."""
    units.register_summation_order(_reverse_class())
    yield
    order = type(units.summation_order("reverse"))
    units.unregister_summation_order("reverse")
    assert order not in units.summation_orders()
    with pytest.raises(InvalidArgument, match=r"^summation: expected 'native'"):
        units.summation_order("reverse")
    alive = weakref.ref(order)
    del order
    jax.clear_caches()  # compiled attention holds its Numerics, and so the class
    gc.collect()
    # gone from SummationOrder.__subclasses__() too, which the command line lists
    assert alive() is None


# Parsing -------------------------------------------------------------------------------------


def test_it_parses_from_a_numerics_spelling(reverse):
    unit = units.summation_order(" Reverse ")
    assert unit == "reverse"
    assert type(unit).__name__ == "Reverse"
    assert units.summation_order(unit) is unit
    num = Numerics(input="bfloat16", summation="reverse")
    assert num.summation == "reverse"
    assert type(num.order) is type(unit)
    assert Numerics.from_dict(num.to_dict()) == num
    assert (unit.tree, unit.compensated, unit.carried, unit.resumable) == (
        True,
        False,
        False,
        False,
    )
    assert unit.roundings(10) == 9
    with pytest.raises(InvalidArgument, match=r"or 'reverse', b >= 1, got 'reversed'"):
        Numerics(summation="reversed")


def test_registration_refuses_a_taken_kind_and_an_incomplete_class(reverse):
    with pytest.raises(InvalidArgument, match=r"^order.kind: expected a lower-case name"):
        units.register_summation_order(_reverse_class())

    class Unnamed(units.SummationOrder):
        __slots__ = ()

    class NoEmulation(units.SummationOrder):
        __slots__ = ()
        kind = "no-emulation"

        def height(self, n):
            return n - 1

    with pytest.raises(InvalidArgument, match=r"^order.kind: expected"):
        units.register_summation_order(Unnamed)
    with pytest.raises(InvalidArgument, match=r"^order: expected a class that defines emulate"):
        units.register_summation_order(NoEmulation)
    with pytest.raises(InvalidArgument, match=r"^order: expected a subclass of SummationOrder"):
        units.register_summation_order(str)
    with pytest.raises(InvalidArgument, match=r"^kind: expected a registered order other than"):
        units.unregister_summation_order("kahan")


# Emulation -----------------------------------------------------------------------------------


def _exact_sum(a: float, b: float) -> float:
    """``a + b`` in float64, checked exact (the reference then rounds once into the format)."""
    s = a + b
    assert Fraction(s) == Fraction(a) + Fraction(b)
    return s


def _reverse_model(terms: list[float], fmt: str) -> float:
    """Right to left, each addition rounded to nearest (even) in ``fmt``: the order by hand."""
    s = 0.0
    for t in reversed(terms):
        s = float(round_to(_exact_sum(s, t), fmt))
    return s


def test_it_sums_integers_exactly_and_in_its_own_order(reverse):
    rng = np.random.default_rng(0)
    ints = rng.integers(-(2**10), 2**10, size=(4, 37))  # every partial sum below 2^16: exact
    got = summation.sum(ints.astype(np.float32), order="reverse", accum="float32")
    np.testing.assert_array_equal(np.asarray(got), ints.sum(axis=-1))
    small = rng.integers(-3, 4, size=(3, 9))  # |partial sums| <= 27 < 2^8: exact in bfloat16
    got = summation.sum(small.astype(np.float32), order="reverse", accum="bfloat16")
    np.testing.assert_array_equal(np.asarray(got), small.sum(axis=-1))
    # 1 then four halves of an ulp: left to right each ties back to 1; right to left they add
    # up to 2^-22 first, and 1 + 2^-22 is a float32
    x = np.array([1.0] + [E] * 4, np.float32)
    assert float(summation.sum(x, order="sequential")) == 1.0
    assert float(summation.sum(x, order="reverse")) == 1 + 4 * E


@settings(max_examples=25, deadline=None)
@given(
    fmt=st.sampled_from(["float32", "bfloat16"]),
    n=st.sampled_from([1, 2, 3, 8, 13, 33]),
    seed=st.integers(0, 2**32 - 1),
)
def test_it_matches_the_order_by_hand_bit_for_bit(reverse, fmt, n, seed):
    rng = np.random.default_rng(seed)
    scale = 2.0 ** rng.integers(-8, 9, size=n)
    terms = round_to(rng.standard_normal(n) * scale, fmt)
    got = float(summation.sum(terms.astype(np.float32), order="reverse", accum=fmt))
    want = _reverse_model([float(t) for t in terms], fmt)
    assert np.float64(got).tobytes() == np.float64(want).tobytes(), (got, want)
    # a dot: each product rounded into the format, then summed right to left
    a, b = (round_to(rng.standard_normal(n), fmt) for _ in range(2))
    dot = summation.matmul(a[None, :], b[:, None], order="reverse", accum=fmt)
    products = [float(round_to(float(x) * float(y), fmt)) for x, y in zip(a, b, strict=True)]
    want = _reverse_model(products, fmt)
    assert np.float64(dot[0, 0]).tobytes() == np.float64(want).tobytes()


def test_a_carried_value_is_refused_by_name(reverse):
    a = np.ones((2, 3), np.float32)
    ar = summation.Arith(mn.get_format("float32"), summation.runtime_zero(a))
    with pytest.raises(InvalidArgument, match=r"^init: expected an order that resumes a sum"):
        summation.matmul_with(ar, a, a.T, "reverse", init=np.zeros((2, 2), np.float32))


# Bounds --------------------------------------------------------------------------------------


def _exact_dot(x: np.ndarray, y: np.ndarray) -> Fraction:
    return sum((Fraction(float(a)) * Fraction(float(b)) for a, b in zip(x, y, strict=True)),
               Fraction(0))  # fmt: skip


@settings(max_examples=25, deadline=None)
@given(
    fmt=st.sampled_from(["float32", "bfloat16", "float16"]),
    n=st.sampled_from([2, 7, 16, 40]),
    seed=st.integers(0, 2**32 - 1),
)
def test_the_dot_bound_holds_on_random_inputs(reverse, fmt, n, seed):
    rng = np.random.default_rng(seed)
    x, y = rng.standard_normal(n), rng.standard_normal(n)  # not values of fmt: rounded first
    out = float(summation.matmul(x[None, :], y[:, None], order="reverse", accum=fmt)[0, 0])
    err = abs(Fraction(out) - _exact_dot(x, y))
    bound = dot_bound(x, y, "reverse", fmt)
    assert err <= Fraction(float(bound.total))
    # what the bound reads of an order is its fields: those of sequential, here
    assert float(bound.total) == float(dot_bound(x, y, "sequential", fmt).total)


@pytest.mark.parametrize("k", [7, 100, 1000])
def test_the_sum_bound_holds_and_is_nearly_attained_on_the_adversarial_input(reverse, k):
    # right to left, 1 comes first and absorbs each of the k halves of an ulp that follow it:
    # the error is k·2^-24, the bound γ_k·(1 + k·2^-24) (Theorem R.3, height k), a ratio of
    # (1 - k·2^-24)/(1 + k·2^-24)
    x = np.array([E] * k + [1.0], np.float32)
    out = float(summation.sum(x, order="reverse", accum="float32"))
    assert out == 1.0
    assert tree_height(k + 1, "reverse") == k
    bound = float(sum_bound(x, "reverse", "float32").total)
    err = k * E
    assert err <= bound
    u = 2.0**-24
    assert err / bound >= (1 - k * u) / (1 + k * u) * (1 - 2.0**-30)
    # a dot with ones: the same sum, products exact
    d = float(dot_bound(x, np.ones_like(x), "reverse", "float32").total)
    out = float(
        summation.matmul(x[None, :], np.ones((k + 1, 1), np.float32), order="reverse")[0, 0]
    )
    assert out == 1.0
    assert err <= d


@settings(max_examples=6, deadline=None)
@given(
    preset=st.sampled_from(["fp32", "bf16-fp32acc", "fp16"]),
    softmax=st.sampled_from(["safe", "online(4)"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_the_attention_bound_holds_on_random_inputs(reverse, preset, softmax, seed):
    num = Numerics.preset(preset).replace(summation="reverse", softmax=softmax)
    rng = np.random.default_rng(seed)
    q, k, v = (
        rng.standard_normal((5, 16)),
        rng.standard_normal((11, 16)),
        rng.standard_normal((11, 4)),
    )
    bound = attention_bound(q, k, v, numerics=num)
    out = np.asarray(mn.attention(q, k, v, numerics=num), np.float64)
    err = np.abs(out - reference.attention(q, k, v))
    assert np.all(err <= bound.total), f"{np.max(err / bound.total):.3g}"
    same_fields = attention_bound(q, k, v, numerics=num.replace(summation="sequential"))
    np.testing.assert_array_equal(bound.total, same_fields.total)


def test_the_attention_bound_holds_on_adversarial_inputs(reverse):
    # one large logit on the last key and 63 small ones before it: right to left, P·V meets the
    # large product (about 1) first, and every later product (about e^-9·2^-12 < 2^-25) is
    # below half an ulp of the running sum and absorbed, the worst case of a sequential sum
    for preset in ("fp32", "bf16-fp32acc"):
        _attention_bound_holds_on_one_large_key_last(preset)


def _attention_bound_holds_on_one_large_key_last(preset: str) -> None:
    num = Numerics.preset(preset).replace(summation="reverse", softmax="safe")
    n, d = 64, 16
    q = np.zeros((2, d))
    q[:, 0] = 8.0
    k = np.zeros((n, d))
    k[-1, 0] = 4.0
    k[:-1, 0] = -0.5
    v = np.ones((n, 3))
    v[:-1] = 2.0**-12
    bound = attention_bound(q, k, v, numerics=num)
    out = np.asarray(mn.attention(q, k, v, numerics=num), np.float64)
    err = np.abs(out - reference.attention(q, k, v))
    assert np.all(np.isfinite(bound.total))
    assert np.all(err <= bound.total)


def test_the_strategies_draw_it_and_keep_it_from_what_it_cannot_resume(reverse):
    drawn = find(
        numerics_strategy(presets=False, free=False, custom=True),
        lambda n: n.summation == "reverse",
    )
    assert type(drawn.order).__name__ == "Reverse"
    running = numerics_strategy(
        presets=False, free=False, custom=True, summation="reverse", online_sums="running"
    )
    num = find(running, lambda n: True)
    assert num.order.resumable
    assert num.online_sums == "running"


# What adding an order edits ------------------------------------------------------------------


def _branches_on_an_order(path: pathlib.Path) -> list[str]:
    """The places of a module that test an order by its name: a comparison with a built-in
    order's spelling (or a tuple of them), ``startswith`` one, or ``isinstance`` with one of
    their classes. A new order would have to be added to each."""
    kinds = {order.kind for order in units.summation_orders()}
    classes = {order.__name__ for order in units.summation_orders()}

    def spelled(node: ast.AST) -> bool:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value.split("(")[0] in kinds
        return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(map(spelled, node.elts))

    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        hit = isinstance(node, ast.Compare) and any(map(spelled, [node.left, *node.comparators]))
        if isinstance(node, ast.Call):
            f = node.func
            named = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
            hit = (isinstance(f, ast.Name) and f.id == "isinstance" and bool(named & classes)) or (
                isinstance(f, ast.Attribute)
                and f.attr in ("startswith", "endswith")
                and any(map(spelled, node.args))
            )
        if hit:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    return found


def _docstring_modules(text: str) -> list[str]:
    return re.findall(r":mod:`~?(mhanum(?:\.\w+)+)`", text)


def test_adding_an_order_edits_the_three_files_the_units_docstring_names():
    doc = units.__doc__
    assert doc is not None
    claim = doc[doc.index("Adding an order therefore touches at most three files") :]
    claim = claim[: claim.index("\n\n")]
    named = ["mhanum/units/__init__.py", "mhanum/emulate/summation.py", "papers/summation.md"]
    assert "this module" in claim
    assert _docstring_modules(claim)[0] == "mhanum.emulate.summation"
    assert "``papers/summation.md``" in claim
    assert all((ROOT / f).is_file() for f in named)
    sites = [s for p in sorted((ROOT / "mhanum").rglob("*.py")) for s in _branches_on_an_order(p)]
    outside = sorted({s.split(":")[0] for s in sites} - set(named))
    # the modules that still name an order where its nature is special, as the docstring says
    start = claim.find("also touches the modules that name")
    rest = "" if start < 0 else claim[start:]
    listed = sorted(m.replace(".", "/") + ".py" for m in _docstring_modules(rest))
    assert outside == listed, "\n".join(sites)
    # none of them names a tree order that is neither chosen by the backend nor resumable: a
    # tree order (Theorem R.3 for its height) edits the three files alone
    plain = {o.kind for o in units.summation_orders() if o.examples() and not (
        o.examples()[0].compensated or o.examples()[0].resumable)}  # fmt: skip
    assert {"pairwise", "blocked"} <= plain
    assert not [s for s in sites if any(f"'{kind}" in s for kind in plain)], sites


def test_every_order_has_what_its_bound_needs():
    for order in units.summation_orders():
        for unit in order.examples():
            assert unit.tree != unit.compensated
            if unit.tree:
                assert [unit.height(n) for n in (1, 2)] == [0, 1]
                assert all(unit.height(n) <= n - 1 for n in (3, 8, 100))
            assert unit.roundings(5) == (20 if unit.compensated else 4)
    assert math.isfinite(float(sum_bound([1.0, 2.0], "kahan").total))
