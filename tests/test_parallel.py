"""``mhanum.parallel``: task order and seeds independent of the executor, the journal (resume
after a killed worker, merge, refusals), and the sweeps on a spawned pool and on Dask."""

from __future__ import annotations

import concurrent.futures
import json
import math
import multiprocessing
import re

import numpy as np
import pytest

from mhanum import InvalidArgument, parallel
from tests import parallel_tasks

TASKS = [(f"t{x}", x) for x in range(8)]
CAMPAIGN = {"kind": "test", "size": 8}


def expected(tasks=TASKS, seed=5):
    seeds = np.random.SeedSequence(seed).spawn(len(tasks))
    return [parallel_tasks.draw(spec, s) for (_, spec), s in zip(tasks, seeds, strict=True)]


@pytest.fixture(scope="module")
def threads():
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        yield pool


def test_results_in_task_order_with_seeds_by_place_not_by_worker(threads):
    alone = parallel.run_tasks(parallel_tasks.draw, TASKS, seed=5)
    assert alone == expected()
    with concurrent.futures.ThreadPoolExecutor(1) as one:
        assert parallel.run_tasks(parallel_tasks.draw, TASKS, seed=5, executor=one) == alone
    assert parallel.run_tasks(parallel_tasks.draw, TASKS, seed=5, executor=threads) == alone
    assert parallel.run_tasks(parallel_tasks.draw, TASKS, seed=6) != alone
    seeds = parallel.run_tasks(parallel.spawned_seed, TASKS, seed=5, executor=threads)
    assert seeds == [[5, [i]] for i in range(len(TASKS))]


def test_a_journal_is_read_back_and_never_rewritten(tmp_path, threads):
    path = tmp_path / "j.jsonl"
    runs = tmp_path / "runs"
    runs.mkdir()
    tasks = [(k, (x, str(runs), None)) for k, x in TASKS]
    first = parallel.run_tasks(
        parallel_tasks.logged, tasks, seed=5, journal=path, campaign=CAMPAIGN, executor=threads
    )
    assert first == expected()
    lines = path.read_text().splitlines()
    header = json.loads(lines[0])
    assert header["schema"] == parallel.JOURNAL_SCHEMA
    assert header["tasks"] == [k for k, _ in TASKS]
    entries = [json.loads(line) for line in lines[1:]]
    assert sorted(e["key"] for e in entries) == sorted(k for k, _ in TASKS)
    assert all(e["version"] == parallel.JOURNAL_VERSION for e in entries)
    assert all(e["seed"] == {"entropy": 5, "spawn_key": [e["index"]]} for e in entries)
    before = path.read_bytes()
    again = parallel.run_tasks(
        parallel_tasks.logged, tasks, seed=5, journal=path, campaign=CAMPAIGN
    )
    assert again == first
    assert path.read_bytes() == before
    assert len(list(runs.glob("ran-*"))) == len(TASKS)  # nothing ran twice


def test_a_killed_worker_loses_no_finished_result_and_the_rerun_does_only_the_rest(tmp_path):
    path = tmp_path / "j.jsonl"
    runs = tmp_path / "runs"
    runs.mkdir()
    tasks = [(k, (x, str(runs), 4)) for k, x in TASKS]
    # one worker runs the tasks in order: t0..t3 finish, t4 kills the process
    with (
        parallel.default_executor(1) as pool,
        pytest.raises(concurrent.futures.process.BrokenProcessPool) as info,
    ):
        parallel.run_tasks(
            parallel_tasks.logged, tasks, seed=5, journal=path, campaign=CAMPAIGN, executor=pool
        )
    assert any("of 8" in note for note in info.value.__notes__)
    journaled = [json.loads(line)["key"] for line in path.read_text().splitlines()[1:]]
    assert sorted(journaled) == ["t0", "t1", "t2", "t3"]
    ran_before = {p.name for p in runs.glob("ran-*")}
    with parallel.default_executor(2) as pool:
        results = parallel.run_tasks(
            parallel_tasks.logged, tasks, seed=5, journal=path, campaign=CAMPAIGN, executor=pool
        )
    assert results == expected()
    ran_now = {p.name.split("-")[1] for p in runs.glob("ran-*")} - {
        n.split("-")[1] for n in ran_before
    }
    assert ran_now == {str(x) for x in range(4, 8)}
    assert not list(runs.glob("ran-*-1"))  # no finished task ran again


