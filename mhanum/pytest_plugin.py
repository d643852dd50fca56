"""The pytest plugin of :mod:`mhanum.testing` (registered through the ``pytest11`` entry point).

It adds the marker ``mhanum_kernel(name)`` and the fixtures ``attention_oracle`` (outputs) and
``attention_grad_oracle`` (gradients: the name is then a backward descriptor of
``mhanum.testing.BACKWARD_KERNELS``), so that a kernel author writes one property test::

    import pytest
    from hypothesis import given
    from mhanum.testing import attention_inputs

    @pytest.mark.mhanum_kernel("torch-sdpa-math")
    @given(case=attention_inputs(dtype="bfloat16"))
    def test_my_kernel(attention_oracle, case):
        out = my_kernel(case["q"], case["k"], case["v"], case["mask"])
        attention_oracle.assert_close(out, case["q"], case["k"], case["v"], mask=case["mask"])

and, for a backward pass, ``attention_grad_oracle.assert_close(grads, q, k, v, d_out, ...)``.
The ``attention_oracle`` fixture's methods take their functions' keywords, ``confidence=``
included: the probabilistic tolerance of Theorem A.3 in place of the certified one
(:func:`mhanum.testing.attention_oracle`), and the decoder stages' ``rope=``, ``positions=``
and ``kv_cache=``: a kernel that rotates q and k itself, or attends k and v read back from a
quantized cache, checked against the exact attention of the exactly rotated, unquantized inputs.
Loading the plugin imports nothing of mhanum (nor JAX): a fixture imports it when a test asks
for it.
"""

from __future__ import annotations

from typing import Any

import pytest

__all__ = ["GradKernelOracle", "KernelOracle", "attention_grad_oracle", "attention_oracle"]

_MARKER = "mhanum_kernel"
_CURRENT: dict[str, Any] = {"kernel": None}  # the running test's marker (one test at a time)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{_MARKER}(name): the mhanum kernel descriptor (mhanum.testing.KERNELS) that the "
        "attention_oracle fixture checks outputs against, or the backward descriptor "
        "(mhanum.testing.BACKWARD_KERNELS) that the attention_grad_oracle fixture checks "
        "gradients against",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    marker = item.get_closest_marker(_MARKER)
    _CURRENT["kernel"] = marker.args[0] if marker is not None and marker.args else None


class _KernelBound:
    """A kernel name bound to a fixture's value: ``kernel``, or else the running test's
    ``mhanum_kernel`` marker."""

    def __init__(self, kernel: Any = None) -> None:
        self.kernel = kernel

    def _kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        if "kernel" not in kwargs:
            kernel = self.kernel if self.kernel is not None else _CURRENT["kernel"]
            if kernel is None:
                msg = (
                    "kernel: expected @pytest.mark.mhanum_kernel(name) on the test or a "
                    "kernel= argument, got neither"
                )
                raise TypeError(msg)
            kwargs["kernel"] = kernel
        return kwargs


class KernelOracle(_KernelBound):
    """The fixture's value: :mod:`mhanum.testing`'s functions bound to one kernel descriptor
    (``kernel``, or else the running test's ``mhanum_kernel`` marker). Each method takes its
    function's keywords, ``confidence=`` (the probabilistic tolerance) and the decoder stages'
    ``rope=``, ``positions=`` and ``kv_cache=`` among them."""

    def oracle(self, q: Any, k: Any, v: Any, **kwargs: Any) -> Any:
        """:func:`mhanum.testing.attention_oracle` with this kernel."""
        from mhanum import testing

        return testing.attention_oracle(q, k, v, **self._kwargs(kwargs))

    def tolerance(self, q: Any, k: Any, v: Any, **kwargs: Any) -> Any:
        """:func:`mhanum.testing.attention_tolerance` with this kernel."""
        from mhanum import testing

        return testing.attention_tolerance(q, k, v, **self._kwargs(kwargs))

    def assert_close(self, actual: Any, q: Any, k: Any, v: Any, **kwargs: Any) -> None:
        """:func:`mhanum.testing.assert_attention_close` with this kernel."""
        __tracebackhide__ = True
        self.oracle(q, k, v, **kwargs).assert_close(actual)

    def assert_mha_close(
        self, actual: Any, x_q: Any, x_kv: Any, params: Any, num_heads: int, **kwargs: Any
    ) -> None:
        """:func:`mhanum.testing.assert_mha_close` with this kernel."""
        __tracebackhide__ = True
        from mhanum import testing

        testing.assert_mha_close(actual, x_q, x_kv, params, num_heads, **self._kwargs(kwargs))


class GradKernelOracle(_KernelBound):
    """The gradient fixture's value: :mod:`mhanum.testing`'s gradient functions bound to one
    backward descriptor (``kernel``, or else the running test's ``mhanum_kernel`` marker)."""

    def oracle(self, q: Any, k: Any, v: Any, d_out: Any, **kwargs: Any) -> Any:
        """:func:`mhanum.testing.attention_grad_oracle` with this kernel."""
        from mhanum import testing

        return testing.attention_grad_oracle(q, k, v, d_out, **self._kwargs(kwargs))

    def tolerance(self, q: Any, k: Any, v: Any, d_out: Any, **kwargs: Any) -> Any:
        """:func:`mhanum.testing.attention_grad_tolerance` with this kernel."""
        return self.oracle(q, k, v, d_out, **kwargs).tolerance

    def assert_close(self, grads: Any, q: Any, k: Any, v: Any, d_out: Any, **kwargs: Any) -> None:
        """:func:`mhanum.testing.assert_attention_grad_close` with this kernel."""
        __tracebackhide__ = True
        self.oracle(q, k, v, d_out, **kwargs).assert_close(grads)


@pytest.fixture(scope="session")
def attention_grad_oracle() -> GradKernelOracle:
    """Certified gradient tolerances for the backward descriptor named by the running test's
    ``mhanum_kernel`` marker (session-scoped, as ``attention_oracle``)."""
    return GradKernelOracle()


@pytest.fixture(scope="session")
def attention_oracle() -> KernelOracle:
    """Certified tolerances for the kernel named by the running test's ``mhanum_kernel`` marker.

    Session-scoped (it holds no state), so Hypothesis's ``@given`` tests take it as it is.
    """
    return KernelOracle()
