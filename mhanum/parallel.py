"""Sweeps that scale out: independent tasks on any ``concurrent.futures.Executor``, and a journal.

A sweep (the report grid, a search campaign, the references of a device grid) is a list of
independent tasks, each ``(key, spec)``. :func:`run_tasks` calls a top-level function
``fn(spec, seed)`` on every task and returns the results in task order, whatever order they
finish in. Task ``i`` gets ``numpy.random.SeedSequence(seed).spawn(n)[i]``, so a task's seed
depends on its place in the sweep only, never on the number of workers or on which worker ran it.

Where a task runs is the ``executor``:

* ``None``: in this process, one task after another (no pickling, no start-up);
* any ``concurrent.futures.Executor``: :func:`default_executor` (a process pool of *spawned*
  processes: JAX is multithreaded and not fork-safe), a thread pool, or
  ``distributed.Client.get_executor()``;
* a ``distributed.Client`` itself (Dask; ``pip install "mhanum[dask]"``): its executor is used.
  :func:`dask_executor` opens a client of a scheduler, or of a ``LocalCluster`` when no address
  is given.

A task's result must be JSON (lists, dicts, strings, numbers, ``None``; ``Infinity`` and ``NaN``
as Python's :mod:`json` writes them) and a function of its spec and seed alone (no timings): it
is returned as it reads back from JSON, so a result is the same whether it was computed now, in
another process, or read from a journal.

The journal (``journal=PATH``) is an append-only JSON Lines file. Its first line is a header
naming the campaign (a JSON description from the caller, the seed and the task keys); each
finished task appends one line ``{"version", "key", "index", "seed": {"entropy", "spawn_key"},
"result"}``, flushed and fsynced before the next result is taken. Run again with the same
journal, the finished tasks are read back and only the others run (logged at ``INFO`` on the
``mhanum.parallel`` logger: ``resuming <file>: 12 of 40 tasks done, skipped``); a journal of
another campaign is refused, and nothing in an existing journal is ever rewritten. One run writes
a journal at a time; :func:`merge_journals` joins the journals of separate runs of one campaign.
A journal that cannot be read (not UTF-8, a line that is not JSON, a header or a line without a
field) raises :class:`~mhanum.InvalidArgument` with the message ``"<file>: <what is wrong>"``.

Ctrl-C (``KeyboardInterrupt``) stops a sweep where it is: every task that finished is in the
journal, the tasks not started are cancelled, and the spawned workers of
:func:`default_executor` ignore the interrupt themselves and are ended when the main process
leaves the pool, without waiting for the tasks they are running.

Examples:
    >>> from mhanum import parallel
    >>> parallel.run_tasks(parallel.spawned_seed, [("a", None), ("b", None)], seed=1)
    [[1, [0]], [1, [1]]]
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import math
import multiprocessing
import os
import signal
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from mhanum._errors import InvalidArgument

__all__ = [
    "JOURNAL_SCHEMA",
    "JOURNAL_VERSION",
    "Journal",
    "as_executor",
    "dask_executor",
    "default_executor",
    "executor_for",
    "journal_progress",
    "merge_journals",
    "run_tasks",
    "spawned_seed",
]

JOURNAL_SCHEMA = "mhanum.journal/1"
"""The ``schema`` field of a journal's header line."""

JOURNAL_VERSION = 1
"""The ``version`` field of every journal line."""

TaskFunction = Callable[[Any, np.random.SeedSequence], Any]
Progress = Callable[[int, int, str], None]
"""``progress(done, total, key)``, called after each task (read back or computed)."""

_log = logging.getLogger(__name__)

_UNREADABLE = (KeyError, IndexError, TypeError, ValueError, AttributeError)
"""What a ``read_back`` function of :func:`run_tasks` raises for a result it cannot use."""


def default_executor(max_workers: int | None = None) -> concurrent.futures.ProcessPoolExecutor:
    """A process pool of spawned processes (``max_workers``: default ``os.cpu_count()``).

    Spawned, never forked: JAX runs threads, and a forked child of a process running JAX may
    deadlock. Each worker imports what its first task needs (JAX: a second or two).

    Raises:
        InvalidArgument: for ``max_workers`` that is not a positive integer.
    """
    if max_workers is not None and (
        isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < 1
    ):
        msg = f"max_workers: expected a positive integer or None, got {max_workers!r}"
        raise InvalidArgument(msg)
    context = multiprocessing.get_context("spawn")
    return _ProcessPool(max_workers, mp_context=context, initializer=_ignore_interrupts)


