"""Exceptions raised by mhanum."""

from __future__ import annotations

__all__ = ["CertificationError", "InvalidArgument"]


class InvalidArgument(ValueError):
    """An argument has the wrong shape, dtype, value or combination.

    The message names the argument and says what was expected and what was given.
    """


class CertificationError(ArithmeticError):
    """A reference value could not be certified to the requested number of digits."""