def test_a_failing_task_is_raised_naming_it_after_the_others_are_journaled(tmp_path, threads):
    path = tmp_path / "j.jsonl"
    tasks = [(f"t{x}", x) for x in range(6)]
    with pytest.raises(RuntimeError, match="three") as info:
        parallel.run_tasks(parallel_tasks.fails, tasks, journal=path, executor=threads)
    assert "in task 't3' of 6" in info.value.__notes__
    journaled = {json.loads(line)["key"] for line in path.read_text().splitlines()[1:]}
    assert "t3" not in journaled
    assert {"t0", "t1", "t2"} <= journaled
    with pytest.raises(RuntimeError, match="three") as info:
        parallel.run_tasks(parallel_tasks.fails, tasks)
    assert "in task 't3' of 6" in info.value.__notes__


def _partial(path, keys, results, seed=5):
    journal = parallel.Journal(path, CAMPAIGN, seed, [k for k, _ in TASKS])
    seeds = np.random.SeedSequence(seed).spawn(len(TASKS))
    index = {k: i for i, (k, _) in enumerate(TASKS)}
    for key in keys:
        journal.append(key, index[key], seeds[index[key]], results[index[key]])


def test_journals_of_one_campaign_merge(tmp_path):
    full = expected()
    _partial(tmp_path / "a.jsonl", ["t0", "t1", "t5"], full)
    _partial(tmp_path / "b.jsonl", ["t1", "t2", "t3", "t4", "t6", "t7"], full)
    merged = parallel.merge_journals([tmp_path / "a.jsonl", tmp_path / "b.jsonl"], tmp_path / "m")
    assert list(merged) == [k for k, _ in TASKS]
    assert list(merged.values()) == full
    resumed = parallel.run_tasks(
        parallel_tasks.fails, TASKS, seed=5, journal=tmp_path / "m", campaign=CAMPAIGN
    )  # `fails` would return the spec: every result came from the journal
    assert resumed == full
    with pytest.raises(InvalidArgument, match="out: expected a new file"):
        parallel.merge_journals([tmp_path / "a.jsonl"], tmp_path / "m")