def _ignore_interrupts() -> None:
    """A worker's initializer: Ctrl-C at a terminal reaches every process of the foreground
    group, and only the main process handles it (a worker would print a traceback)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class _ProcessPool(concurrent.futures.ProcessPoolExecutor):
    """A process pool that, left by ``KeyboardInterrupt``, ends its workers at once instead of
    waiting for the tasks they are running (their results would be lost anyway)."""

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> bool | None:
        if exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
            self._terminate()
            return False
        return super().__exit__(exc_type, exc, tb)

    def _terminate(self) -> None:
        # ProcessPoolExecutor.terminate_workers() is Python 3.14's; before it, the processes
        # and the thread that manages them are private attributes
        processes = list((getattr(self, "_processes", None) or {}).values())
        manager = getattr(self, "_executor_manager_thread", None)
        # Shut down before ending the workers: the manager thread then drops the cancelled
        # tasks before it sees the pool broken (Python 3.11 would set an exception on them)
        self.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            process.terminate()
        for process in processes:
            process.join()
        if manager is not None:
            manager.join()  # it releases the queues' semaphores


@contextlib.contextmanager
def dask_executor(
    address: str | None = None, *, n_workers: int | None = None
) -> Iterator[concurrent.futures.Executor]:
    """The executor of a Dask client: of the scheduler at ``address``, or of a new
    ``LocalCluster(n_workers, threads_per_worker=1, processes=True)`` when ``address`` is
    ``None``. The client (and a local cluster) close on leaving the context.

    Raises:
        InvalidArgument: when ``dask.distributed`` is not installed (``pip install
            "mhanum[dask]"``), for a bad ``n_workers``, or an ``address`` Dask cannot read or
            reach.
    """
    try:
        from distributed import Client, LocalCluster
    except ImportError:
        msg = 'scheduler: Dask needs dask.distributed; pip install "mhanum[dask]"'
        raise InvalidArgument(msg) from None
    with contextlib.ExitStack() as stack:
        if address is None:
            workers = _workers(n_workers, "n_workers") or os.cpu_count() or 1
            cluster = stack.enter_context(
                LocalCluster(
                    n_workers=workers,
                    threads_per_worker=1,
                    processes=True,
                    # its HTTP server on a free local port: the default 8787 would clash
                    # with another cluster on this machine (dashboard_address=None still
                    # takes 8787)
                    dashboard_address="127.0.0.1:0",
                )
            )
            client = stack.enter_context(Client(cluster))
        else:
            client = stack.enter_context(_connected(Client, address))
        yield client.get_executor(pure=False)


def _connected(client: Callable[[str], Any], address: str) -> Any:
    """A Dask client of the scheduler at ``address``.

    Raises:
        InvalidArgument: naming the address, where Dask cannot parse it (``ValueError``) or
            reach a scheduler there (``OSError``, after Dask's connection timeout).
    """
    try:
        return client(address)
    except (ValueError, OSError) as exc:
        msg = (
            "scheduler: expected 'local' or the address of a running Dask scheduler "
            f"(tcp://host:8786), got {address!r} ({type(exc).__name__}: {exc})"
        )
        raise InvalidArgument(msg) from None


@contextlib.contextmanager
def executor_for(
    workers: int | None = None, scheduler: str | None = None
) -> Iterator[concurrent.futures.Executor | None]:
    """The executor the command-line options ``--workers N`` and ``--scheduler ADDRESS`` ask for.

    ``scheduler`` ``None`` and ``workers`` ``None`` or ``0``: ``None`` (in this process);
    ``workers`` ``N``: :func:`default_executor` of ``N`` processes; ``scheduler`` ``"local"``: a
    Dask ``LocalCluster`` of ``workers`` processes (default the CPU count); any other
    ``scheduler``: the Dask scheduler at that address (``tcp://host:8786``).

    Raises:
        InvalidArgument: for a negative ``workers``, Dask not installed, or a scheduler
            address Dask cannot read or reach.
    """
    n = _workers(workers, "workers")
    if scheduler is not None:
        if not isinstance(scheduler, str) or not scheduler:
            msg = f"scheduler: expected 'local' or a scheduler address, got {scheduler!r}"
            raise InvalidArgument(msg)
        address = None if scheduler == "local" else scheduler
        with dask_executor(address, n_workers=n or None) as ex:
            yield ex
    elif not n:
        yield None
    else:
        with default_executor(n) as pool:
            yield pool


def _workers(value: object, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        msg = f"{name}: expected an integer >= 0, got {value!r}"
        raise InvalidArgument(msg)
    return value


def spawned_seed(spec: object, seed: np.random.SeedSequence) -> list[Any]:
    """``[entropy, spawn_key]`` of a task's seed (a task function that shows the seeding)."""
    return [seed.entropy, list(seed.spawn_key)]


def _canonical(value: object) -> str:
    """``value`` as compared between journals: sorted keys, and an infinite number as the string
    that names it (``-inf`` and ``"-inf"`` are one masking constant: a description written as
    strict JSON reads the same as one an earlier mhanum wrote with ``-Infinity``)."""
    return json.dumps(_infinities_named(value), sort_keys=True, allow_nan=True)


def _infinities_named(value: Any) -> Any:
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, dict):
        return {k: _infinities_named(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_infinities_named(v) for v in value]
    return value


def _as_json(value: object, key: str) -> Any:
    """``value`` as it reads back from JSON."""
    try:
        return json.loads(json.dumps(value, allow_nan=True))
    except (TypeError, ValueError) as exc:
        msg = f"task {key!r}: expected a JSON result, got {type(value).__name__} ({exc})"
        raise InvalidArgument(msg) from None


@dataclasses.dataclass(frozen=True)
class _Entry:
    key: str
    index: int
    result: Any
    line: int


def _header(campaign: object, seed: int, keys: Sequence[str]) -> dict[str, Any]:
    return {
        "schema": JOURNAL_SCHEMA,
        "version": JOURNAL_VERSION,
        "campaign": _as_json(campaign, "campaign"),
        "seed": seed,
        "tasks": list(keys),
    }


def _read_line(text: str, number: int, path: Path, last: bool) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if isinstance(value, dict):
        return value
    incomplete = " (incomplete: a run stopped while writing it)" if last else ""
    msg = (
        f"{path}: line {number} is not a JSON object{incomplete}; remove that line to resume "
        "from the lines before it"
    )
    raise InvalidArgument(msg)


def _check_header(header: Mapping[str, Any], path: Path) -> None:
    if header.get("schema") != JOURNAL_SCHEMA:
        msg = (
            f"{path}: line 1: expected a journal header with schema {JOURNAL_SCHEMA!r}, got "
            f"{header.get('schema')!r}"
        )
        raise InvalidArgument(msg)
    seed, keys = header.get("seed"), header.get("tasks")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        msg = f"{path}: line 1: expected the header's seed, a non-negative integer, got {seed!r}"
        raise InvalidArgument(msg)
    if not (isinstance(keys, list) and all(isinstance(k, str) for k in keys)):
        msg = f"{path}: line 1: expected the header's tasks, a list of keys, got {keys!r:.80}"
        raise InvalidArgument(msg)


def _read(path: Path) -> tuple[dict[str, Any], list[_Entry]]:
    """The header and the entries of a journal, checked line by line."""
    try:
        raw = path.read_bytes().decode("utf-8")
    except OSError as exc:
        msg = f"{path}: expected a readable journal file, got {exc.strerror or exc}"
        raise InvalidArgument(msg) from None
    except UnicodeDecodeError as exc:
        line = _line_of(path, exc.start)
        msg = f"{path}: line {line} is not UTF-8 text (byte {exc.start}); not a journal?"
        raise InvalidArgument(msg) from None
    lines = raw.split("\n")
    complete = raw.endswith("\n")
    if complete:
        lines.pop()
    if not lines or not lines[0].strip():
        msg = f"{path}: the file is empty; expected a journal header line (remove the file)"
        raise InvalidArgument(msg)
    header = _read_line(lines[0], 1, path, len(lines) == 1 and not complete)
    _check_header(header, path)
    index_of = {k: i for i, k in enumerate(header["tasks"])}
    entries = []
    for number, text in enumerate(lines[1:], start=2):
        item = _read_line(text, number, path, number == len(lines) and not complete)
        key = item.get("key")
        if key not in index_of or item.get("index") != index_of[key] or "result" not in item:
            msg = (
                f"{path}: line {number}: expected a result of one of the header's tasks (key, "
                f"index, result), got key {key!r} at index {item.get('index')!r}"
                f"{'' if 'result' in item else ' without a result'}"
            )
            raise InvalidArgument(msg)
        entries.append(_Entry(str(key), index_of[key], item["result"], number))
    return header, entries


def _line_of(path: Path, offset: int) -> int:
    """The 1-based line of the byte at ``offset`` of a file."""
    return path.read_bytes()[:offset].count(b"\n") + 1


def _finished(entries: Sequence[_Entry], sources: Sequence[str]) -> dict[str, _Entry]:
    """The entries by key, once each; the same key with two results is an error."""
    found: dict[str, tuple[_Entry, str]] = {}
    for entry, source in zip(entries, sources, strict=True):
        if entry.key in found:
            first, where = found[entry.key]
            if _canonical(first.result) != _canonical(entry.result):
                msg = (
                    f"{source}: line {entry.line}: task {entry.key!r} has two different results "
                    f"({where} line {first.line} and {source} line {entry.line}); a task's "
                    "result must depend on its spec and seed only"
                )
                raise InvalidArgument(msg)
            continue
        found[entry.key] = (entry, source)
    return {k: e for k, (e, _) in found.items()}


def _differences(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    return [
        f for f in ("campaign", "seed", "tasks") if _canonical(a.get(f)) != _canonical(b.get(f))
    ]


class Journal:
    """An append-only JSON Lines record of the finished tasks of one campaign.

    Opening an existing journal reads and checks every line; a new one gets its header. Lines
    are only ever appended (each one flushed and fsynced).

    Args:
        path: the file.
        campaign, seed, keys: the campaign's description, root seed and task keys (the header).
        read_back: a function of one result, raising ``KeyError``, ``IndexError``,
            ``TypeError``, ``ValueError`` or ``AttributeError`` for a result the campaign cannot
            use (the conversion its caller applies to the results, say); called on every result
            read back.

    Attributes:
        path: the file.
        header: its first line (``schema``, ``version``, ``campaign``, ``seed``, ``tasks``).
        finished: the results read back, by task key.

    Raises:
        InvalidArgument: ``"<file>: <what is wrong>"``, for a file that is not a journal, a line
            that is not JSON or lacks a field (naming it), a result ``read_back`` refuses, a
            journal of another campaign (another description, seed or task list), or one task
            with two results.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        campaign: object,
        seed: int,
        keys: Sequence[str],
        *,
        read_back: Callable[[Any], object] | None = None,
    ) -> None:
        self.path = Path(path)
        self.header = _header(campaign, seed, keys)
        if self.path.exists():
            found, entries = _read(self.path)
            differ = _differences(found, self.header)
            if differ:
                msg = (
                    f"{self.path}: records another campaign (its {' and '.join(differ)} differ "
                    "from this run's); pass a new journal file or run the campaign it records"
                )
                raise InvalidArgument(msg)
            if not self.path.read_bytes().endswith(b"\n"):
                msg = (
                    f"{self.path}: line {len(entries) + 1} has no end of line (a run stopped "
                    "while writing it); remove it to resume"
                )
                raise InvalidArgument(msg)
            finished = _finished(entries, [str(self.path)] * len(entries))
            if read_back is not None:
                for entry in finished.values():
                    _check_result(read_back, entry, self.path)
            self.finished = {k: e.result for k, e in finished.items()}
        else:
            self.finished = {}
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("x", encoding="utf-8") as f:
                _write(f, self.header)

    def append(self, key: str, index: int, seed: np.random.SeedSequence, result: object) -> None:
        """Add one finished task (flushed and fsynced before returning)."""
        line = {
            "version": JOURNAL_VERSION,
            "key": key,
            "index": index,
            "seed": {"entropy": seed.entropy, "spawn_key": list(seed.spawn_key)},
            "result": result,
        }
        with self.path.open("a", encoding="utf-8") as f:
            _write(f, line)
        self.finished[key] = result


def _check_result(read_back: Callable[[Any], object], entry: _Entry, path: Path) -> None:
    """Refuse a result read back from a journal that ``read_back`` cannot use, naming its line."""
    try:
        read_back(entry.result)
    except _UNREADABLE as exc:
        if isinstance(exc, KeyError):
            problem = f"one without the field {exc.args[0]!r}"
        else:
            problem = f"one it cannot read ({type(exc).__name__}: {exc})"
        msg = (
            f"{path}: line {entry.line}: expected the result of task {entry.key!r} as this "
            f"campaign writes it, got {problem}; remove that line to run the task again"
        )
        raise InvalidArgument(msg) from None


def journal_progress(path: str | os.PathLike[str]) -> tuple[int, int]:
    """``(finished, total)``: how many of its campaign's tasks a journal holds.

    Raises:
        InvalidArgument: ``"<file>: <what is wrong>"``, for a file that is not a journal.
    """
    header, entries = _read(Path(path))
    return len({e.key for e in entries}), len(header["tasks"])


def _write(f: TextIO, item: Mapping[str, Any]) -> None:
    f.write(json.dumps(item, allow_nan=True) + "\n")
    f.flush()
    os.fsync(f.fileno())


def merge_journals(
    sources: Sequence[str | os.PathLike[str]], out: str | os.PathLike[str]
) -> dict[str, Any]:
    """Join journals of one campaign (run separately, say on two machines) into a new journal.

    Each task appears once in ``out``, in task order; a task finished in several sources must
    have the same result in each.

    Args:
        sources: journal files with the same header.
        out: the merged journal; must not exist (nothing is overwritten).

    Returns:
        The results by task key.

    Raises:
        InvalidArgument: for an existing ``out``, unreadable sources, headers that differ, or a
            task with two different results (naming the key and the lines).
    """
    target = Path(out)
    if target.exists():
        msg = f"out: expected a new file, got existing {str(target)!r}"
        raise InvalidArgument(msg)
    if not sources:
        msg = "sources: expected at least one journal file, got none"
        raise InvalidArgument(msg)
    header: dict[str, Any] | None = None
    entries: list[_Entry] = []
    names: list[str] = []
    for source in sources:
        path = Path(source)
        if not path.is_file():
            msg = f"{path}: no such journal file"
            raise InvalidArgument(msg)
        found, items = _read(path)
        if header is None:
            header = found
        elif differ := _differences(found, header):
            msg = (
                f"{path}: records another campaign than {sources[0]} (their "
                f"{' and '.join(differ)} differ)"
            )
            raise InvalidArgument(msg)
        entries.extend(items)
        names.extend([str(path)] * len(items))
    assert header is not None
    finished = _finished(entries, names)
    with target.open("x", encoding="utf-8") as f:
        _write(f, header)
        for entry in sorted(finished.values(), key=lambda e: e.index):
            seed = np.random.SeedSequence(header["seed"]).spawn(len(header["tasks"]))[entry.index]
            _write(
                f,
                {
                    "version": JOURNAL_VERSION,
                    "key": entry.key,
                    "index": entry.index,
                    "seed": {"entropy": seed.entropy, "spawn_key": list(seed.spawn_key)},
                    "result": entry.result,
                },
            )
    return {k: finished[k].result for k in header["tasks"] if k in finished}


def _check_seed(seed: object) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        msg = f"seed: expected a non-negative integer, got {seed!r}"
        raise InvalidArgument(msg)
    return int(seed)


def _check_tasks(tasks: Sequence[tuple[str, Any]]) -> list[str]:
    keys = []
    for task in tasks:
        if not (isinstance(task, tuple) and len(task) == 2 and isinstance(task[0], str)):
            msg = f"tasks: expected (key, spec) pairs with a string key, got {task!r:.80}"
            raise InvalidArgument(msg)
        keys.append(task[0])
    if len(set(keys)) != len(keys):
        twice = sorted({k for k in keys if keys.count(k) > 1})
        msg = f"tasks: expected distinct keys, got {twice} more than once"
        raise InvalidArgument(msg)
    return keys


def as_executor(executor: object) -> concurrent.futures.Executor:
    """``executor`` itself, or the executor of a ``distributed.Client``.

    Raises:
        InvalidArgument: for anything else.
    """
    if isinstance(executor, concurrent.futures.Executor):
        return executor
    get = getattr(executor, "get_executor", None)  # a distributed.Client
    if callable(get):
        ex = get(pure=False)
        assert isinstance(ex, concurrent.futures.Executor)
        return ex
    msg = (
        "executor: expected None, a concurrent.futures.Executor or a distributed.Client, "
        f"got {type(executor).__name__}"
    )
    raise InvalidArgument(msg)


def run_tasks(
    fn: TaskFunction,
    tasks: Sequence[tuple[str, Any]],
    *,
    seed: int = 0,
    executor: object = None,
    journal: str | os.PathLike[str] | None = None,
    campaign: object = None,
    progress: Progress | None = None,
    read_back: Callable[[Any], object] | None = None,
) -> list[Any]:
    """``fn(spec, seed_i)`` for every task ``(key, spec)``; the results in task order.

    Args:
        fn: a top-level (picklable) function of a spec and a ``numpy.random.SeedSequence``,
            returning JSON.
        tasks: ``(key, spec)`` pairs; distinct string keys; picklable specs.
        seed: the root of the task seeds, ``SeedSequence(seed).spawn(len(tasks))``.
        executor: ``None`` (in this process, in order), a ``concurrent.futures.Executor`` or a
            ``distributed.Client``.
        journal: a JSON Lines file: finished tasks are read back from it and not run again, and
            each task that finishes is appended.
        campaign: a JSON description of the campaign, recorded in the journal's header (a
            journal with another description is refused).
        progress: ``progress(done, total, key)`` after each task.
        read_back: checks each result read back from the journal (see :class:`Journal`).

    Returns:
        The results, in the order of ``tasks``, as they read back from JSON.

    Raises:
        InvalidArgument: for bad tasks or arguments, a result that is not JSON, or a journal
            that cannot be read or does not belong to this campaign.
        KeyboardInterrupt: on Ctrl-C, after cancelling the tasks not started (every task that
            finished was journaled).
        Exception: the first error a task raised (after every task that finished was
            journaled); its notes name the task.
    """
    root = _check_seed(seed)
    keys = _check_tasks(tasks)
    seeds = np.random.SeedSequence(root).spawn(len(tasks))
    book = None
    if journal is not None:
        book = Journal(journal, campaign, root, keys, read_back=read_back)
        if book.finished:
            _log.info(
                "resuming %s: %d of %d tasks done, skipped", journal, len(book.finished), len(keys)
            )
    results: dict[int, Any] = {}
    done = 0
    for i, key in enumerate(keys):
        if book is not None and key in book.finished:
            results[i] = book.finished[key]
            done += 1
            if progress is not None:
                progress(done, len(tasks), key)

    def finish(i: int, value: object) -> None:
        nonlocal done
        results[i] = _as_json(value, keys[i])
        if book is not None:
            book.append(keys[i], i, seeds[i], results[i])
        done += 1
        if progress is not None:
            progress(done, len(tasks), keys[i])

    pending = [i for i in range(len(tasks)) if i not in results]
    if executor is None:
        for i in pending:
            try:
                value = fn(tasks[i][1], seeds[i])
            except Exception as exc:
                exc.add_note(f"in task {keys[i]!r} of {len(tasks)}")
                raise
            finish(i, value)
        return [results[i] for i in range(len(tasks))]
    ex = as_executor(executor)
    futures: dict[concurrent.futures.Future[Any], int] = {}
    failure: BaseException | None = None
    try:
        for i in pending:
            futures[ex.submit(fn, tasks[i][1], seeds[i])] = i
        for future in concurrent.futures.as_completed(futures):
            i = futures[future]
            try:
                value = future.result()
            except concurrent.futures.CancelledError:
                continue
            except Exception as exc:  # noqa: BLE001 (re-raised below, after the others finish)
                if failure is None:
                    exc.add_note(f"in task {keys[i]!r} of {len(tasks)}")
                    failure = exc
                    for other in futures:
                        other.cancel()
                continue
            finish(i, value)
    except KeyboardInterrupt:
        for other in futures:
            other.cancel()
        raise
    if failure is not None:
        raise failure
    return [results[i] for i in range(len(tasks))]
