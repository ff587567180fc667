"""The one settings object of batchwork, read from the environment (prefix ``BATCHWORK_``).

Read once with :func:`get_settings` and passed down; no other module reads ``os.environ``.
"""

from __future__ import annotations

from functools import lru_cache

from pydantic import BaseModel, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

PRIORITIES = ("high", "normal", "bulk")


class Batching(BaseModel):
    """Batching knobs of one model; any field left unset falls back to the model's own default."""

    max_batch_size: int | None = Field(default=None, ge=1, description="N: flush at this many items")
    max_wait_ms: float | None = Field(
        default=None, ge=0, description="T: flush when the oldest item waited this long"
    )


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="BATCHWORK_", env_nested_delimiter="__", extra="ignore")

    broker_url: str = "memory://"
    database_url: str = "sqlite:///batchwork.db"
    device: str = Field(
        default="auto", description="auto (CUDA when present, else CPU), cpu, cuda, cuda:1 ..."
    )

    # Per-model batching, e.g. BATCHWORK_BATCHING='{"minilm": {"max_batch_size": 32, "max_wait_ms": 20}}'.
    batching: dict[str, Batching] = Field(default_factory=dict)

    # Models a worker loads at start instead of on their first message, e.g. '["minilm"]'.
    preload: list[str] = Field(default_factory=list)

    queue: str = "batchwork"
    # How many messages one worker holds unacknowledged. It must exceed the largest N so the next batch
    # can form while one runs, and stay small enough that a held message is acked well within
    # visibility_timeout_s (kombu redelivers anything held longer).
    prefetch_count: int = Field(default=1024, ge=1)
    visibility_timeout_s: int = Field(default=600, ge=10)
    # client.submit splits a job into messages of this many items.
    submit_chunk_size: int = Field(default=512, ge=1)

    max_items_per_job: int = Field(default=1_000_000, ge=1)
    max_input_chars: int = Field(default=100_000, ge=1)

    simulated_base_ms: float = Field(default=20.0, ge=0, description="simulated model: a in a + b*n")
    simulated_per_item_ms: float = Field(default=1.0, ge=0, description="simulated model: b in a + b*n")

    @property
    def embedded(self) -> bool:
        """True when no broker is configured: `batchwork run` then starts a worker in its own process."""
        return self.broker_url.startswith("memory://")


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
