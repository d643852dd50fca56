"""How every ``mhanum`` command spells and explains its options.

One spelling per idea: ``-o/--out PATH`` is where a command writes its output (a file or a
directory), ``--json`` prints the result as JSON on standard output, ``--heads N`` is the number
of attention heads, ``--force`` overwrites an existing ``--out``. The names an option takes are
listed in its help from the library's own tables, and an option's bad value is refused in one
line that names the option as typed.
"""

from __future__ import annotations

import argparse
import re
import textwrap
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NoReturn

from mhanum._errors import InvalidArgument

__all__ = [
    "Formatter",
    "Parser",
    "Spellings",
    "accum_formats",
    "add_executor_arguments",
    "add_json",
    "add_out",
    "examples",
    "formats",
    "named",
    "one_of",
    "option_names",
    "softmax_algorithms",
    "summation_orders",
]

# "-1e9" and "-inf" are values (padding constants, sink logits), not options
_NEGATIVE_NUMBER = re.compile(r"^-(?:inf$|\.?\d)")


class Formatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions and examples keep their lines; an option's help wraps at spaces only, so a
    name such as ``bf16-fp32acc`` or ``blocked(N)`` is never split across lines."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(
            " ".join(text.split()), width, break_on_hyphens=False, break_long_words=False
        )


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors take one line and name the option as the help spells it
    (``mhanum search: --preset: invalid choice: 'fp12' (choose from ...)``), exit status 2."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", Formatter)
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = _NEGATIVE_NUMBER

    def error(self, message: str) -> NoReturn:
        message = re.sub(r"^argument ([^:]+): ", r"\1: ", message)
        self.exit(2, f"{self.prog}: {message}\n")


class Spellings:
    """The choices of an option whose values the library parses: iterated, the spellings the
    help lists (``blocked(N)`` for a family); ``in``, whether the library's parser accepts a value
    (``blocked(8)``, ``bf16``), so that argparse refuses the others naming the option."""

    def __init__(self, names: Iterable[str], parse: Callable[[str], object]) -> None:
        self.names = tuple(names)
        self.parse = parse

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __contains__(self, value: object) -> bool:
        try:
            self.parse(str(value))
        except InvalidArgument:
            return False
        return True


def _kinds(base: Any, classes: Any = None) -> tuple[str, ...]:
    """The spellings of the subclasses of a unit of :mod:`mhanum.units` (or of ``classes``):
    ``kahan``, or ``blocked(N)`` for one that takes a number."""
    found = base.__subclasses__() if classes is None else classes
    return tuple(f"{c.kind}(N)" if c.__match_args__ else c.kind for c in found)


def summation_orders() -> Spellings:
    """``--summation``: the registered summation orders (:func:`mhanum.units.summation_orders`)."""
    from mhanum import units

    return Spellings(_kinds(units.SummationOrder, units.summation_orders()), units.summation_order)


def softmax_algorithms() -> Spellings:
    """``--softmax``: :class:`mhanum.units.SoftmaxAlgorithm`'s kinds."""
    from mhanum import units

    return Spellings(_kinds(units.SoftmaxAlgorithm), units.softmax_algorithm)


def formats() -> Spellings:
    """``--input``: :data:`mhanum.formats.FORMATS`, by name or alias (``bf16``)."""
    from mhanum.formats import FORMATS, get_format

    return Spellings(FORMATS, get_format)


def accum_formats() -> Spellings:
    """``--accum``: :data:`mhanum.units.ACCUM_FORMATS`, by name or alias."""
    from mhanum.formats import get_format
    from mhanum.units import ACCUM_FORMATS

    def parse(text: str) -> object:
        name = get_format(text).name
        if name not in ACCUM_FORMATS:
            msg = f"expected one of {ACCUM_FORMATS}, got {text!r}"
            raise InvalidArgument(msg)
        return name

    return Spellings(ACCUM_FORMATS, parse)


def one_of(names: Iterable[str]) -> str:
    """``"one of: a, b, c"``, for an option's help."""
    return "one of: " + ", ".join(names)


def examples(*lines: str) -> str:
    """A command's help epilog: example command lines (each may end with ``# what it does``)."""
    return "examples:\n" + "\n".join(f"  {line}" for line in lines)


def add_out(parser: argparse.ArgumentParser, what: str, **kwargs: Any) -> None:
    """``-o/--out``: where the command writes ``what``."""
    parser.add_argument("-o", "--out", help=what, **kwargs)


def add_json(parser: argparse.ArgumentParser, what: str) -> None:
    """``--json``: a flag, ``what`` printed as JSON on standard output instead of the text."""
    parser.add_argument(
        "--json", action="store_true", help=f"print {what} as JSON on standard output"
    )


def option_names(parser: argparse.ArgumentParser, argv: Sequence[str]) -> dict[str, str]:
    """Each option's destination, spelled as the command line typed it (``-o`` or ``--out``),
    else as its help shows it (its longest spelling), to name it in an error message."""
    names: dict[str, str] = {}
    for action in parser._actions:
        typed = [
            s for s in action.option_strings if any(a == s or a.startswith(f"{s}=") for a in argv)
        ]
        if typed:
            names[action.dest] = typed[-1]
        elif action.option_strings and action.help != argparse.SUPPRESS:
            names.setdefault(action.dest, max(action.option_strings, key=len))
    return names


def named(message: str, names: Mapping[str, str]) -> str:
    """``message`` with a leading argument name, as the library says it (``"layers: ..."``, or
    ``"shape.q_len: ..."`` for a size of a search's shape), replaced by the option that gave it
    (``"--layers: ..."``, ``"--q-len: ..."``)."""
    head, sep, rest = message.partition(": ")
    name = head.removeprefix("shape.")
    return f"{names[name]}{sep}{rest}" if sep and name in names else message


def add_executor_arguments(parser: argparse.ArgumentParser, what: str) -> None:
    """``--workers``, ``--scheduler`` and ``--journal`` (:func:`mhanum.parallel.executor_for`)."""
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        metavar="N",
        help=f"run the {what} in N spawned processes (default: in this process)",
    )
    parser.add_argument(
        "--scheduler",
        nargs="?",
        const="local",
        default=None,
        metavar="ADDRESS",
        help="run them on Dask: a scheduler address (tcp://host:8786), or without one a "
        "LocalCluster of --workers processes (pip install 'mhanum[dask]')",
    )
    parser.add_argument(
        "--journal",
        default=None,
        metavar="FILE",
        help="JSON Lines file of finished tasks: a rerun skips them (append-only)",
    )
