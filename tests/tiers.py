r"""The test tiers, by measured time: tests/slow.txt lists the tests that run in the full run only.

Regenerate it from a timed run of the fast tier with an empty compilation cache
(``--durations=0`` prints every test's setup, call and teardown times; a test whose phases together
take at least ``THRESHOLD`` seconds moves to the slow tier). The cache must be empty: XLA's
compilations are most of a cold run's time (91% of two test files' 273 s, measured with
``jax.monitoring``'s compile durations), and a test that compiles its own programs is fast only
where an earlier run left them::

    MHANUM_JAX_CACHE=$(mktemp -d) HYPOTHESIS_PROFILE=ci \
        python -m pytest -n 2 -m "not slow" --durations=0 -q > durations.txt
    python tests/tiers.py durations.txt

Tests already marked ``@pytest.mark.slow`` in their files stay slow; this file only adds to them.
"""

from __future__ import annotations

import ast
import collections
import re
import sys
from pathlib import Path

THRESHOLD = 3.0  # seconds (setup + call + teardown) on 2 cores under `-n 2`
LIST = Path(__file__).with_name("slow.txt")
LINE = re.compile(r"^\s*([\d.]+)s (setup|call|teardown)\s+(\S.*?)\s*$")
# The tests of what a minimal install offers stay fast whatever they take: .ci/run runs them in
# the README's own install (the test extra alone) with -m "not slow".
ALWAYS_FAST = (
    "tests/test_import.py",
    "tests/adapters/test_import.py",
    "tests/test_optional_dependencies.py",
)


def slow_ids(lines: list[str]) -> list[tuple[float, str]]:
    """``(seconds, node id)`` of every test at or above the threshold, slowest first."""
    total: dict[str, float] = collections.defaultdict(float)
    for line in lines:
        m = LINE.match(line)
        if m:
            total[m.group(3)] += float(m.group(1))
    return sorted(
        ((t, n) for n, t in total.items() if t >= THRESHOLD and not n.startswith(ALWAYS_FAST)),
        reverse=True,
    )


def read() -> set[str]:
    """The node ids listed in tests/slow.txt."""
    if not LIST.exists():
        return set()
    return {
        line.split(None, 1)[1].strip()
        for line in LIST.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }


def defined(node_id: str) -> bool:
    """Whether the test a node id names is still defined: its file exists and defines the test
    function (at module level, or in the named class); a parameter suffix ``[...]`` is not read."""
    path, *names = node_id.split("[", 1)[0].split("::")
    file = LIST.parent.parent / path
    if not file.is_file() or not names:
        return False
    body = ast.parse(file.read_text()).body
    for name in names[:-1]:  # classes
        body = next((n.body for n in body if isinstance(n, ast.ClassDef) and n.name == name), [])
    return any(isinstance(n, ast.FunctionDef) and n.name == names[-1] for n in body)


if __name__ == "__main__":
    found = slow_ids(Path(sys.argv[1]).read_text().splitlines())
    kept = {n for n in read() - {n for _, n in found} if defined(n)}  # renamed tests drop out
    lines = [f"{t:6.2f} {n}" for t, n in found] + [f"     - {n}" for n in sorted(kept)]
    header = (
        f"# measured seconds (setup + call + teardown) >= {THRESHOLD}; regenerate: tests/tiers.py\n"
    )
    LIST.write_text(header + "\n".join(lines) + "\n")
    print(f"{len(found)} tests at or above {THRESHOLD} s; {len(kept)} kept from before")
