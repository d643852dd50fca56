"""Time to import mhanum, side by side with JAX.

Run with ``python benchmarks/import_time.py`` (``--repeats N``, default 5). Each import runs in a
fresh interpreter (``sys.executable -c``) and is timed there with ``time.perf_counter``, so the
interpreter's own start-up is not counted. Prints the median of the runs for:

* ``import mhanum``: the public names load on first access, so this imports neither JAX nor
  Hypothesis;
* ``import jax``: what the first use of any JAX-backed name costs on top;
* ``from mhanum import attention`` and ``import mhanum.bounds``: a first real use.
"""

from __future__ import annotations

import statistics
import subprocess
import sys

STATEMENTS = (
    "import mhanum",
    "import jax",
    "from mhanum import attention",
    "import mhanum.bounds",
)


def import_seconds(statement: str) -> float:
    """Seconds ``statement`` takes in a fresh interpreter."""
    code = (
        f"import time\nstart = time.perf_counter()\n{statement}\nprint(time.perf_counter() - start)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    return float(done.stdout.strip())


def main() -> None:
    repeats = int(sys.argv[sys.argv.index("--repeats") + 1]) if "--repeats" in sys.argv else 5
    print(f"median of {repeats} fresh interpreters, seconds")
    print(f"{'statement':<32} {'median s':>10}  ratio")
    medians = {}
    for statement in STATEMENTS:
        medians[statement] = statistics.median(import_seconds(statement) for _ in range(repeats))
    jax_seconds = medians["import jax"]
    for statement, seconds in medians.items():
        print(f"{statement:<32} {seconds:>10.3f}  {seconds / jax_seconds:.2f}x import jax")


if __name__ == "__main__":
    main()
