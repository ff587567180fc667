"""`batchwork tune` end to end: the sweep and the choice on `simulated` with known costs, --apply read by a
new worker and by a running one, out-of-memory sizes recorded and flagged, MiniLM's sweep with its CSV,
JSON and PNG, --from-history on stored batches, and one line for every mistake."""

from __future__ import annotations

import csv
import json
import random
import subprocess
import time
from datetime import UTC, datetime, timedelta

import pytest

from tests.integration.processes import ROOT, produce, service_env, wait_finished, workers
from tests.integration.processes import batchwork as command
from worker.store.results import BatchRecord, ResultStore
from worker.store.tuned import TunedLimits

SIMULATED = {"simulated_base_ms": "20", "simulated_per_item_ms": "2"}
OOM_MODEL = "tests.support.models:OutOfMemoryAbove16"


def batchwork(env: dict[str, str], *args: str, timeout_s: float = 240) -> subprocess.CompletedProcess[str]:
    """``batchwork ARGS`` from the repository root with ``env``."""
    return command(ROOT, *args, env=env, timeout_s=timeout_s)


def texts(n: int) -> list[str]:
    return [f"item {i}" for i in range(n)]


def wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not within {timeout_s} s")
        time.sleep(0.1)


@pytest.fixture
def stack(redis_url: str, pg_url: str, pg_store: ResultStore):
    tuned = TunedLimits.from_url(pg_url)
    yield service_env(redis_url, pg_url), pg_store, tuned
    tuned.close()


@pytest.mark.slow
def test_simulated_a20_b2_bound_180_applies_n_up_to_80_and_a_new_worker_runs_it(stack, tmp_path) -> None:
    env, store, tuned = stack
    env.update({f"BATCHWORK_{k.upper()}": v for k, v in SIMULATED.items()})
    args = ["tune", "simulated", "--max-batch-ms", "180", "--max-n", "128", "--point-s", "0.2"]
    done = batchwork(env, *args, "--json", "--apply", "-o", str(tmp_path))
    assert done.returncode == 0, done.stderr

    result = json.loads(done.stdout)
    points = list(csv.DictReader((tmp_path / "points.csv").read_text().splitlines()))
    within = [int(p["n"]) for p in points if int(p["n"]) <= 80 and float(p["p99_ms"]) <= 180]
    assert result["max_batch_size"] == max(within) and 64 <= max(within) <= 80  # 20 + 2n <= 180
    assert result["p99_batch_ms"] <= 180 and result["lanes"]["high"]["max_batch_size"] < 16
    [row] = tuned.rows(model="simulated")
    assert row.device_kind == "cpu" and row.batching["max_batch_size"] == result["max_batch_size"]
    assert row.tuned_by and row.tuned_at is not None

    shown = batchwork(env, "models")
    assert f"{result['max_batch_size']} (tuned)" in shown.stdout.replace("\n", " "), shown.stdout

    with workers(env):
        [job_id] = produce(env, [{"via": "submit", "model": "simulated", "inputs": texts(400)}])
        wait_finished(store, [job_id])
    sizes = [b.size for b in store.recent_batches(job_id, limit=100)]
    assert sum(sizes) == 400 and max(sizes) == result["max_batch_size"]


@pytest.mark.slow
def test_a_running_worker_takes_newly_applied_limits_without_restart(stack) -> None:
    env, store, tuned = stack
    env.update(
        BATCHWORK_SIMULATED_BASE_MS="5", BATCHWORK_SIMULATED_PER_ITEM_MS="0", BATCHWORK_TUNED_REFRESH_S="0.3"
    )
    with workers(env) as [worker]:
        [before] = produce(env, [{"via": "submit", "model": "simulated", "inputs": texts(200)}])
        wait_finished(store, [before])
        tuned.apply("simulated", "cpu", {"max_batch_size": 10}, {}, "test")
        wait_until(lambda: any("tuned limits of simulated" in line for line in worker.log), 60, "refresh")
        [after] = produce(env, [{"via": "submit", "model": "simulated", "inputs": texts(200)}])
        wait_finished(store, [after])
    assert max(b.size for b in store.recent_batches(before, limit=100)) == 64  # the model's default N
    assert {b.size for b in store.recent_batches(after, limit=100)} == {10}


@pytest.mark.slow
def test_out_of_memory_sizes_are_recorded_and_a_tuned_n_above_them_is_flagged(stack) -> None:
    env, store, tuned = stack
    with workers(env):
        [job_id] = produce(env, [{"via": "submit", "model": OOM_MODEL, "inputs": texts(300)}])
        wait_finished(store, [job_id])
        wait_until(lambda: any(r.oom_batch_size for r in tuned.rows(model=OOM_MODEL)), 60, "OOM record")
    [row] = tuned.rows(model=OOM_MODEL)
    assert row.oom_batch_size is not None and row.oom_batch_size > 16 and row.oom_worker == "w0@test"

    tuned.apply(OOM_MODEL, "cpu", {"max_batch_size": 64}, {}, "test")
    shown = batchwork(env, "models")
    assert "ran out of memory" in shown.stdout.replace("\n", " "), shown.stdout


