"""The one settings object of batchwork, read from the environment (prefix ``BATCHWORK_``).

Read once with :func:`get_settings` and passed down; no other module reads ``os.environ``.
"""

from __future__ import annotations

import os
import re
from functools import cache, lru_cache
from pathlib import Path
from typing import Any
from urllib.parse import SplitResult, urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from worker.batching.policy import PRIORITIES
from worker.models.specs import BUILTIN_MODELS, ModelSpec, check_builtin_options, parse_model_entry

__all__ = ["BatchingSettings", "LaneSettings", "Settings", "get_settings"]

# The brokers batchwork speaks (memory: the embedded run) and, per database, the drivers it installs.
BROKER_SCHEMES = ("redis", "rediss", "memory")
# The longest time any setting may name: waits and periods beyond it (or infinite) would overflow the
# clocks and timers they feed (a thread's wait, a timestamp) and stop the thread that reads them.
DAY_S = 86_400
DAY_MS = DAY_S * 1000
DATABASE_DRIVERS = {"sqlite": ("pysqlite",), "postgresql": ("psycopg",)}
_BROKER_HELP = (
    "batchwork's broker is Redis (redis://HOST:6379/0, rediss://...) or memory:// (the embedded run)"
)
_DATABASE_EXAMPLE = "sqlite:///FILE or postgresql+psycopg://USER:PASSWORD@HOST:5432/DB"
# A torch device a worker may run on: auto (CUDA when present, else the CPU), cpu, an accelerator and index.
_DEVICE = re.compile(r"auto|cpu|(cuda|mps)(:[0-9]{1,3})?")


