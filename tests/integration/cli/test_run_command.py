"""`batchwork run` end to end: Ctrl-C leaves the output file and the store in agreement, on the embedded run
and on a distributed one (Redis, PostgreSQL, a worker process); a second Ctrl-C exits at once; a run killed
outright continues the same job when started again; output paths are checked before any work."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.processes import ROOT, service_env, wait_until, workers
from worker.store.results import ResultStore

EXAMPLE = ROOT / "examples" / "docs.jsonl"
# 200 items at 4 per batch and 200 ms a batch: about 10 s of work, so a Ctrl-C lands mid-job.
SLOW = {
    "SIMULATED_BASE_MS": "200",
    "SIMULATED_PER_ITEM_MS": "0",
    "BATCHING": json.dumps({"simulated": {"max_batch_size": 4, "max_wait_ms": 5}}),
}


def embedded_env(**settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHWORK_")}
    env.update(PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    env.update({f"BATCHWORK_{name}": value for name, value in settings.items()})
    return env


def write_input(path: Path, count: int) -> None:
    path.write_text("".join(json.dumps({"id": f"d{i}", "text": f"text {i}"}) + "\n" for i in range(count)))


class Run:
    """`batchwork run` in a subprocess, its standard error in a file (read while it runs)."""

    def __init__(self, cwd: Path, env: dict[str, str], *args: str) -> None:
        self.err = cwd / f"run-{time.monotonic_ns()}.err"
        with self.err.open("wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "worker.cli", "run", *args],
                cwd=cwd,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=err,
            )

    @property
    def stderr(self) -> str:
        return self.err.read_text(errors="replace")

    def job_id(self, timeout_s: float = 120) -> str:
        line = wait_until(
            lambda: next((x for x in self.stderr.splitlines() if x.startswith("job ")), None),
            timeout_s,
            lambda: f"the run never started its job:\n{self.stderr}",
        )
        return line.split()[1].rstrip(":")

    def wait(self, timeout_s: float = 120) -> int:
        try:
            return self.proc.wait(timeout_s)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


def read_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def wait_for_progress(store: ResultStore, job_id: str, done: int) -> None:
    wait_until(
        lambda: (status := store.status(job_id)) is not None and status.done >= done,
        120,
        lambda: f"job {job_id} never reached {done} done: {store.status(job_id)}",
    )


def assert_file_and_store_agree(out: Path, store: ResultStore, job_id: str, total: int) -> Counter[str]:
    """Every input has one line, in order, saying what the store says of it; the job's counts add up."""
    lines = read_lines(out)
    assert [line["index"] for line in lines] == list(range(total))
    assert [line["id"] for line in lines] == [f"d{i}" for i in range(total)]
    rows = list(store.results(job_id))
    assert [row.index for row in rows] == list(range(total)), "an item has no row in the store"
    for line, row in zip(lines, rows, strict=True):
        assert (line.get("output"), line.get("error"), line["id"]) == (row.output, row.error, row.item_id)
    status = store.status(job_id)
    assert status is not None and status.state == "cancelled"
    outcomes = Counter("output" if "output" in line else line["error"] for line in lines)
    assert status.done == outcomes["output"] and status.done + status.failed == total
    assert set(outcomes) <= {"output", "cancelled"}
    return outcomes


def interrupt(run: Run, store: ResultStore) -> str:
    job_id = run.job_id()
    wait_for_progress(store, job_id, 4)  # some items finished, most wait
    run.proc.send_signal(signal.SIGINT)
    assert run.wait(120) == 130, run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    return job_id


@pytest.fixture
def sqlite_store(tmp_path: Path) -> Iterator[ResultStore]:
    store = ResultStore.from_url(f"sqlite:///{tmp_path / 'batchwork.db'}")
    yield store
    store.close()