@pytest.mark.slow
def test_minilm_sweep_writes_a_csv_json_and_png_and_compares_precisions(sqlite_url, tmp_path) -> None:
    env = service_env("memory://", sqlite_url)
    args = ["tune", "minilm", "--lengths", "16,64", "--max-n", "4", "--point-s", "0.05", "--json"]
    done = batchwork(env, *args, "--precisions", "fp32,bf16", "-o", str(tmp_path))
    assert done.returncode == 0, done.stderr

    result = json.loads(done.stdout)
    for field in (
        "model",
        "device",
        "max_batch_size",
        "max_batch_tokens",
        "max_wait_ms",
        "p99_batch_ms",
        "items_per_s",
    ):
        assert field in result
    assert set(result["lanes"]) == {"high", "normal", "bulk"} and result["lengths"] == [16, 64]
    assert json.loads((tmp_path / "tune.json").read_text()) == result
    png = (tmp_path / "curve.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    from PIL import Image

    with Image.open(tmp_path / "curve.png") as image:
        assert image.format == "PNG" and image.size[0] > 600
    rows = list(csv.DictReader((tmp_path / "points.csv").read_text().splitlines()))
    assert {(r["precision"], r["length"]) for r in rows} >= {("fp32", "16"), ("fp32", "64")}
    by_precision = {row["precision"]: row for row in result["precisions"]}
    assert by_precision["fp32"]["min_cosine"] == pytest.approx(1.0, abs=1e-6)
    bf16 = by_precision["bf16"]
    assert "skipped" in bf16.get("note", "") or bf16["min_cosine"] >= 0.999


def test_from_history_recovers_a_and_b_from_stored_batches(db_url) -> None:
    store = ResultStore.from_url(db_url)
    rng = random.Random(3)
    now = datetime.now(UTC)
    for i in range(300):
        size = rng.randint(1, 64)
        padded = size * 16
        run_ms = 20 + 0.05 * padded + rng.gauss(0, 0.5)
        record = BatchRecord(
            "simulated", "normal", size, padded, padded, 1.0, run_ms, now - timedelta(seconds=i), "w"
        )
        store.write_batch(record, [], [])
    store.close()

    done = batchwork(
        service_env("memory://", db_url),
        "tune",
        "simulated",
        "--from-history",
        "--max-batch-ms",
        "100",
        "--json",
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["fit"]["a_ms"] == pytest.approx(20, abs=1)
    assert result["fit"]["b_ms_per_token"] == pytest.approx(0.05, rel=0.02)
    assert result["fit"]["batches"] == 300
    # simulated's default N = 64 items of 16 tokens: 20 + 0.05 * 1024 = 71 ms, within 100
    assert result["lanes"]["normal"]["meets_bound"] and result["lanes"]["normal"][
        "predicted_ms"
    ] == pytest.approx(71, abs=2)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-batch-ms", "0"], "--max-batch-ms must be above 0"),
        (["--max-batch-ms", "nan"], "--max-batch-ms must be above 0 and at most"),  # NaN passed "<= 0"
        (["--point-s", "inf"], "--point-s must be above 0 and at most"),
        (["--max-batch-ms", "abc"], "Invalid value for '--max-batch-ms'"),
        (["--memory-fraction", "1.5"], "--memory-fraction"),
        (["--lengths", "16,x"], "--lengths must be"),
        (["--precisions", "fp32,fp8"], "unknown fp8"),
        (["--sample", "/no/such.jsonl"], "no such file"),
        (["--bogus"], "No such option: --bogus"),
    ],
)
def test_a_mistake_is_one_line_and_exit_code_2(sqlite_url, args, message) -> None:
    done = batchwork(service_env("memory://", sqlite_url), "tune", "simulated", *args)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1 and message in lines[0], lines


@pytest.mark.parametrize(
    ("options", "line"),
    [
        (
            {"minilm": {"precision": "fp8"}},
            "minilm: precision: Input should be 'fp32', 'bf16', 'fp16' or 'int8'",
        ),
        ({"minilm": {"path": "/x"}}, "minilm: path: unknown option"),
        (
            {"gpt2": {"kv_budget_tokens": 3}},
            "gpt2: kv_budget_tokens: Input should be greater than or equal to 16",
        ),
    ],
)
def test_a_bad_model_option_is_one_line(sqlite_url, options, line) -> None:
    done = batchwork(service_env("memory://", sqlite_url, model_options=options), "models")
    assert done.returncode == 2
    assert done.stderr.strip() == f"error: bad setting BATCHWORK_MODEL_OPTIONS: {line}"


@pytest.mark.slow
def test_a_step_model_sweeps_running_sequences_and_sizes_the_kv_cache(
    sqlite_url, tiny_gpt2_eos, tmp_path
) -> None:
    # The EOS-prone checkpoint: sequences that finish mid-sweep are replaced and the sweep goes on.
    env = service_env("memory://", sqlite_url, model_options={"gpt2": {"path": str(tiny_gpt2_eos)}})
    args = [
        "tune",
        "gpt2",
        "--lengths",
        "8,24",
        "--max-n",
        "8",
        "--point-s",
        "0.05",
        "--json",
        "-o",
        str(tmp_path),
    ]
    done = batchwork(env, *args)
    assert done.returncode == 0, done.stderr

    result = json.loads(done.stdout)
    assert result["max_batch_size"] >= 1 and result["tokens_per_s"] > 0 and result["p99_step_ms"] > 0
    assert result["max_batch_tokens"] is None and result["kv_budget_tokens"] % 16 == 0
    assert result["kv_budget_tokens"] >= 16
    rows = list(csv.DictReader((tmp_path / "points.csv").read_text().splitlines()))
    assert {int(r["length"]) for r in rows} == {8, 24} and max(int(r["n"]) for r in rows) == 8

    refused = batchwork(env, "tune", "gpt2", "--precisions", "bf16")
    assert refused.returncode == 2 and "fp32 only" in refused.stderr