def test_the_command_merges_journals(tmp_path, capsys):
    from mhanum import cli

    full = expected()
    _partial(tmp_path / "a.jsonl", ["t0", "t1"], full)
    _partial(tmp_path / "b.jsonl", ["t1", "t7"], full)
    sources = [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")]
    assert cli.main(["merge-journals", *sources, "-o", str(tmp_path / "m.jsonl")]) == 0
    assert "3 of 8 tasks finished" in capsys.readouterr().out
    lines = (tmp_path / "m.jsonl").read_text().splitlines()[1:]
    keys = [json.loads(line)["key"] for line in lines]
    assert keys == ["t0", "t1", "t7"]
    assert cli.main(["merge-journals", *sources, "-o", str(tmp_path / "m.jsonl")]) == 2
    assert "-o: expected a new file" in capsys.readouterr().err


def test_conflicting_results_name_the_task(tmp_path):
    full = expected()
    other = [*full[:2], {"spec": 2, "draw": 0.5}, *full[3:]]
    _partial(tmp_path / "a.jsonl", ["t1", "t2"], full)
    _partial(tmp_path / "b.jsonl", ["t2"], other)
    with pytest.raises(InvalidArgument, match=r"task 't2' has two different results.*line 3"):
        parallel.merge_journals([tmp_path / "a.jsonl", tmp_path / "b.jsonl"], tmp_path / "m")
    assert not (tmp_path / "m").exists()


def test_a_journal_of_another_campaign_is_refused(tmp_path):
    path = tmp_path / "j.jsonl"
    parallel.run_tasks(parallel_tasks.draw, TASKS, seed=5, journal=path, campaign=CAMPAIGN)
    before = path.read_bytes()
    for change, what in (
        ({"campaign": {"kind": "test", "size": 9}}, "campaign"),
        ({"seed": 6}, "seed"),
        ({"tasks": TASKS[:-1]}, "tasks"),
    ):
        kwargs = {"campaign": CAMPAIGN, "seed": 5, "tasks": TASKS} | change
        tasks = kwargs.pop("tasks")
        with pytest.raises(InvalidArgument, match=f"another campaign \\(its {what} differ"):
            parallel.run_tasks(parallel_tasks.draw, tasks, journal=path, **kwargs)
    assert path.read_bytes() == before
    other = tmp_path / "k.jsonl"
    parallel.run_tasks(parallel_tasks.draw, TASKS, seed=6, journal=other, campaign=CAMPAIGN)
    with pytest.raises(InvalidArgument, match="seed differ"):
        parallel.merge_journals([path, other], tmp_path / "m")


def test_a_journal_whose_description_wrote_minus_infinity_as_a_number_resumes(tmp_path):
    """An earlier mhanum wrote a masking constant of -inf as JSON's -Infinity; today's
    description writes the string "-inf" (strict JSON): one campaign, so the journal resumes."""
    path = tmp_path / "j.jsonl"
    old = {"kind": "test", "mask_value": -math.inf, "values": [math.inf, 1.0]}
    new = {"kind": "test", "mask_value": "-inf", "values": ["inf", 1.0]}
    first = parallel.run_tasks(parallel_tasks.draw, TASKS[:2], seed=5, journal=path, campaign=old)
    assert b"-Infinity" in path.read_bytes().splitlines()[0]
    again = parallel.run_tasks(parallel_tasks.draw, TASKS[:2], seed=5, journal=path, campaign=new)
    assert again == first
    changed = new | {"mask_value": "-1e9"}
    with pytest.raises(InvalidArgument, match="another campaign"):
        parallel.run_tasks(parallel_tasks.draw, TASKS[:2], seed=5, journal=path, campaign=changed)


def test_a_corrupt_line_is_named(tmp_path):
    path = tmp_path / "j.jsonl"
    parallel.run_tasks(parallel_tasks.draw, TASKS[:3], seed=5, journal=path)
    good = path.read_text().splitlines(keepends=True)
    header = json.loads(good[0])
    cases = {
        "garbage in the middle": ([*good[:2], "{not json\n", *good[2:]], "line 3 is not"),
        "a list, not an object": ([*good[:3], "[1, 2]\n"], "line 4 is not"),
        "a cut last line": ([*good[:3], good[3][:20]], "line 4 .*incomplete"),
        "a whole last line without its end": ([*good[:3], good[3][:-1]], "line 4 has no end"),
        "an unknown task": ([*good, good[1].replace('"t0"', '"t9"')], "line 5: .*'t9'"),
        "a line without its result": (
            [*good, good[1].replace('"result"', '"other"')],
            "line 5: .*without a result",
        ),
        "no header": (good[1:], "line 1: .* header"),
        "a header without tasks": (
            [json.dumps({k: v for k, v in header.items() if k != "tasks"}) + "\n", *good[1:]],
            "line 1: expected the header's tasks",
        ),
        "a header with a bad seed": (
            [json.dumps(header | {"seed": "five"}) + "\n", *good[1:]],
            "line 1: expected the header's seed",
        ),
    }
    for name, (lines, message) in cases.items():
        bad = tmp_path / f"{name}.jsonl"
        bad.write_text("".join(lines))
        with pytest.raises(InvalidArgument, match=f"^{re.escape(str(bad))}: {message}"):
            parallel.run_tasks(parallel_tasks.draw, TASKS[:3], seed=5, journal=bad)
        if name != "a whole last line without its end":  # whole: merge reads it
            with pytest.raises(InvalidArgument, match=f"^{re.escape(str(bad))}: {message}"):
                parallel.merge_journals([bad], tmp_path / "merged.jsonl")
        assert bad.read_text() == "".join(lines), name
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(good[0].encode() + b"\xff\xfe\n")
    with pytest.raises(InvalidArgument, match=r"binary.jsonl: line 2 is not UTF-8"):
        parallel.run_tasks(parallel_tasks.draw, TASKS[:3], seed=5, journal=binary)
    with pytest.raises(InvalidArgument, match="expected a readable journal file, got Is a direc"):
        parallel.run_tasks(parallel_tasks.draw, TASKS[:3], seed=5, journal=tmp_path)
    assert not (tmp_path / "merged.jsonl").exists()


def test_a_result_the_campaign_cannot_read_back_is_refused_naming_its_line(tmp_path):
    path = tmp_path / "j.jsonl"
    parallel.run_tasks(parallel_tasks.draw, TASKS[:3], seed=5, journal=path)

    def read_back(result):
        return result["draw"] + 0.0

    again = parallel.run_tasks(
        parallel_tasks.draw, TASKS[:3], seed=5, journal=path, read_back=read_back
    )
    assert again == expected(TASKS[:3])
    lines = path.read_text().splitlines(keepends=True)
    entry = json.loads(lines[2])
    del entry["result"]["draw"]
    lines[2] = json.dumps(entry) + "\n"
    path.write_text("".join(lines))
    message = (
        f"{path}: line 3: expected the result of task {entry['key']!r} as this campaign writes "
        "it, got one without the field 'draw'"
    )
    with pytest.raises(InvalidArgument, match=re.escape(message)):
        parallel.run_tasks(
            parallel_tasks.draw, TASKS[:3], seed=5, journal=path, read_back=read_back
        )


def test_a_resume_is_logged_with_the_tasks_it_skips(tmp_path, caplog):
    path = tmp_path / "j.jsonl"
    parallel.run_tasks(parallel_tasks.draw, TASKS[:3], seed=5, journal=path)
    assert parallel.journal_progress(path) == (3, 3)
    caplog.set_level("INFO", logger="mhanum.parallel")
    parallel.run_tasks(parallel_tasks.draw, TASKS[:3], seed=5, journal=path)
    assert caplog.messages == [f"resuming {path}: 3 of 3 tasks done, skipped"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tasks": [("a", 1), ("a", 2)]}, r"tasks: expected distinct keys, got \['a'\]"),
        ({"tasks": [(1, 1)]}, "tasks: expected .key, spec. pairs"),
        ({"seed": -1}, "seed: expected a non-negative integer"),
        ({"executor": "threads"}, "executor: expected None, a concurrent.futures.Executor"),
    ],
)
def test_bad_arguments_are_refused_by_name(kwargs, message):
    args = {"tasks": TASKS[:2]} | kwargs
    with pytest.raises(InvalidArgument, match=message):
        parallel.run_tasks(parallel_tasks.draw, **args)


