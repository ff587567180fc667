"""What the benches share: a Redis and a PostgreSQL of the bench's own (tests/support/services.py, as the
integration tests start them), batchwork processes, CPU meters, result rows read back, printed tables.

A bench never touches a server it did not start. Worker modules are imported only once ``stack`` has
pointed this process's BATCHWORK_* settings at those servers (settings are read once).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import redis
from sqlalchemy import Engine, create_engine, text

from tests.support.services import PostgresServer, RedisServer

ROOT = Path(__file__).resolve().parents[1]
POLL_S = 0.02  # a phase's end is seen within 20 ms
# Celery logs "celery@host ready." right before its consumer loop; `batchwork api` logs uvicorn's line.
CELERY_READY = re.compile(r"@\S+ ready\.")
UVICORN_READY = re.compile(r"Uvicorn running on")
PROBLEM = re.compile(r": (WARNING|ERROR|CRITICAL)/|Traceback|Error:")

_started: list[Proc] = []


# -- services ------------------------------------------------------------------------------------------


@dataclass
class Stack:
    broker_url: str
    database_url: str
    db: Engine
    broker: redis.Redis
    servers: dict[str, int] = field(default_factory=dict)  # "postgres", "redis": the server's pid

    def env(self, **settings: Any) -> dict[str, str]:
        """The environment of a child process on these servers: no BATCHWORK_ setting of the caller's."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("BATCHWORK_", "BENCH_"))}
        env.update(HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
        env.update(BATCHWORK_BROKER_URL=self.broker_url, BATCHWORK_DATABASE_URL=self.database_url)
        env.update(BENCH_BROKER_URL=self.broker_url, BENCH_DATABASE_URL=self.database_url)
        env["BATCHWORK_METRICS_PORT"] = "0"  # several workers on one host (and other benches beside them)
        for name, value in settings.items():
            key = name if name.startswith("BENCH_") else f"BATCHWORK_{name.upper()}"
            env[key] = value if isinstance(value, str) else json.dumps(value)
        return env

    def truncate(self, *tables: str) -> None:
        with self.db.begin() as conn:
            conn.execute(text(f"TRUNCATE {', '.join(tables or ('results', 'jobs', 'batches'))}"))


@contextmanager
def stack() -> Iterator[Stack]:
    """A redis-server and a migrated PostgreSQL of this run's own; workers started meanwhile stop with it."""
    settings = sys.modules.get("worker.settings")
    if settings is not None and settings.get_settings.cache_info().currsize:
        raise RuntimeError("worker settings were read before the bench set BATCHWORK_* (they are read once)")
    signal.signal(signal.SIGTERM, _interrupt)
    with RedisServer() as redis_server, PostgresServer() as postgres:
        broker_url = f"{redis_server.url}/0"
        found = Stack(broker_url, postgres.url, create_engine(postgres.url), redis.Redis.from_url(broker_url))
        for name, server in (("postgres", postgres), ("redis", redis_server)):
            if server.proc is not None:
                found.servers[name] = server.proc.pid
        for name in [k for k in os.environ if k.startswith(("BATCHWORK_", "BENCH_"))]:
            del os.environ[name]
        os.environ.update(BATCHWORK_BROKER_URL=found.broker_url, BATCHWORK_DATABASE_URL=found.database_url)
        os.environ.update(BENCH_BROKER_URL=found.broker_url, BENCH_DATABASE_URL=found.database_url)
        from worker.store.schema import migrate

        migrate(found.database_url)
        try:
            yield found
        finally:
            for proc in list(_started):
                proc.stop(timeout_s=10)
            found.db.dispose()
            if "worker.store.results" in sys.modules:
                sys.modules["worker.store.results"].ResultStore.for_url(found.database_url).close()


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


# -- processes -----------------------------------------------------------------------------------------


class Proc:
    """A command in its own process group (stopping it stops a prefork pool too); its log lines are kept
    and the wall time of its ready line noted."""

    def __init__(self, argv: Sequence[str], env: dict[str, str], name: str, ready: re.Pattern[str]):
        self.name, self.ready_at, self.log = name, 0.0, list[str]()
        self._ready_line, self._ready = ready, threading.Event()
        self.proc = subprocess.Popen(
            list(argv), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )  # fmt: skip
        _started.append(self)
        threading.Thread(target=self._read, name=f"log-{name}", daemon=True).start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.append(line.rstrip())
            if not self._ready.is_set() and self._ready_line.search(line):
                self.ready_at = time.time()
                self._ready.set()

    def wait_ready(self, timeout_s: float = 120) -> float:
        """Wall time of the ready line; RuntimeError with the log's tail if it never comes."""
        deadline = time.monotonic() + timeout_s
        while not self._ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = "\n".join(self.log[-30:])
                raise RuntimeError(f"{self.name} did not start (exit {self.proc.poll()}):\n{tail}")
        return self.ready_at

    def problems(self) -> list[str]:
        """Log lines at WARNING or above, and traceback lines (not Celery's bare stderr lines)."""
        return [
            line for line in self.log
            if PROBLEM.search(line) and not (line.rstrip().endswith("]") and line.lstrip().startswith("["))
        ]  # fmt: skip

    def stop(self, timeout_s: float = 30) -> None:
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.proc.wait()
        self._signal(signal.SIGKILL)  # prefork children may outlive their parent by a moment
        if self in _started:
            _started.remove(self)

    def _signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signum)


