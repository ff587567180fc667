"""Every mistake a user can make with the ``batchwork`` command ends in one clear line, never a traceback; the
embedded default never leaves a job that cannot run; read-only commands create nothing; Ctrl-C cancels."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.integration.processes import ROOT, batchwork, service_env, wait_until
from worker.store.results import ResultStore

EXAMPLE = ROOT / "examples" / "docs.jsonl"


def one_line_error(done: subprocess.CompletedProcess[str], fragment: str, code: int = 2) -> str:
    assert done.returncode == code, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1, done.stderr
    assert fragment in errors[0], errors[0]
    return errors[0]


def embedded_env(**settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHWORK_")}
    env.update(PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    env.update({f"BATCHWORK_{name.upper()}": value for name, value in settings.items()})
    return env


def test_submit_without_a_broker_says_how_to_start_one(tmp_path: Path) -> None:
    done = batchwork(tmp_path, "submit", str(EXAMPLE), "-m", "noop", timeout_s=60)
    line = one_line_error(done, "no broker is configured")
    assert "batchwork worker" in line and "batchwork run" in line


def test_producers_without_a_broker_refuse_rather_than_strand_a_job(tmp_path: Path) -> None:
    code = (
        "from worker.errors import NoWorker\n"
        "from worker import client\n"
        "from worker.tasks import infer\n"
        "calls = (lambda: client.submit('noop', ['a']), lambda: infer.delay(model='noop', inputs=['a']))\n"
        "for call in calls:\n"
        "    try:\n"
        "        call()\n"
        "    except NoWorker as exc:\n"
        "        print('refused:', exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=embedded_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("refused: no broker is configured") == 2


@pytest.mark.parametrize("command", ["status", "results", "cancel"])
def test_read_only_commands_create_no_database_and_say_where_they_looked(
    tmp_path: Path, command: str
) -> None:
    done = batchwork(tmp_path, command, str(uuid.uuid4()), timeout_s=60)
    one_line_error(done, "in sqlite:///batchwork.db (no such file yet)")
    assert not (tmp_path / "batchwork.db").exists()


def test_an_unmigrated_database_says_run_migrate(tmp_path: Path, redis_url: str, pg_url: str) -> None:
    env = service_env(redis_url, pg_url)
    one_line_error(
        batchwork(tmp_path, "status", str(uuid.uuid4()), env=env, timeout_s=60), "run `batchwork migrate`"
    )
    one_line_error(batchwork(tmp_path, "worker", env=env, timeout_s=60), "run `batchwork migrate`")


@pytest.mark.parametrize(
    "command", [["run", str(EXAMPLE), "-m", "noop"], ["status", str(uuid.uuid4())], ["migrate"]]
)
def test_a_database_url_naming_a_file_that_is_no_database_is_one_line(
    tmp_path: Path, command: list[str]
) -> None:
    (tmp_path / "notes.db").write_text("a text file, not a SQLite database " * 20)
    env = embedded_env(database_url=f"sqlite:///{tmp_path / 'notes.db'}")
    one_line_error(batchwork(tmp_path, *command, env=env, timeout_s=120), "notes.db: file is not a database")


def test_a_worker_for_an_unknown_queue_or_log_level_is_refused(
    tmp_path: Path, redis_url: str, pg_store: ResultStore
) -> None:
    env = service_env(redis_url, pg_store.url)
    done = batchwork(tmp_path, "worker", "-Q", "batchwork.hihg", env=env, timeout_s=60)
    one_line_error(done, "unknown queue 'batchwork.hihg'")
    one_line_error(batchwork(tmp_path, "worker", "-Q", ",", env=env, timeout_s=60), "unknown queue")
    one_line_error(batchwork(tmp_path, "worker", "--loglevel", "NOPE", env=env, timeout_s=60), "log level")


def test_unreachable_services_are_one_line_each(tmp_path: Path, pg_url: str, pg_store: ResultStore) -> None:
    no_broker = service_env("redis://127.0.0.1:1/0", pg_url)
    one_line_error(
        batchwork(tmp_path, "submit", str(EXAMPLE), "-m", "noop", env=no_broker, timeout_s=60),
        "cannot reach the broker at redis://127.0.0.1:1/0",
    )
    no_database = service_env("redis://127.0.0.1:1/0", "postgresql+psycopg://root@127.0.0.1:1/test")
    one_line_error(
        batchwork(tmp_path, "status", str(uuid.uuid4()), env=no_database, timeout_s=60),
        "cannot reach the database postgresql+psycopg://root@127.0.0.1:1/test",
    )


@pytest.mark.parametrize(
    ("setting", "value", "fragment"),
    [
        ("PREFETCH_COUNT", "many", "bad setting BATCHWORK_PREFETCH_COUNT"),
        ("MODELS", "minilm", "bad setting BATCHWORK_MODELS"),
        ("MODELS", '["a:b:c"]', "bad setting BATCHWORK_MODELS"),
        ("BATCHING", '{"noop": {"lanes": {"urgent": {}}}}', "bad setting BATCHWORK_BATCHING"),
    ],
)
def test_a_bad_setting_is_one_line(tmp_path: Path, setting: str, value: str, fragment: str) -> None:
    env = embedded_env(**{setting: value})
    one_line_error(batchwork(tmp_path, "models", env=env, timeout_s=60), fragment)


def test_an_output_folder_that_does_not_exist_is_refused_before_anything_runs(tmp_path: Path) -> None:
    done = batchwork(tmp_path, "run", str(EXAMPLE), "-m", "noop", "-o", "no/such/out.jsonl", timeout_s=60)
    one_line_error(done, "the folder no/such does not exist")
    assert not (tmp_path / "batchwork.db").exists()


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["status", "[/x]"], "no job '[/x]'"),
        (["run", str(EXAMPLE), "-m", "a:b:c"], "unknown model 'a:b:c'"),
        (["run", str(EXAMPLE), "-m", "[bold]x[/bold]"], "unknown model '[bold]x[/bold]'"),
    ],
)
def test_user_text_is_printed_as_text_not_markup_or_emoji(
    tmp_path: Path, args: list[str], fragment: str
) -> None:
    line = one_line_error(batchwork(tmp_path, *args, timeout_s=60), fragment)
    assert "🅱" not in line


@pytest.mark.parametrize("model", [["-m", "noop"], []])  # the plain run, and an OpenAI batch file's
def test_a_priority_that_is_no_lane_is_refused_before_anything_runs(tmp_path: Path, model: list[str]) -> None:
    line = {
        "custom_id": "a",
        "method": "POST",
        "url": "/v1/embeddings",
        "body": {"model": "noop", "input": "x"},
    }
    (tmp_path / "in.jsonl").write_text(json.dumps(line if not model else {"text": "x"}) + "\n")
    done = batchwork(tmp_path, "run", "in.jsonl", *model, "-o", "out.jsonl", "-p", "urgent", timeout_s=60)
    one_line_error(done, "argument 'priority' must be one of high, normal, bulk, not 'urgent'")
    assert not (tmp_path / "out.jsonl").exists()


def test_an_openai_batch_file_naming_a_missing_checkpoint_is_refused_before_any_work(tmp_path: Path) -> None:
    body = {"model": "embed:/no/such/dir", "input": "x"}
    line = {"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": body}
    (tmp_path / "in.jsonl").write_text(json.dumps(line) + "\n")
    one_line_error(
        batchwork(tmp_path, "run", "in.jsonl", "-o", "out.jsonl", timeout_s=60), "no such directory"
    )
    assert not (tmp_path / "batchwork.db").exists()  # nothing ran, as with -m embed:/no/such/dir


def test_a_byte_order_mark_is_accepted(tmp_path: Path) -> None:
    (tmp_path / "in.jsonl").write_bytes(b"\xef\xbb\xbf" + EXAMPLE.read_bytes())
    done = batchwork(tmp_path, "run", "in.jsonl", "-m", "noop", "-o", "out.jsonl", timeout_s=120)
    assert done.returncode == 0, done.stderr
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 20


def test_a_failed_results_command_never_truncates_its_output_file(tmp_path: Path) -> None:
    (tmp_path / "keep.jsonl").write_text("precious\n")
    batchwork(tmp_path, "run", str(EXAMPLE), "-m", "noop", "-o", "out.jsonl", timeout_s=120)  # a database
    done = batchwork(tmp_path, "results", str(uuid.uuid4()), "-o", "keep.jsonl", timeout_s=60)
    one_line_error(done, "no job")
    assert (tmp_path / "keep.jsonl").read_text() == "precious\n"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".keep")] == []


def test_a_model_that_fails_to_load_fails_its_job_with_the_reason(tmp_path: Path) -> None:
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "Hi", "max_new_tokens": 3}\n' * 5)
    done = batchwork(tmp_path, "run", "prompts.jsonl", "-m", "gpt2", "-o", "out.jsonl", timeout_s=120)
    assert done.returncode == 1, done.stderr
    assert "failed: 0 done, 5 failed" in done.stderr
    assert "5 × model 'gpt2' failed to load: RuntimeError: the gpt2 model has no checkpoint" in done.stderr
    lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(lines) == 5 and all("BATCHWORK_MODEL_OPTIONS" in line["error"] for line in lines)


def test_run_and_status_show_the_most_common_errors(tmp_path: Path) -> None:
    texts = ["fine", "poison", "fine too", "poison"]
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps({"text": text}) for text in texts))
    env = embedded_env(MODELS=json.dumps(["noop", "tests.support.models:Poison"]))
    done = batchwork(tmp_path, "run", "in.jsonl", "-m", "tests.support.models:Poison", env=env)
    assert done.returncode == 1, done.stderr
    assert "partial: 2 done, 2 failed" in done.stderr
    assert "2 × ValueError: cannot digest 'poison'" in done.stderr
    job_id = done.stderr.split("job ", 1)[1].split(":", 1)[0]
    shown = batchwork(tmp_path, "status", job_id, env=env, timeout_s=60)
    assert shown.returncode == 0, shown.stderr
    assert "most common errors:" in shown.stdout and "2 × ValueError: cannot digest 'poison'" in shown.stdout


@pytest.mark.slow
def test_ctrl_c_cancels_the_job_and_still_writes_a_line_per_input(tmp_path: Path) -> None:
    (tmp_path / "in.jsonl").write_text(
        "\n".join(json.dumps({"id": f"d{i}", "text": "x"}) for i in range(200))
    )
    env = embedded_env(
        SIMULATED_BASE_MS="200", SIMULATED_PER_ITEM_MS="0", BATCHING='{"simulated": {"max_batch_size": 4}}'
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "worker.cli", "run", "in.jsonl", "-m", "simulated", "-o", "out.jsonl"],
        cwd=tmp_path,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    deadline = time.monotonic() + 120
    for line in proc.stderr:
        assert time.monotonic() < deadline, "the job never started"
        if "items on simulated" in line:
            break
    # Some batches run, most wait (200 items, 4 a batch, 200 ms each).
    store = ResultStore.from_url(f"sqlite:///{tmp_path / 'batchwork.db'}")
    try:
        wait_until(lambda: store.recent_batches(limit=1), 60, lambda: "no batch ever ran")
    finally:
        store.close()
    proc.send_signal(signal.SIGINT)
    stderr = proc.stderr.read()
    assert proc.wait(60) == 130, stderr
    assert "cancelled" in stderr and "Traceback" not in stderr
    lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [line["index"] for line in lines] == list(range(200))
    assert [line["id"] for line in lines] == [f"d{i}" for i in range(200)]
    cancelled = [line for line in lines if line.get("error") == "cancelled"]
    assert 0 < len(cancelled) < 200 and all("output" in line for line in lines if "error" not in line)
