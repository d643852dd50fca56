"""Campaigns: many independent searches of one kind, seeds spawned from one root, run as tasks
of :func:`mhanum.parallel.run_tasks` and recorded in its journal, one case record a task.

The module is ``campaigns``, not ``campaign``: ``mhanum.search.campaign`` is the function.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from mhanum import parallel
from mhanum._errors import InvalidArgument
from mhanum.numerics import Numerics, resolve
from mhanum.search._core import (
    Case,
    Sizes,
    check_heads,
    check_runs,
    check_search,
    preset_name,
)
from mhanum.search.attention import Objective, Shape, WorstCase, random_search, worst_case
from mhanum.search.mha import MHAShape, MHAWorstCase, mha_worst_case

if TYPE_CHECKING:
    from collections.abc import Iterable

__all__ = ["METHODS", "campaign", "campaign_task", "mha_campaign", "mha_campaign_task"]

METHODS = ("targeted", "random")
"""The searches of a :func:`campaign`: :func:`worst_case` and :func:`random_search`."""


def _task_seed(seed: np.random.SeedSequence) -> int:
    """The search seed of a campaign task: 32 bits drawn from its ``SeedSequence``."""
    return int(seed.generate_state(1, np.uint32)[0])


def _in_x64() -> None:
    """JAX's 64-bit mode in a fresh worker process, as the campaign's caller has it."""
    import jax

    if not jax.config.read("jax_enable_x64"):
        jax.config.update("jax_enable_x64", True)


def campaign_task(spec: Mapping[str, Any], seed: np.random.SeedSequence) -> dict[str, Any]:
    """One search of a :func:`campaign` (a task of :func:`mhanum.parallel.run_tasks`): the
    case found, as JSON (:meth:`WorstCase.record`). Runs in JAX's 64-bit mode, as the
    campaign's caller does."""
    _in_x64()
    options = dict(spec)
    run = worst_case if options.pop("method") == "targeted" else random_search
    case = run(options.pop("numerics"), options.pop("shape"), seed=_task_seed(seed), **options)
    return case.record()


def mha_campaign_task(spec: Mapping[str, Any], seed: np.random.SeedSequence) -> dict[str, Any]:
    """One search of an :func:`mha_campaign` (a task of :func:`mhanum.parallel.run_tasks`): the
    case found, as JSON (:meth:`MHAWorstCase.record`). Runs in JAX's 64-bit mode, as the
    campaign's caller does."""
    _in_x64()
    options = dict(spec)
    case = mha_worst_case(
        options.pop("numerics"), options.pop("shape"), seed=_task_seed(seed), **options
    )
    return case.record()


def _numerics_list(numerics: Numerics | str | Sequence[Numerics | str]) -> list[Numerics]:
    given: Sequence[Numerics | str] = (
        [numerics] if isinstance(numerics, (Numerics, str)) else list(numerics)
    )
    nums = [resolve(n) for n in given]
    if not nums:
        msg = "numerics: expected a Numerics, a preset name or a list of them, got none"
        raise InvalidArgument(msg)
    return nums


def _run(
    task: Callable[[Mapping[str, Any], np.random.SeedSequence], dict[str, Any]],
    case_type: type[Case],
    label: str,
    nums: list[Numerics],
    sizes: Sizes,
    runs: int,
    options: dict[str, Any],
    description: dict[str, Any],
    **run_tasks: Any,
) -> list[Any]:
    """``runs`` searches of each numerics as tasks ``<i>:<preset>/<label> <r>``, their records
    read back into cases of ``case_type``."""
    tasks = [
        (f"{i}:{preset_name(num) or 'custom'}/{label} {r}",
         options | {"numerics": num, "shape": sizes})
        for i, num in enumerate(nums)
        for r in range(runs)
    ]  # fmt: skip
    description = description | {
        "numerics": [n.to_dict() for n in nums],
        "shape": sizes.as_dict(),
        "runs": runs,
    }
    records = parallel.run_tasks(
        task, tasks, campaign=description, read_back=case_type.from_record, **run_tasks
    )
    return [case_type.from_record(r) for r in records]