def python(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def worker(found: Stack, name: str, *, extra: Sequence[str] = (), **settings: Any) -> Proc:
    """`batchwork worker` on the stack, with BATCHWORK_* ``settings`` (and ``extra``: NAME=VALUE pairs)."""
    env = found.env(**settings)
    env.update({f"BATCHWORK_{k.upper()}": v for k, v in (pair.split("=", 1) for pair in extra)})
    return Proc(python("worker.cli", "worker", "--loglevel=INFO", "--hostname", f"{name}@bench"), env, name,
                CELERY_READY)  # fmt: skip


def api(found: Stack, port: int, **settings: Any) -> Proc:
    return Proc(python("worker.cli", "api", "--port", str(port)), found.env(**settings), "api", UVICORN_READY)


def print_problems(procs: Sequence[Proc], limit: int = 20) -> None:
    for proc in procs:
        lines = proc.problems()
        print(f"  {proc.name}: {len(lines)} warning/error lines" + (":" if lines else ""))
        for line in lines[:limit]:
            print(f"    {line[:300]}")


# -- CPU -----------------------------------------------------------------------------------------------


class CpuMeter:
    """CPU used while a block runs, in cores: by this process, by the given process groups, and by everyone
    else (the whole machine less those two: PostgreSQL, Redis, and on a shared box the noise)."""

    def __init__(self, *procs: Proc, servers: dict[str, int] | None = None) -> None:
        self.procs, self.cores, self.seconds = procs, dict[str, float](), dict[str, float]()
        self.servers = servers or {}  # also counted apart (and out of "others"): a server's process tree

    def __enter__(self) -> CpuMeter:
        self._wall, self._own, self._machine = time.monotonic(), time.process_time(), machine_busy_s()
        self._groups = sum(group_cpu_s(p.pid) for p in self.procs)
        self._servers = {name: tree_cpu_s(pid) for name, pid in self.servers.items()}
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.monotonic() - self._wall
        own = time.process_time() - self._own
        groups = sum(group_cpu_s(p.pid) for p in self.procs) - self._groups
        servers = {name: tree_cpu_s(pid) - self._servers[name] for name, pid in self.servers.items()}
        machine = machine_busy_s() - self._machine
        others = machine - own - groups - sum(servers.values())
        self.seconds = {"bench": own, "workers": groups, **servers, "others": others}
        self.cores = {key: value / wall for key, value in self.seconds.items()}


def machine_busy_s() -> float:
    """Busy CPU seconds of the whole machine so far (user, nice, system, irq, softirq, steal)."""
    with open("/proc/stat") as stat:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, stat.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def group_cpu_s(pgid: int) -> float:
    """CPU seconds so far of the live processes of one process group (a worker and its pool)."""
    return _cpu_s(lambda name, fields: int(fields[2]) == pgid)


def tree_cpu_s(pid: int) -> float:
    """CPU seconds so far of a server and its children (PostgreSQL's backends)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rpartition(")")[2].split()
        own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        own = 0.0
    return own + _cpu_s(lambda name, fields: int(fields[1]) == pid)


def named_cpu_s(command: str) -> float:
    return _cpu_s(lambda name, fields: name.startswith(command))


def _cpu_s(counts: Callable[[str, list[str]], bool]) -> float:
    total = 0
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                name, _, rest = stat.read().partition(" (")[2].rpartition(")")
        except OSError:
            continue
        fields = rest.split()  # state, ppid, pgrp, ..., utime at 11, stime at 12
        if counts(name, fields):
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def header(name: str, args: object) -> None:
    """The command, its knobs and how busy the machine was before it started (figures are side by side)."""
    before = machine_busy_s()
    time.sleep(1)
    busy = machine_busy_s() - before
    print(f"{name} {' '.join(sys.argv[1:]) or '(defaults)'}  [{time.strftime('%Y-%m-%d %H:%M:%S')}]")
    print("knobs: " + ", ".join(f"{k}={v}" for k, v in sorted(vars(args).items())))
    print(f"machine busy before start: {busy:.2f} of {os.cpu_count()} cores; load {os.getloadavg()[0]:.1f}")


# -- rows and jobs -------------------------------------------------------------------------------------


def epoch(value: datetime | None) -> float:
    return float("nan") if value is None else value.timestamp()


@dataclass
class Rows:
    """What a results table holds: how many rows, when the first and last were written."""

    count: int
    first: float
    last: float
    after_first: int  # rows written after the first write

    def commit_rate(self) -> float:
        span = self.last - self.first
        return self.after_first / span if span > 0 else float("nan")


def wait_rows(found: Stack, table: str, total: int, timeout_s: float) -> Rows:
    """Polls until ``total`` rows are stored (or the timeout), then reads their write times."""
    deadline = time.monotonic() + timeout_s
    while True:
        with found.db.connect() as conn:
            count = conn.execute(text(f"SELECT count(*) FROM {table}")).scalar_one()
        if count >= total or time.monotonic() > deadline:
            break
        time.sleep(POLL_S)
    query = text(
        f"SELECT count(*), min(created_at), max(created_at), "
        f"count(*) FILTER (WHERE created_at > (SELECT min(created_at) FROM {table})) FROM {table}"
    )
    with found.db.connect() as conn:
        count, first, last, after = conn.execute(query).one()
    if count < total:
        print(f"  !! timed out after {timeout_s:.0f} s with {count}/{total} rows in {table}")
    return Rows(count, epoch(first), epoch(last), after)


def wait_job(job_id: str, timeout_s: float) -> Any:
    from worker.client import status
    from worker.store.values import FINISHED_STATES

    deadline = time.monotonic() + timeout_s
    while (job := status(job_id)).state not in FINISHED_STATES:
        if time.monotonic() > deadline:
            print(f"  !! job {job_id} still {job.state} after {timeout_s:.0f} s ({job.done}/{job.total})")
            return job
        time.sleep(POLL_S)
    return job


def batch_stats(found: Stack) -> tuple[int, float, float, float]:
    """Batches stored so far: count, mean size, total run_ms, padded/real tokens."""
    query = text(
        "SELECT count(*), avg(size), sum(run_ms), sum(padded_tokens)::float / nullif(sum(real_tokens), 0) "
        "FROM batches"
    )
    with found.db.connect() as conn:
        count, size, run_ms, padding = conn.execute(query).one()
    return count, float(size or 0), float(run_ms or 0), float(padding or float("nan"))


# -- checkpoints -----------------------------------------------------------------------------------------


def cached_checkpoint(name: str, build: Callable[[Path], None]) -> Path:
    """A random-weight checkpoint in the temp dir, built once by ``build(directory)`` and reused by later
    runs; built aside and renamed, so a run stopped half way never leaves one that looks whole."""
    directory = Path(tempfile.gettempdir()) / name
    if (directory / "model.safetensors").is_file():
        return directory
    building = Path(tempfile.mkdtemp(prefix=f"{name}-building-"))
    build(building)
    try:
        building.rename(directory)
    except OSError:  # another run got there first
        shutil.rmtree(building, ignore_errors=True)
    return directory


# -- inputs and tables ---------------------------------------------------------------------------------

VOCABULARY = (
    "the of and to in is was for that with as on by at from his her their it this be are an or which "
    "have has had not but were been one all new more when who will would there can about after into "
    "time year people way day man world life work part place case week company system program group "
    "number night point home water room mother area money story fact month lot right study book eye "
    "job word business issue side kind head house service friend father power hour game line end "
    "member law car city community name president team minute idea kid body information back parent "
    "face others level office door health person art war history party result change morning reason "
    "research girl guy moment air teacher force education queue batch worker model latency throughput "
    "message broker database result scheduler token embedding vector sentence GPU memory request "
    "quickly slowly often never always sometimes carefully new old good great small large long little "
    "important different public national local late early young major better economic strong possible "
    "run make take see come know get give find think tell become leave feel put bring begin keep hold "
    "write stand hear let mean set meet pay sit speak lie lead read grow lose fall send build understand"
)
WORDS = VOCABULARY.split()


def corpus(size: int, seed: int, min_words: int = 5, max_words: int = 40) -> list[str]:
    """Seeded sentences of ``min_words``-``max_words`` words with some punctuation, like short documents."""
    rng = random.Random(seed)
    sentences = []
    for _ in range(size):
        words = rng.choices(WORDS, k=rng.randint(min_words, max_words))
        for position in range(3, len(words) - 1, rng.randint(6, 12)):
            words[position] += ","
        sentences.append(" ".join(words).capitalize() + rng.choice(".?!"))
    return sentences


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))] if ordered else float("nan")


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if a == a and b == b and b > 0 else "n/a"


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """First column left-aligned, the numbers right-aligned."""
    cells = [[_cell(value) for value in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    for row in [list(headers), ["-" * w for w in widths], *cells]:
        padded = [c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        print("  " + "  ".join(padded))


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"
    return str(value)
