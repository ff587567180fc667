"""Settings refused at load, in the one line the CLI prints (issue 17 classes 3 and 7): broker and database
URLs batchwork cannot use, and keys of BATCHWORK_BATCHING / BATCHWORK_MODEL_OPTIONS that nothing reads."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from worker.cli import _settings_error
from worker.errors import InvalidInput
from worker.models.registry import model_class
from worker.settings import Settings


def refusal(**values: Any) -> str:
    with pytest.raises(ValidationError) as refused:
        Settings(**values)
    line = _settings_error(refused.value)
    assert "\n" not in line
    return line


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("amqp://guest:secret@localhost:5672//", "amqp://...: batchwork's broker is Redis"),
        ("garbage", "not a URL"),
        ("", "not a URL"),
        ("sqs://", "sqs://...: batchwork's broker is Redis"),
        ("redis", "not a URL"),
        ("redis:/localhost", "not a URL"),
        ("redis://localhost:99999/0", "Port out of range"),
        ("redis://localhost:port/0", "Port could not be cast"),
        ("redis:///0", "without a host"),
        ("redis://localhost/zero", "the path is a database number"),
        ("rediss://:secret@", "without a host"),
    ],
)
def test_a_broker_url_batchwork_cannot_use_is_one_line(url: str, says: str) -> None:
    line = refusal(broker_url=url)
    assert line.startswith("bad setting BATCHWORK_BROKER_URL: ") and says in line
    assert "secret" not in line


@pytest.mark.parametrize(
    "url",
    ["memory://", "redis://localhost:6379/0", "redis://:pw@10.0.0.1:6380/15", "rediss://h.example:6379"],
)
def test_broker_urls_batchwork_speaks_are_taken(url: str) -> None:
    assert Settings(broker_url=url).broker_url == url


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("mysql://user:secret@host/db", "'mysql' is not a database batchwork runs on"),
        ("mysql+pymysql://user:secret@host/db", "'mysql' is not a database"),
        ("oracle://x", "'oracle' is not a database"),
        ("garbage", "not a database URL"),
        ("", "not a database URL"),
        ("postgresql://user:secret@host:notaport/db", "not a database URL"),
        ("postgresql+psycopg2://user:secret@host/db", "the postgresql driver batchwork installs is psycopg"),
        ("sqlite+aiosqlite:///x.db", "the sqlite driver batchwork installs is pysqlite"),
    ],
)
def test_a_database_url_batchwork_cannot_use_is_one_line(url: str, says: str) -> None:
    line = refusal(database_url=url)
    assert line.startswith("bad setting BATCHWORK_DATABASE_URL: ") and says in line
    assert "secret" not in line


@pytest.mark.parametrize(
    "url",
    [
        "sqlite:///batchwork.db",
        "sqlite:////tmp/x.db",
        "sqlite://",
        "sqlite+pysqlite:///x.db",
        "postgresql://u@h/db",
        "postgres://u@h/db",
        "postgresql+psycopg://u:p@h:5432/db?options=-csearch_path%3Dx",
    ],
)
def test_database_urls_batchwork_runs_on_are_taken(url: str) -> None:
    assert Settings(database_url=url).database_url == url


@given(st.text(max_size=60))
def test_any_text_as_a_url_is_taken_or_refused_in_one_line(text: str) -> None:
    for field in ("broker_url", "database_url"):
        try:
            Settings(**{field: text})
        except ValidationError as refused:
            assert "\n" not in _settings_error(refused)


@pytest.mark.parametrize(
    ("setting", "value", "line"),
    [
        (
            "batching",
            {"minilm": {"max_wate_ms": 5}},
            "BATCHWORK_BATCHING (minilm.max_wate_ms): unknown option",
        ),
        (
            "batching",
            {"noop": {"lanes": {"bulk": {"max_size": 5}}}},
            "(noop.lanes.bulk.max_size): unknown option",
        ),
        ("batching", {"minlm": {"max_wait_ms": 5}}, "'minlm' is not a model this deployment serves"),
        ("batching", {"noop": {"lanes": {"urgent": {}}}}, "unknown lane(s) ['urgent']"),
        (
            "model_options",
            {"minilm": {"precison": "bf16"}},
            "BATCHWORK_MODEL_OPTIONS: minilm: precison: unknown",
        ),
        ("model_options", {"gpt2": {"max_wate_ms": 1}}, "gpt2: max_wate_ms: unknown option"),
        ("model_options", {"minlm": {}}, "'minlm' is not a model this deployment serves"),
    ],
)
def test_a_key_nothing_reads_is_refused_naming_it(setting: str, value: Any, line: str) -> None:
    assert line in refusal(**{setting: value})


def test_a_model_of_your_own_checks_its_options_when_its_class_resolves() -> None:
    echo = "tests.support.models:Echo"
    settings = Settings(models=["noop", echo], model_options={echo: {"max_wate_ms": 1}})
    with pytest.raises(InvalidInput, match=r"BATCHWORK_MODEL_OPTIONS: echo: max_wate_ms: unknown option"):
        model_class(echo, settings)
    assert model_class(echo, Settings(models=["noop", echo], model_options={echo: {"precision": "fp32"}}))


@pytest.mark.parametrize(
    ("values", "line"),
    [
        (
            {"batching": {"noop": {"max_wait_ms": 1e308}}},
            "(noop.max_wait_ms): Input should be less than or equal",
        ),
        (
            {"batching": {"noop": {"max_wait_ms": float("inf")}}},
            "(noop.max_wait_ms): Input should be a finite",
        ),
        ({"batching": {"noop": {"lanes": {"bulk": {"max_delay_ms": float("nan")}}}}}, "should be a finite"),
        ({"tuned_refresh_s": float("inf")}, "BATCHWORK_TUNED_REFRESH_S: Input should be a finite number"),
        (
            {"visibility_timeout_s": 10**12},
            "BATCHWORK_VISIBILITY_TIMEOUT_S: Input should be less than or equal",
        ),
    ],
)
def test_a_time_beyond_a_day_or_not_finite_is_refused_before_it_stops_a_thread(
    values: dict[str, Any], line: str
) -> None:
    # An infinite wait once overflowed the run thread's timer (and a NaN compares false with every bound).
    assert line in refusal(**values)