def test_a_result_that_is_not_json_is_refused_naming_the_task():
    with pytest.raises(InvalidArgument, match="task 'a': expected a JSON result"):
        parallel.run_tasks(lambda spec, seed: {1j}, [("a", 0)])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"workers": -1}, "workers: expected an integer >= 0"),
        ({"scheduler": ""}, "scheduler: expected 'local' or a scheduler address"),
    ],
)
def test_bad_executor_options_are_refused_by_name(kwargs, message):
    with pytest.raises(InvalidArgument, match=message), parallel.executor_for(**kwargs):
        pass


def test_a_scheduler_address_dask_cannot_read_is_refused_by_name():
    pytest.importorskip("distributed", reason="the dask extra is not installed")
    message = (
        r"^scheduler: expected 'local' or the address of a running Dask scheduler "
        r"\(tcp://host:8786\), got 'nowhere' \(ValueError: "
    )
    with pytest.raises(InvalidArgument, match=message), parallel.executor_for(scheduler="nowhere"):
        pass


def test_the_default_executor_spawns():
    with parallel.default_executor(1) as pool:
        assert pool._mp_context is multiprocessing.get_context("spawn")
    with pytest.raises(InvalidArgument, match="max_workers"):
        parallel.default_executor(0)


# -- the sweeps on a spawned pool of 2 workers and on Dask with 2 workers (the slow tier) --

REPORT = {
    "samples": 1,
    "presets": ["fp32", "bf16"],
    "lengths": [8],
    "d_k": 8,
    "masks": ["causal"],
    "heads": {"d_model": 8, "num_heads": [1, 2], "length": 8},
    "mask_constants": {"formats": ["float32"], "n_keys": 8},
    "variants": {"length": 8, "heads": 2, "kv_heads": 1, "window": 3, "sink": 2.0},
    "backward": {"length": 8, "block": 4},
}
SEARCH = {"q_len": 2, "kv_len": 4, "d_k": 4}


@pytest.fixture(scope="module")
def pool():
    with parallel.default_executor(2) as executor:
        yield executor