def campaign(
    numerics: Numerics | str | Sequence[Numerics | str],
    shape: Shape | Mapping[str, int],
    *,
    runs: int = 1,
    seed: int = 0,
    method: str = "targeted",
    objective: str = "error/bound",
    budget: int = 200,
    mask: str | None = None,
    structure: str | Iterable[str] | None = None,
    against: Numerics | str | None = None,
    softcap: float | None = None,
    sink: float | None = None,
    executor: object = None,
    journal: str | os.PathLike[str] | None = None,
    progress: parallel.Progress | None = None,
) -> list[WorstCase]:
    """Several independent searches: ``runs`` of each numerics, each with its own seed.

    Search ``j`` (numerics ``i``, run ``r``, ``j = i·runs + r``) runs with the seed drawn from
    ``numpy.random.SeedSequence(seed).spawn(n)[j]``, so the cases depend on ``seed`` and on the
    search's place only, not on where it ran. The searches are tasks of
    :func:`mhanum.parallel.run_tasks` on ``executor``, recorded in ``journal``.

    Args:
        numerics: one :class:`~mhanum.Numerics` or preset name, or several.
        shape: as for :func:`worst_case`.
        runs: searches per numerics.
        seed: the root of the searches' seeds.
        method: ``"targeted"`` (:func:`worst_case`) or ``"random"`` (:func:`random_search`).
        objective, budget, mask, against, softcap, sink: as for :func:`worst_case`, for every
            search.
        structure: as for :func:`worst_case` (targeted searches only).
        executor: ``None`` (in this process), a ``concurrent.futures.Executor``
            (:func:`mhanum.parallel.default_executor`) or a ``distributed.Client``.
        journal: a JSON Lines file of finished searches (:mod:`mhanum.parallel`): run again
            with it, a campaign runs only the searches it lacks.
        progress: ``progress(done, total, key)`` after each search.

    Returns:
        The cases, numerics by numerics and run by run. Their ``seconds`` is 0: a campaign's
        results are what its journal holds, and a journal holds no timings.

    Raises:
        InvalidArgument: for a bad argument, without JAX's 64-bit mode, or a journal of another
            campaign.

    Examples:
        >>> import jax
        >>> jax.config.update("jax_enable_x64", True)
        >>> cases = campaign(["fp32", "bf16"], {"q_len": 2, "kv_len": 4, "d_k": 4}, budget=4)
        >>> [c.preset for c in cases], all(c.ratio <= 1 for c in cases)
        (['fp32', 'bf16'], True)
    """
    nums = _numerics_list(numerics)
    sizes = Shape.of(shape)
    count = check_runs(runs)
    budget, seed, kind = check_search(budget, seed, mask)
    if method not in METHODS:
        msg = f"method: expected one of {METHODS}, got {method!r}"
        raise InvalidArgument(msg)
    if method == "random" and structure is not None:
        msg = "structure: expected None with method='random' (it draws plain inputs)"
        raise InvalidArgument(msg)
    other = None if against is None else resolve(against)
    options: dict[str, Any] = {
        "method": method, "objective": objective, "budget": budget, "mask": kind,
        "against": other, "softcap": softcap, "sink": sink,
    }  # fmt: skip
    if method == "targeted":
        options["structure"] = structure
    Objective(nums[0], objective, against=other, softcap=softcap, sink=sink)  # checks them
    description = {
        "kind": "mhanum.search.campaign",
        **options,
        "against": None if other is None else other.to_dict(),
        "structure": repr(structure),
    }
    return _run(
        campaign_task, WorstCase, "run", nums, sizes, count, options, description,
        seed=seed, executor=executor, journal=journal, progress=progress,
    )  # fmt: skip


def mha_campaign(
    numerics: Numerics | str | Sequence[Numerics | str],
    shape: MHAShape | Mapping[str, int],
    *,
    num_heads: int,
    runs: int = 1,
    seed: int = 0,
    budget: int = 50,
    mask: str | None = None,
    executor: object = None,
    journal: str | os.PathLike[str] | None = None,
    progress: parallel.Progress | None = None,
) -> list[MHAWorstCase]:
    """Several independent :func:`mha_worst_case` searches, as :func:`campaign` runs
    :func:`worst_case`: ``runs`` of each numerics, seeds spawned from ``seed``, tasks of
    :func:`mhanum.parallel.run_tasks` on ``executor``, recorded in ``journal``.

    Args:
        numerics: one :class:`~mhanum.Numerics` or preset name, or several.
        shape, num_heads, budget, mask: as for :func:`mha_worst_case`, for every search.
        runs, seed, executor, journal, progress: as for :func:`campaign`.

    Returns:
        The cases, numerics by numerics and run by run (``seconds`` 0).

    Raises:
        InvalidArgument: as :func:`campaign` does.

    Examples:
        >>> import jax
        >>> jax.config.update("jax_enable_x64", True)
        >>> found = mha_campaign("bf16", {"q_len": 2, "d_model": 4}, num_heads=2, runs=2, budget=2)
        >>> len({c.seed for c in found}), all(c.ratio <= 1 for c in found)
        (2, True)
    """
    nums = _numerics_list(numerics)
    sizes = MHAShape.of(shape)
    heads = check_heads(num_heads, sizes.d_model)
    count = check_runs(runs)
    budget, seed, kind = check_search(budget, seed, mask)
    options = {"num_heads": heads, "budget": budget, "mask": kind}
    description = {"kind": "mhanum.search.mha_campaign", **options}
    return _run(
        mha_campaign_task, MHAWorstCase, "mha run", nums, sizes, count, options, description,
        seed=seed, executor=executor, journal=journal, progress=progress,
    )  # fmt: skip
