"""What the benches share: servers of their own (tests/support/services.py), batchwork processes, a CPU meter,
rows read back, the seeded corpus and printed tables. A bench never touches a server it did not start, and
imports worker modules only once ``stack`` has set BATCHWORK_* (settings are read once).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, NamedTuple

from sqlalchemy import Engine, create_engine, text

from tests.support.processes import ROOT, Process, batchwork_command
from tests.support.services import PostgresServer, RedisServer

POLL_S = 0.02  # a phase's end is seen within 20 ms
# Celery logs "celery@host ready." right before its consumer loop; `batchwork api` logs uvicorn's line.
CELERY_READY, UVICORN_READY = r"@\S+ ready\.", "Uvicorn running on"
PROBLEM = re.compile(r": (WARNING|ERROR|CRITICAL)/|Traceback|Error:")
_started: list[Process] = []
_servers: dict[str, int] = {}  # the stack's redis-server and postmaster pids, for CpuMeter


@dataclass
class Stack:
    broker_url: str
    database_url: str
    db: Engine

    def env(self, **settings: Any) -> dict[str, str]:
        """A child's environment on these servers, with none of the caller's BATCHWORK_ settings."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("BATCHWORK_", "BENCH_"))}
        env.update(HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", **self.urls())
        env["BATCHWORK_METRICS_PORT"] = "0"  # several workers on one host (and other benches beside them)
        for name, value in settings.items():
            key = name if name.startswith("BENCH_") else f"BATCHWORK_{name.upper()}"
            env[key] = value if isinstance(value, str) else json.dumps(value)
        return env

    def urls(self) -> dict[str, str]:  # BENCH_*: bench/baselines.py's
        urls = {"BROKER_URL": self.broker_url, "DATABASE_URL": self.database_url}
        return {f"{prefix}_{k}": v for prefix in ("BATCHWORK", "BENCH") for k, v in urls.items()}

    def truncate(self, *tables: str) -> None:
        with self.db.begin() as conn:
            conn.execute(text(f"TRUNCATE {', '.join(tables or ('results', 'jobs', 'batches'))}"))


@contextmanager
def stack() -> Iterator[Stack]:
    """A redis-server and a migrated PostgreSQL of the run's own; processes started meanwhile stop with it."""
    settings = sys.modules.get("worker.settings")
    if settings is not None and settings.get_settings.cache_info().currsize:
        raise RuntimeError("worker settings were read before the bench set BATCHWORK_* (they are read once)")
    signal.signal(signal.SIGTERM, _interrupt)
    with RedisServer() as redis_server, PostgresServer() as postgres:
        found = Stack(f"{redis_server.url}/0", postgres.url, create_engine(postgres.url))
        for name in [k for k in os.environ if k.startswith(("BATCHWORK_", "BENCH_"))]:
            del os.environ[name]
        os.environ.update(found.urls())
        from worker.store.schema import migrate

        migrate(found.database_url)
        assert redis_server.proc is not None and postgres.proc is not None
        _servers.update(redis=redis_server.proc.pid, postgres=postgres.proc.pid)
        try:
            yield found
        finally:
            _servers.clear()
            while _started:
                _started.pop().stop(timeout_s=10)
            found.db.dispose()
            if "worker.store.results" in sys.modules:
                sys.modules["worker.store.results"].ResultStore.for_url(found.database_url).close()


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def start(argv: Sequence[str], env: dict[str, str], name: str, ready: str) -> Process:
    """A process in its own group (tests/support/processes.py) that the stack stops when it ends."""
    _started.append(proc := Process(argv, env, ready, name))
    return proc


def python(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def worker(found: Stack, name: str, *, extra: Sequence[str] = (), **settings: Any) -> Process:
    """`batchwork worker` on the stack, with BATCHWORK_* ``settings`` (and ``extra``: NAME=VALUE pairs)."""
    env = found.env(**settings)
    env.update({f"BATCHWORK_{k.upper()}": v for k, v in (pair.split("=", 1) for pair in extra)})
    return start(batchwork_command("worker", "--loglevel=INFO", "--hostname", f"{name}@bench"), env, name,
                 CELERY_READY)  # fmt: skip


def api(found: Stack, port: int, **settings: Any) -> Process:
    return start(batchwork_command("api", "--port", str(port)), found.env(**settings), "api", UVICORN_READY)


def print_problems(procs: Sequence[Process], limit: int = 20) -> None:
    """Each process's log lines at WARNING or above and traceback lines (not Celery's bare stderr lines)."""
    for proc in procs:
        lines = [line for line in proc.log if PROBLEM.search(line)
                 and not (line.rstrip().endswith("]") and line.lstrip().startswith("["))]  # fmt: skip
        print(f"  {proc.name}: {len(lines)} warning/error lines" + (":" if lines else ""))
        for line in lines[:limit]:
            print(f"    {line[:300]}")


Request = tuple[str, str, bytes | None, dict[str, str]]  # method, path, body, headers


def http_clients(
    port: int, clients: int, calls: int, request: Callable[[int, int], Request], warm: bool = False
) -> tuple[list[float], float, float]:
    """``clients`` threads, each one keep-alive connection sending ``request(client, i)`` for i < ``calls``,
    started together (``warm``: after one untimed ``request(client, -1)`` each). The stdlib client: httpx's
    pool spent more CPU per request than the API itself. Sorted latencies, wall time, epoch start."""
    start = threading.Barrier(clients + 1)

    def client(number: int) -> list[float]:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)

        def send(i: int) -> float:
            began = time.perf_counter()
            connection.request(*request(number, i))
            answer = connection.getresponse()
            body = answer.read()
            if answer.status != 200:
                raise RuntimeError(f"{request(number, i)[1]} answered {answer.status}: {body[:200]!r}")
            return time.perf_counter() - began

        if warm:
            send(-1)
        start.wait()
        spent = [send(i) for i in range(calls)]
        connection.close()
        return spent

    with ThreadPoolExecutor(clients) as pool:
        futures = [pool.submit(client, number) for number in range(clients)]
        start.wait()
        started, began = time.time(), time.perf_counter()
        latencies = sorted(latency for future in futures for latency in future.result())
    return latencies, time.perf_counter() - began, started


class WholeRun(NamedTuple):
    """A command run to its end: its wall and CPU seconds (user + system, its threads and the children it
    waited for), its own peak RSS, its exit code and what it wrote to stderr."""

    wall_s: float
    cpu_s: float
    peak_rss_mb: float
    returncode: int
    stderr: str


def whole_run(command: Sequence[str], env: dict[str, str], cwd: Path = ROOT) -> WholeRun:
    started = time.monotonic()
    proc = subprocess.Popen(
        list(command), cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    assert proc.stderr is not None
    stderr = proc.stderr.read().decode(errors="replace")
    _, status, usage = os.wait4(proc.pid, 0)  # the child's own figures, not this process's other children
    wall = time.monotonic() - started
    cpu = usage.ru_utime + usage.ru_stime
    return WholeRun(wall, cpu, usage.ru_maxrss / 1024, os.waitstatus_to_exitcode(status), stderr)


class CpuMeter:
    """CPU used while a block runs, in cores: by this process (bench), the given process groups (workers),
    everyone else (others: the machine less those two) and of those others redis-server, postgres, rest."""

    def __init__(self, *procs: Process) -> None:
        self.procs, self.cores, self.seconds = procs, dict[str, float](), dict[str, float]()

    def _sample(self) -> dict[str, float]:
        return {"bench": time.process_time(), "workers": sum(group_cpu_s(p.pid) for p in self.procs),
                "machine": machine_busy_s(), "redis": server_cpu_s("redis"),
                "postgres": server_cpu_s("postgres")}  # fmt: skip

    def __enter__(self) -> CpuMeter:
        self._wall, self._before = time.monotonic(), self._sample()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.monotonic() - self._wall
        used = {key: value - self._before[key] for key, value in self._sample().items()}
        used["others"] = used.pop("machine") - used["bench"] - used["workers"]
        used["rest"] = used["others"] - used["redis"] - used["postgres"]
        self.seconds, self.cores = used, {key: value / wall for key, value in used.items()}


def machine_busy_s() -> float:
    """Busy CPU seconds of the whole machine so far (user, nice, system, irq, softirq, steal)."""
    with open("/proc/stat") as stat:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, stat.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def group_cpu_s(pgid: int) -> float:
    """CPU seconds so far of the live processes of one process group (a worker and its pool)."""
    return _cpu_s(lambda pid, fields: int(fields[2]) == pgid)


def server_cpu_s(name: str) -> float:
    """CPU seconds so far of the stack's own redis-server or postmaster and its backends, never another's."""
    server = _servers.get(name, -1)
    return _cpu_s(lambda pid, fields: server in (pid, int(fields[1])))


def _cpu_s(counts: Callable[[int, list[str]], bool]) -> float:
    total = 0
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rpartition(")")[2].split()  # state, ppid, pgrp, ..., utime 11, stime 12
        except OSError:
            continue
        if counts(int(entry), fields):
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def arguments(doc: str | None, *, quick: str = "", seed: int | None = None, services: bool = False,
              timeout_s: float = 300) -> argparse.ArgumentParser:  # fmt: skip
    """The flags every bench spells alike: ``--quick`` (its help says what shrinks), ``--seed``, and for a
    bench with servers ``--timeout-s`` and ``--worker-setting``; the module's docstring is the help."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if quick:
        p.add_argument("--quick", action="store_true", help=quick)
    if seed is not None:
        p.add_argument("--seed", type=int, default=seed)
    if services:
        p.add_argument("--timeout-s", type=float, default=timeout_s, help="give up on a phase after this")
        p.add_argument("--worker-setting", action="append", default=[], metavar="NAME=VALUE",
                       help="extra BATCHWORK_NAME=VALUE for every batchwork worker (repeatable)")  # fmt: skip
    return p


def header(name: str, args: object) -> None:
    """The command, its knobs and how busy the machine was before it started (figures are side by side)."""
    before = machine_busy_s()
    time.sleep(1)
    busy = machine_busy_s() - before
    print(f"{name} {' '.join(sys.argv[1:]) or '(defaults)'}  [{time.strftime('%Y-%m-%d %H:%M:%S')}]")
    print("knobs: " + ", ".join(f"{k}={v}" for k, v in sorted(vars(args).items())))
    print(f"machine busy before start: {busy:.2f} of {os.cpu_count()} cores; load {os.getloadavg()[0]:.1f}")


def epoch(value: datetime | None) -> float:
    return float("nan") if value is None else value.timestamp()


class Rows(NamedTuple):
    """A results table's row count, first and last write times, and the rate of the rows after the first."""

    count: int
    first: float
    last: float
    commit_rate: float


def wait_rows(found: Stack, table: str, total: int, timeout_s: float) -> Rows:
    """Polls until ``total`` rows are stored (or the timeout), then reads their write times."""
    deadline = time.monotonic() + timeout_s
    while True:
        with found.db.connect() as conn:
            count = conn.execute(text(f"SELECT count(*) FROM {table}")).scalar_one()
        if count >= total or time.monotonic() > deadline:
            break
        time.sleep(POLL_S)
    query = text(f"SELECT count(*), min(created_at), max(created_at), count(*) FILTER (WHERE created_at > "
                 f"(SELECT min(created_at) FROM {table})) FROM {table}")  # fmt: skip
    with found.db.connect() as conn:
        count, first, last, after = conn.execute(query).one()
    if count < total:
        print(f"  !! timed out after {timeout_s:.0f} s with {count}/{total} rows in {table}")
    span = epoch(last) - epoch(first)
    return Rows(count, epoch(first), epoch(last), after / span if span > 0 else float("nan"))


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


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if a == a and b == b and b > 0 else "n/a"


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """First column left-aligned, the rest right-aligned; floats as 1,234 or 3 significant digits."""
    cells = [[_cell(value) for value in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    for row in [list(headers), ["-" * w for w in widths], *cells]:
        padded = [c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        print("  " + "  ".join(padded))


def _cell(value: object) -> str:
    if not isinstance(value, float):
        return str(value)
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"
