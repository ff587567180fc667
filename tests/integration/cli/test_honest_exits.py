"""Processes end honestly: a worker or API that cannot start exits non-zero with one line naming the cause,
settings are checked at load, and the API's checking processes die with it however it dies."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.api_server import ApiProcess
from tests.integration.cli.test_cli_mistakes import embedded_env, one_line_error
from tests.integration.processes import ROOT, batchwork, service_env, wait_until


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.parametrize("device", ["tpu", "gpu", "CUDA", "cuda:x", "cuda:-1", "cpu ", "mps:", ""])
def test_a_device_that_is_no_device_is_refused_at_load(tmp_path: Path, device: str) -> None:
    done = batchwork(tmp_path, "models", env=embedded_env(device=device), timeout_s=60)
    one_line_error(done, "bad setting BATCHWORK_DEVICE: ")


@pytest.mark.skipif(_has_cuda(), reason="this machine has CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:3", "mps"])
def test_a_worker_on_a_device_this_machine_lacks_exits_non_zero_in_one_line(
    tmp_path: Path, redis_url: str, sqlite_url: str, device: str
) -> None:
    env = service_env(redis_url, sqlite_url, device=device)
    done = batchwork(tmp_path, "worker", env=env, timeout_s=120)
    one_line_error(done, f"BATCHWORK_DEVICE={device}: ")


@pytest.mark.skipif(_has_cuda(), reason="this machine has CUDA")
def test_a_celery_worker_on_a_device_this_machine_lacks_exits_1_without_a_traceback(
    tmp_path: Path, redis_url: str, sqlite_url: str
) -> None:
    env = service_env(redis_url, sqlite_url, device="cuda")
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "worker.celery_app", "worker"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert "the worker cannot start: BATCHWORK_DEVICE=cuda: CUDA is not available" in done.stderr


@pytest.mark.skipif(_has_cuda(), reason="this machine has CUDA")
def test_the_embedded_run_names_why_its_worker_could_not_start(tmp_path: Path) -> None:
    (tmp_path / "in.jsonl").write_text('{"text": "a"}\n')
    done = batchwork(tmp_path, "run", "in.jsonl", "-m", "noop", env=embedded_env(device="cuda"))
    one_line_error(done, "the embedded worker could not start: BATCHWORK_DEVICE=cuda: CUDA is not available")


@pytest.mark.parametrize("port", ["99999", "65536", "0", "-1", "80x"])
def test_an_api_port_out_of_range_is_refused(tmp_path: Path, port: str) -> None:
    env = service_env("redis://127.0.0.1:1/0", "sqlite:///unused.db")
    done = batchwork(tmp_path, "api", "--port", port, env=env, timeout_s=60)
    one_line_error(done, "'--port'")


def test_an_api_whose_port_is_taken_exits_non_zero_in_one_line(tmp_path: Path) -> None:
    env = service_env("redis://127.0.0.1:1/0", "sqlite:///unused.db")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = batchwork(tmp_path, "api", "--port", str(port), env=env, timeout_s=60)
    one_line_error(done, f"cannot listen on 127.0.0.1:{port}: Address already in use")


def _descendants(pid: int) -> set[int]:
    """Every living process below ``pid`` (zombies are dead: only their parent's reaping is missing)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        state, parent = stat.rsplit(")", 1)[1].split()[:2]
        if state != "Z":
            children.setdefault(int(parent), []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads the process tree from /proc")
@pytest.mark.parametrize("processes", [1, 3])
def test_a_sigkilled_api_leaves_no_checking_process_alive(
    redis_url: str, pg_url: str, pg_store: object, processes: int
) -> None:
    api = ApiProcess(service_env(redis_url, pg_url, api_check_processes=str(processes)))
    try:
        api.wait_healthy()
        # Healthy means the pool's processes have started (the app waits for them); with them,
        # multiprocessing's resource tracker.
        children = _descendants(api.proc.pid)
        assert len(children) >= processes, children
        api.proc.send_signal(signal.SIGKILL)
        api.proc.wait(10)
        wait_until(
            lambda: not any(_alive(pid) for pid in children),
            10,
            lambda: f"still alive after the API was killed: {[p for p in children if _alive(p)]}",
        )
    finally:
        api.stop()