@pytest.mark.slow
def test_ctrl_c_on_the_embedded_run_leaves_file_and_store_in_agreement(
    tmp_path: Path, sqlite_store: ResultStore
) -> None:
    write_input(tmp_path / "in.jsonl", 200)
    run = Run(tmp_path, embedded_env(**SLOW), "in.jsonl", "-m", "simulated", "-o", "out.jsonl")
    job_id = interrupt(run, sqlite_store)
    outcomes = assert_file_and_store_agree(tmp_path / "out.jsonl", sqlite_store, job_id, 200)
    assert outcomes["output"] >= 4 and outcomes["cancelled"] > 0
    assert not list(tmp_path.glob(".out.jsonl*"))  # no state file: a cancelled run is not continued


@pytest.mark.slow
def test_ctrl_c_on_a_distributed_run_leaves_file_and_store_in_agreement(
    tmp_path: Path, redis_url: str, pg_url: str, pg_store: ResultStore
) -> None:
    env = service_env(redis_url, pg_url, **{k.lower(): v for k, v in SLOW.items()})
    write_input(tmp_path / "in.jsonl", 200)
    with workers(env):
        run = Run(tmp_path, env, "in.jsonl", "-m", "simulated", "-o", "out.jsonl")
        job_id = interrupt(run, pg_store)
        outcomes = assert_file_and_store_agree(tmp_path / "out.jsonl", pg_store, job_id, 200)
        assert outcomes["output"] >= 4 and outcomes["cancelled"] > 0
        time.sleep(2)  # the worker finds the job cancelled (once a second) and drops what it held
        assert_file_and_store_agree(tmp_path / "out.jsonl", pg_store, job_id, 200)  # still so


@pytest.mark.slow
def test_a_second_ctrl_c_exits_at_once_and_cleanly(tmp_path: Path, sqlite_store: ResultStore) -> None:
    write_input(tmp_path / "in.jsonl", 200)
    run = Run(tmp_path, embedded_env(**SLOW), "in.jsonl", "-m", "simulated", "-o", "out.jsonl")
    wait_for_progress(sqlite_store, run.job_id(), 1)
    run.proc.send_signal(signal.SIGINT)
    time.sleep(0.05)
    run.proc.send_signal(signal.SIGINT)
    sent = time.monotonic()
    assert run.wait(30) == 130, run.stderr
    assert time.monotonic() - sent < 5, run.stderr
    assert "Traceback" not in run.stderr and "Exception ignored" not in run.stderr, run.stderr


@pytest.mark.slow
def test_a_killed_run_continues_its_job_and_writes_every_line_once(
    tmp_path: Path, sqlite_store: ResultStore
) -> None:
    total = 3000
    write_input(tmp_path / "in.jsonl", total)
    env = embedded_env(
        SIMULATED_BASE_MS="20",
        SIMULATED_PER_ITEM_MS="0",
        BATCHING=json.dumps({"simulated": {"max_batch_size": 16, "max_wait_ms": 5}}),
    )
    args = ("in.jsonl", "-m", "simulated", "-o", "out.jsonl")
    first = Run(tmp_path, env, *args)
    job_id = first.job_id()
    wait_for_progress(sqlite_store, job_id, 300)
    first.proc.kill()  # SIGKILL: nothing of the run's own gets to clean up
    first.wait()
    done_before = sqlite_store.status(job_id).done  # type: ignore[union-attr]
    assert done_before < total

    second = Run(tmp_path, env, *args)
    assert second.wait(300) == 0, second.stderr
    assert f"continuing job {job_id}" in second.stderr
    lines = read_lines(tmp_path / "out.jsonl")
    assert [line["index"] for line in lines] == list(range(total))
    assert [line["id"] for line in lines] == [f"d{i}" for i in range(total)]
    assert all(line["output"] is not None for line in lines)
    status = sqlite_store.status(job_id)
    assert status is not None and (status.state, status.done, status.failed) == ("succeeded", total, 0)
    assert not list(tmp_path.glob(".out.jsonl*"))

    again = Run(tmp_path, env, *args, "--restart")  # a finished run leaves nothing to continue anyway
    assert again.wait(300) == 0, again.stderr
    assert again.job_id() != job_id and "continuing" not in again.stderr


