"""The one settings object of batchwork, read from the environment (prefix ``BATCHWORK_``).

Read once with :func:`get_settings` and passed down; no other module reads ``os.environ``.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from worker.batching.policy import PRIORITIES, LaneKnobs, ModelKnobs

__all__ = ["PRIORITIES", "Batching", "Lane", "ModelOptions", "Settings", "get_settings"]

Precision = Literal["fp32", "bf16", "fp16", "int8"]


class Lane(BaseModel):
    """Knobs of one priority lane of a model; unset fields keep the defaults (README, "Priority lanes")."""

    max_batch_size: int | None = Field(default=None, ge=1)
    max_wait_ms: float | None = Field(default=None, ge=0)
    max_delay_ms: float | None = Field(default=None, ge=0, description="starvation bound (aging)")
    max_batch_tokens: int | None = Field(default=None, ge=1, description="this lane's token budget")


class Batching(BaseModel):
    """Batching knobs of one model; any field left unset falls back to the model's own default."""

    max_batch_size: int | None = Field(default=None, ge=1, description="N: flush at this many items")
    max_wait_ms: float | None = Field(default=None, ge=0, description="T: flush when the oldest item waited")
    max_batch_tokens: int | None = Field(default=None, ge=1, description="cap on longest item x batch size")
    bucket_edges: list[int] | None = Field(
        default=None, description="length bucket upper bounds; [] for none"
    )
    lanes: dict[str, Lane] = Field(default_factory=dict)

    @field_validator("lanes")
    @classmethod
    def _known_lanes(cls, lanes: dict[str, Lane]) -> dict[str, Lane]:
        unknown = set(lanes) - set(PRIORITIES)
        if unknown:
            raise ValueError(f"unknown lane(s) {sorted(unknown)}; lanes are {', '.join(PRIORITIES)}")
        return lanes

    def resolve(self, defaults: ModelKnobs) -> ModelKnobs:
        """These knobs laid over a model's defaults, as the pure core takes them."""
        return ModelKnobs(
            max_batch_size=self.max_batch_size or defaults.max_batch_size,
            max_wait_ms=defaults.max_wait_ms if self.max_wait_ms is None else self.max_wait_ms,
            max_batch_tokens=self.max_batch_tokens or defaults.max_batch_tokens,
            bucket_edges=defaults.bucket_edges
            if self.bucket_edges is None
            else tuple(sorted(self.bucket_edges)),
            lanes={name: LaneKnobs(**lane.model_dump()) for name, lane in self.lanes.items()},
        )

    def over(self, tuned: Batching) -> Batching:
        """These (explicit) knobs laid over tuned ones: each field from the first that sets it.

        A tuned lane value of a field yields to the same field set for the whole model here, so an
        explicit model-level N also rules the lanes it derives (high's N/8) over tuned lane sizes.
        """
        lanes = {}
        for name in PRIORITIES:
            mine, theirs = self.lanes.get(name, Lane()), tuned.lanes.get(name, Lane())
            merged = {
                key: value if value is not None else _unless_set(self, key, getattr(theirs, key))
                for key, value in mine.model_dump().items()
            }
            if any(value is not None for value in merged.values()):
                lanes[name] = Lane(**merged)
        return Batching(
            max_batch_size=self.max_batch_size or tuned.max_batch_size,
            max_wait_ms=tuned.max_wait_ms if self.max_wait_ms is None else self.max_wait_ms,
            max_batch_tokens=self.max_batch_tokens or tuned.max_batch_tokens,
            bucket_edges=self.bucket_edges if self.bucket_edges is not None else tuned.bucket_edges,
            lanes=lanes,
        )

    def source(self, tuned: Batching, name: str) -> str:
        """Which layer a model-level field (max_batch_size, max_wait_ms, ...) comes from."""
        if getattr(self, name) is not None:
            return "setting"
        return "tuned" if getattr(tuned, name) is not None else "default"


def _unless_set(explicit: Batching, key: str, value: Any) -> Any:
    return None if getattr(explicit, key, None) is not None else value


class ModelOptions(BaseModel):
    """One model's options (BATCHWORK_MODEL_OPTIONS); a model reads its own block."""

    model_config = ConfigDict(extra="forbid")

    # fp32 is the reference; bf16/fp16 cast the weights (fp16 on CUDA only), int8 is torch's dynamic
    # quantization of Linear layers (CPU only).
    precision: Precision = "fp32"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="BATCHWORK_", env_nested_delimiter="__", extra="ignore")

    broker_url: str = "memory://"
    database_url: str = "sqlite:///batchwork.db"
    device: str = Field(
        default="auto", description="auto (CUDA when present, else CPU), cpu, cuda, cuda:1 ..."
    )

    # Per-model batching, e.g. BATCHWORK_BATCHING='{"minilm": {"max_batch_size": 32, "max_wait_ms": 20}}'.
    batching: dict[str, Batching] = Field(default_factory=dict)
    # Per-model options, e.g. BATCHWORK_MODEL_OPTIONS='{"minilm": {"precision": "bf16"}}'.
    model_options: dict[str, ModelOptions] = Field(default_factory=dict)
    # How often a worker re-reads the limits `batchwork tune --apply` stored (applied without a restart).
    tuned_refresh_s: float = Field(default=30.0, gt=0)

    # Celery task events (received / started / succeeded per message) for Flower; each is a publish.
    task_events: bool = True
    # Models a worker loads at start instead of on their first message, e.g. '["minilm"]'.
    preload: list[str] = Field(default_factory=list)

    queue: str = "batchwork"
    # How many messages one worker holds unacknowledged. It must exceed the largest N so the next batch
    # can form while one runs, and stay small enough that a held message is acked well within
    # visibility_timeout_s (kombu redelivers anything held longer).
    prefetch_count: int = Field(default=1024, ge=1)
    # Items of one priority a worker holds before it stops fetching that queue (high never stops).
    max_held_items: int = Field(default=50_000, ge=1)
    visibility_timeout_s: int = Field(default=30, ge=4)
    # After the broker restarts empty, workers wait this long before ending never-delivered items as lost.
    lost_grace_s: float = Field(default=60.0, ge=0)
    # How often a worker stores the tokens its running sequences have generated, for `batchwork status`.
    tokens_report_s: float = Field(default=1.0, gt=0)
    # client.submit splits a job into messages of this many items.
    submit_chunk_size: int = Field(default=512, ge=1)

    max_items_per_job: int = Field(default=1_000_000, ge=1)
    max_input_chars: int = Field(default=100_000, ge=1)

    simulated_base_ms: float = Field(default=20.0, ge=0, description="simulated model: a in a + b*n")
    simulated_per_item_ms: float = Field(default=1.0, ge=0, description="simulated model: b in a + b*n")

    # A local Hugging Face GPT-2-format checkpoint directory (config.json, model.safetensors or
    # pytorch_model.bin, tokenizer files); never downloaded. Its KV cache holds this many tokens across all
    # running sequences (pages of 16; n_layer * 2 * n_embd numbers per token, 72 KiB for GPT-2 small in
    # float32); past it the newest sequences are preempted and later resume.
    gpt2_path: str | None = None
    gpt2_kv_budget_tokens: int = Field(
        default=16_384, ge=16, description="gpt2: KV-cache tokens, all sequences"
    )

    @property
    def embedded(self) -> bool:
        """True when no broker is configured: `batchwork run` then starts a worker in its own process."""
        return self.broker_url.startswith("memory://")


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