@pytest.fixture(scope="module")
def dask_client():
    distributed = pytest.importorskip("distributed", reason="the dask extra is not installed")
    with (
        distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address="127.0.0.1:0"
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        yield client


def test_tasks_give_the_same_results_on_a_pool_and_on_dask(pool, dask_client):
    want = expected()
    assert parallel.run_tasks(parallel_tasks.draw, TASKS, seed=5, executor=pool) == want
    assert parallel.run_tasks(parallel_tasks.draw, TASKS, seed=5, executor=dask_client) == want


def test_the_report_grid_is_the_same_wherever_its_cells_run(pool, dask_client, tmp_path):
    from mhanum.report import _compute, load_config

    config = load_config(REPORT)
    here = json.dumps(_compute.compute(config))
    assert json.dumps(_compute.compute(config, executor=pool)) == here
    journal = tmp_path / "report.jsonl"
    on_dask = _compute.compute(config, executor=dask_client, journal=journal)
    assert json.dumps(on_dask) == here
    cells = len(journal.read_text().splitlines()) - 1
    assert cells == 1 + 2 + 7 + 2  # attention, heads, variants, backward
    assert json.dumps(_compute.compute(config, journal=journal)) == here  # all read back


def test_a_search_campaign_is_the_same_wherever_its_searches_run(pool, dask_client):
    from mhanum import search

    def key(cases):
        volatile = {"seconds"}
        return json.dumps(
            [
                [
                    {k: v for k, v in c.summary().items() if k not in volatile},
                    c.seed,
                    c.q.tobytes().hex(),
                    c.k.tobytes().hex(),
                    c.v.tobytes().hex(),
                ]
                for c in cases
            ]
        )

    args = (["fp32", "bf16"], SEARCH)
    here = search.campaign(*args, runs=2, seed=3, budget=6)
    assert len({c.seed for c in here}) == 4
    assert key(search.campaign(*args, runs=2, seed=3, budget=6, executor=pool)) == key(here)
    on_dask = search.campaign(*args, runs=2, seed=3, budget=6, executor=dask_client)
    assert key(on_dask) == key(here)
    single = search.worst_case("bf16", SEARCH, seed=here[3].seed, budget=6)
    assert single.ratio == here[3].ratio
    assert (single.q == here[3].q).all()


def test_device_references_on_dask_give_the_same_records(dask_client):
    from mhanum import devices

    grid = devices.Grid(
        shapes=((1, 1, 8, 4),),
        dtypes=("float32",),
        structures=("normal", "cancel"),
        masks=("causal",),
        precisions=("default",),
        implementations=("mhanum",),
        presets=("fp32",),
        exp=False,
    )

    def without_timings(records):
        return json.dumps([{k: v for k, v in r.items() if k != "timing_s"} for r in records])

    here = devices.measure(grid, "cpu", workers=0)
    assert len(here) == 2
    on_dask = devices.measure(grid, "cpu", executor=dask_client)
    assert without_timings(on_dask) == without_timings(here)
    with pytest.raises(InvalidArgument, match="workers: expected None with an executor"):
        devices.measure(grid, "cpu", workers=2, executor=dask_client)


def test_the_command_names_an_unreadable_journal(tmp_path, capsys):
    from mhanum import cli

    _partial(tmp_path / "a.jsonl", ["t0"], expected())
    headless = tmp_path / "b.jsonl"
    header = json.loads((tmp_path / "a.jsonl").read_text().splitlines()[0])
    headless.write_text(json.dumps({k: v for k, v in header.items() if k != "tasks"}) + "\n")
    for bad, what in ((headless, "line 1: expected the header's tasks"), (tmp_path / "c", "no")):
        sources = [str(tmp_path / "a.jsonl"), str(bad)]
        assert cli.main(["merge-journals", *sources, "-o", str(tmp_path / "m.jsonl")]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"mhanum merge-journals: {bad}: {what}")
        assert err.count("\n") == 1
    assert not (tmp_path / "m.jsonl").exists()


def test_a_search_journal_whose_case_was_edited_is_refused_naming_the_line(tmp_path, capsys):
    from mhanum import cli

    journal = tmp_path / "j.jsonl"
    args = ["search", "--runs", "2", "--budget", "2", "--q-len", "2", "--kv-len", "4", "--d-k",
            "4", "--journal", str(journal), "--out", str(tmp_path / "cases"),
            "--force"]  # fmt: skip
    assert cli.main(args) == 0
    capsys.readouterr()
    lines = journal.read_text().splitlines(keepends=True)
    entry = json.loads(lines[1])
    q = entry["result"]["q"]
    q[0][0][0][0] = float(np.nextafter(q[0][0][0][0], np.inf))
    journal.write_text("".join([lines[0], json.dumps(entry) + "\n", *lines[2:]]))
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mhanum search: {journal}: line 2: expected the result of task ")
    assert "q does not match the digest saved with the case (edited or corrupt)" in err
    del entry["result"]["q"]
    journal.write_text("".join([lines[0], json.dumps(entry) + "\n", *lines[2:]]))
    assert cli.main(args) == 2
    assert "got one without the field 'q'" in capsys.readouterr().err
    assert set(entry["result"]["inputs_sha256"]) == {"q", "k", "v"}