class LaneSettings(BaseModel):
    """What a deployment sets for one priority lane of a model; unset fields keep the derived defaults
    (README, "Priority lanes")."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # a misspelt key (max_wate_ms) too

    max_batch_size: int | None = Field(default=None, ge=1)
    max_wait_ms: float | None = Field(default=None, ge=0, le=DAY_MS)
    max_delay_ms: float | None = Field(default=None, ge=0, le=DAY_MS, description="starvation bound (aging)")
    max_batch_tokens: int | None = Field(default=None, ge=1, description="this lane's token budget")


class BatchingSettings(BaseModel):
    """What a deployment sets for one model's batching (BATCHWORK_BATCHING, and the shape tuned limits are
    stored in); any field left unset falls back to the tuned limits, then to the model's own default. The
    pure core resolves both into one LanePolicy per lane (worker/batching/policy.py, resolve_lane)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    max_batch_size: int | None = Field(default=None, ge=1, description="N: flush at this many items")
    max_wait_ms: float | None = Field(
        default=None, ge=0, le=DAY_MS, description="T: flush when the oldest item waited"
    )
    max_batch_tokens: int | None = Field(default=None, ge=1, description="cap on longest item x batch size")
    bucket_edges: list[int] | None = Field(
        default=None, description="length bucket upper bounds; [] for none"
    )
    lanes: dict[str, LaneSettings] = Field(default_factory=dict)

    @field_validator("lanes")
    @classmethod
    def _known_lanes(cls, lanes: dict[str, LaneSettings]) -> dict[str, LaneSettings]:
        unknown = set(lanes) - set(PRIORITIES)
        if unknown:
            raise ValueError(f"unknown lane(s) {sorted(unknown)}; lanes are {', '.join(PRIORITIES)}")
        return lanes


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="BATCHWORK_", env_nested_delimiter="__", extra="ignore", allow_inf_nan=False
    )

    broker_url: str = "memory://"
    database_url: str = "sqlite:///batchwork.db"
    device: str = Field(
        default="auto", description="auto (CUDA when present, else CPU), cpu, cuda, cuda:1 ..."
    )

    # The models this deployment serves: built-in names, "package.module:Class" paths and checkpoints of a
    # model kind, "NAME=embed:/dir" (see worker/models/specs.py). A message or call naming anything else
    # is refused before any import, so no caller can make a worker import a module.
    models: list[str] = Field(default_factory=lambda: sorted(BUILTIN_MODELS))
    # An item whose worker died this many times while running it (a segfault, os._exit, the OOM killer)
    # ends with an error instead of being delivered again, so one poison input cannot crash-loop a fleet.
    max_deliveries: int = Field(default=3, ge=1)

    # Per-model batching, e.g. BATCHWORK_BATCHING='{"minilm": {"max_batch_size": 32, "max_wait_ms": 20}}'.
    batching: dict[str, BatchingSettings] = Field(default_factory=dict)
    # Per-model options, each model's own (its Options class), e.g.
    # BATCHWORK_MODEL_OPTIONS='{"minilm": {"precision": "bf16"}, "gpt2": {"path": "/models/gpt2"}}'.
    # A built-in model's block is checked here; a model of your own checks its block when it loads.
    model_options: dict[str, dict[str, Any]] = Field(default_factory=dict)
    # Where `backend: onnx` keeps its exports of embed/classify checkpoints (keyed by content hash, opset and
    # onnxruntime version), made once and reused by every worker that shares the folder.
    onnx_cache_dir: Path = Field(default_factory=lambda: _cache_home() / "batchwork" / "onnx")
    # How often a worker re-reads the limits `batchwork tune --apply` stored (applied without a restart).
    tuned_refresh_s: float = Field(default=30.0, gt=0, le=DAY_S)

    # Celery task events (received / started / succeeded per message) for Flower; each is a publish.
    task_events: bool = True
    # Models a worker loads at start instead of on their first message, e.g. '["minilm"]'.
    preload: list[str] = Field(default_factory=list)

    queue: str = "batchwork"
    # How many messages one worker holds unacknowledged. It must exceed the largest N so the next batch
    # can form while one runs, and stay small enough that a held message is acked well within
    # visibility_timeout_s (kombu redelivers anything held longer).
    prefetch_count: int = Field(default=1024, ge=1)
    # Items of one priority waiting to run that a worker holds at most before it stops fetching that queue
    # (high never stops). Below it, what the worker runs in 0.1 s or a few of its largest batches
    # (FetchThrottle), whichever is more, so a job spreads over every worker.
    max_held_items: int = Field(default=32768, ge=1)
    visibility_timeout_s: int = Field(default=30, ge=4, le=DAY_S)
    # After the broker restarts empty, workers wait this long before ending never-delivered items as lost.
    lost_grace_s: float = Field(default=60.0, ge=0, le=DAY_S)
    # How often a worker stores the tokens its running sequences have generated, for `batchwork status`.
    tokens_report_s: float = Field(default=1.0, gt=0, le=DAY_S)
    # client.submit splits a job into messages of this many items.
    submit_chunk_size: int = Field(default=512, ge=1)

    # At most 2**31 - 1: item indices are 32-bit integers in SQL.
    max_items_per_job: int = Field(default=1_000_000, ge=1, le=2**31 - 1)
    max_input_chars: int = Field(default=100_000, ge=1)

    # Workers serve Prometheus metrics on this port (0: none); a second worker on the same host needs its own.
    metrics_port: int = Field(default=9464, ge=0, le=65535)

    # The HTTP API (`batchwork api`). A JSON body is held in memory, an NDJSON body is spooled to disk;
    # both are refused past their size with 413. A tenant's unfinished items (429) and the messages
    # waiting in the broker's queues (503) bound what one more job may add; both answers carry
    # Retry-After. Items per job are bounded by max_items_per_job (429).
    api_max_body_bytes: int = Field(default=16 * 2**20, ge=1)
    api_max_ndjson_bytes: int = Field(default=2**30, ge=1)
    api_max_tenant_items: int = Field(default=5_000_000, ge=1)
    api_max_queue_depth: int = Field(default=20_000, ge=1)
    api_retry_after_s: int = Field(default=10, ge=1, le=DAY_S)
    # The OpenAI-compatible surface: an uploaded batch file is at most this large (413 above); a synchronous
    # POST /v1/embeddings waits this long for its results, then answers 503.
    api_max_file_bytes: int = Field(default=200 * 2**20, ge=1)
    api_embeddings_timeout_s: float = Field(default=60.0, gt=0, le=DAY_S)
    # Processes that parse and check NDJSON bodies (api/checking.py), about 90 MB each: one per CPU, at
    # most 8 by default; 0 checks in the API process itself.
    api_check_processes: int = Field(default_factory=lambda: min(os.cpu_count() or 1, 8), ge=0, le=256)

    simulated_base_ms: float = Field(
        default=20.0, ge=0, le=DAY_MS, description="simulated model: a in a + b*n"
    )
    simulated_per_item_ms: float = Field(
        default=1.0, ge=0, le=DAY_MS, description="simulated model: b in a + b*n"
    )

    @field_validator("broker_url")
    @classmethod
    def _broker_url(cls, url: str) -> str:
        parts = urlsplit(url)
        if not parts.scheme or "://" not in url:
            raise ValueError(f"not a URL: {_BROKER_HELP}")
        if parts.scheme not in BROKER_SCHEMES:
            raise ValueError(f"{parts.scheme}://...: {_BROKER_HELP}")
        if parts.scheme != "memory":
            _check_redis_url(parts)
        return url

    @field_validator("database_url")
    @classmethod
    def _database_url(cls, url: str) -> str:
        # Parsed without SQLAlchemy, which a producer (infer.delay) never imports.
        scheme, separator, _rest = url.partition("://")
        try:
            parts = urlsplit(url)
            parts.port  # noqa: B018  (reading it checks it)
        except ValueError:
            parts = None
        if not separator or parts is None or not re.fullmatch(r"[a-z][a-z0-9]*(\+[a-z0-9_]+)?", scheme):
            raise ValueError(f"not a database URL: use {_DATABASE_EXAMPLE}")
        backend, _, driver = scheme.partition("+")
        drivers = DATABASE_DRIVERS.get("postgresql" if backend == "postgres" else backend)
        if drivers is None:
            raise ValueError(f"{backend!r} is not a database batchwork runs on: use {_DATABASE_EXAMPLE}")
        if driver and driver not in drivers:
            raise ValueError(f"{scheme}: the {backend} driver batchwork installs is {drivers[0]}")
        return url

    @field_validator("batching", "model_options")
    @classmethod
    def _served_models_only(cls, blocks: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        if "models" not in info.data:  # refused already
            return blocks
        served = list(_served(tuple(info.data["models"])))
        # A "KIND:/dir" name is served later by the embedded run that is given it (serve_checkpoint).
        unknown = sorted(name for name in set(blocks) - set(served) if not _is_checkpoint(name))
        if unknown:
            served_list = ", ".join(served)
            raise ValueError(
                f"{unknown[0]!r} is not a model this deployment serves (BATCHWORK_MODELS: {served_list})"
            )
        return blocks

    @field_validator("model_options")
    @classmethod
    def _builtin_model_options(cls, options: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        for name, block in options.items():
            if name in BUILTIN_MODELS:
                check_builtin_options(name, block)
        return options

    @field_validator("device")
    @classmethod
    def _device_name(cls, device: str) -> str:
        # Only the name is checked here (settings load without torch); whether this machine has the device
        # is checked when a worker starts (worker/models/device.py).
        if not _DEVICE.fullmatch(device):
            raise ValueError(f"{device[:40]!r} is not a device: use auto, cpu, cuda, cuda:N, mps or mps:N")
        return device

    @field_validator("models")
    @classmethod
    def _model_names(cls, models: list[str]) -> list[str]:
        names: set[str] = set()
        for entry in models:
            name = parse_model_entry(entry).name
            if name in names:
                raise ValueError(f"model {name!r} is named twice")
            names.add(name)
        return models

    @property
    def served(self) -> dict[str, ModelSpec]:
        """The served models by the name callers use, in BATCHWORK_MODELS order."""
        return _served(tuple(self.models))

    def serve_checkpoint(self, entry: str) -> None:
        """Serve a "KIND:/dir" entry in this process too: the embedded run's ``--model embed:/dir`` (the
        user's own process and its own worker, so no deployment allow-list is widened)."""
        try:
            spec = parse_model_entry(entry)
        except ValueError:
            return  # not served, so the call is refused as an unknown model, in one line
        if spec.kind is not None and spec.name not in self.served:
            self.models.append(entry)

    @property
    def embedded(self) -> bool:
        """True when no broker is configured: `batchwork run` then starts a worker in its own process."""
        return self.broker_url.startswith("memory://")


def _cache_home() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")


@cache
def _served(models: tuple[str, ...]) -> dict[str, ModelSpec]:
    # Parsed once per list (model_copy may change it), read on every call that names a model.
    return {spec.name: spec for spec in map(parse_model_entry, models)}


def _is_checkpoint(name: str) -> bool:
    try:
        return parse_model_entry(name).kind is not None
    except ValueError:
        return False


def _check_redis_url(parts: SplitResult) -> None:
    try:
        parts.port  # noqa: B018  (reading it checks it)
    except ValueError as exc:
        raise ValueError(f"{parts.scheme}:// URL: {exc}") from None
    if not parts.hostname:
        raise ValueError(f"{parts.scheme}:// URL without a host: use {parts.scheme}://HOST:6379/0")
    database = parts.path.strip("/")
    if database and not database.isdigit():
        raise ValueError(f"{parts.scheme}:// URL: the path is a database number (/0), not {database[:40]!r}")


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