def test_a_restarted_run_cancels_the_job_its_killed_run_left(
    tmp_path: Path, sqlite_store: ResultStore
) -> None:
    write_input(tmp_path / "in.jsonl", 200)
    args = ("in.jsonl", "-m", "simulated", "-o", "out.jsonl")
    first = Run(tmp_path, embedded_env(**SLOW), *args)
    job_id = first.job_id()
    wait_for_progress(sqlite_store, job_id, 1)
    first.proc.kill()
    first.wait()
    again = Run(tmp_path, embedded_env(), *args, "--restart")
    assert again.wait(300) == 0, again.stderr
    assert f"cancelled job {job_id} of the earlier run" in again.stderr
    assert again.job_id() != job_id
    left = sqlite_store.status(job_id)
    assert left is not None and left.state == "cancelled"  # not running for good


@pytest.mark.slow
def test_a_killed_distributed_run_does_not_resubmit_what_was_accepted(
    tmp_path: Path, redis_url: str, pg_url: str, pg_store: ResultStore
) -> None:
    total = 1500
    env = service_env(
        redis_url,
        pg_url,
        simulated_base_ms="20",
        simulated_per_item_ms="0",
        batching={"simulated": {"max_batch_size": 16, "max_wait_ms": 5}},
    )
    write_input(tmp_path / "in.jsonl", total)
    args = ("in.jsonl", "-m", "simulated", "-o", "out.jsonl")
    with workers(env):
        first = Run(tmp_path, env, *args)
        job_id = first.job_id()
        wait_for_progress(pg_store, job_id, 100)
        first.proc.kill()
        first.wait()
        second = Run(tmp_path, env, *args)
        assert second.wait(300) == 0, second.stderr
    assert f"continuing job {job_id}" in second.stderr
    lines = read_lines(tmp_path / "out.jsonl")
    assert [(line["index"], line["id"]) for line in lines] == [(i, f"d{i}") for i in range(total)]
    status = pg_store.status(job_id)
    assert status is not None and (status.state, status.done, status.total) == ("succeeded", total, total)


@pytest.mark.parametrize(
    ("output", "fragment"),
    [
        ("/proc/x.jsonl", "/proc/x.jsonl: cannot write in the folder /proc"),
        (".", "is a folder, not a file"),
        ("no/such/out.jsonl", "the folder no/such does not exist"),
        # Replaced by a file once written, as /dev/null would be (a FIFO here: the test's own).
        ("out.fifo", "out.fifo: is not a regular file; leave -o out to write to standard output"),
    ],
)
def test_an_output_path_that_cannot_be_written_is_refused_before_any_work(
    tmp_path: Path, output: str, fragment: str
) -> None:
    if output.endswith(".fifo"):
        os.mkfifo(tmp_path / output)
    done = subprocess.run(
        [sys.executable, "-m", "worker.cli", "run", str(EXAMPLE), "-m", "noop", "-o", output],
        cwd=tmp_path,
        env=embedded_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and fragment in lines[0] and "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "batchwork.db").exists()  # nothing ran


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes in a read-only folder")
def test_a_read_only_folder_is_refused_before_any_work(tmp_path: Path) -> None:
    (tmp_path / "ro").mkdir(mode=0o555)
    done = subprocess.run(
        [sys.executable, "-m", "worker.cli", "run", str(EXAMPLE), "-m", "noop", "-o", "ro/out.jsonl"],
        cwd=tmp_path,
        env=embedded_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "ro/out.jsonl: cannot write in the folder ro" in done.stderr


def test_dash_writes_the_results_to_standard_output(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "worker.cli", "run", str(EXAMPLE), "-m", "noop", "-o", "-"],
        cwd=tmp_path,
        env=embedded_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [line["index"] for line in lines] == list(range(20)) and all(line["output"] == 0 for line in lines)
    assert "succeeded: 20 done" in done.stderr and "index" not in done.stderr
    assert not (tmp_path / "-").exists()
