"""`batchwork models`: each model's effective N, T and token budget on this worker's device kind, and
where each came from (setting > tuned > default), with a flag where N reaches a size that ran out of memory.
"""

from __future__ import annotations

from typing import Any

from rich.table import Table

from worker.models.base import InvalidInput
from worker.models.registry import describe, model_class
from worker.settings import Settings
from worker.tuning.limits import effective, read_tuned


def models_table(settings: Settings) -> list[Any]:
    from worker.models.device import device_kind, resolve_device

    kind = device_kind(resolve_device(settings.device))
    tuned = read_tuned(settings.database_url, kind)
    rows = {} if isinstance(tuned, str) else tuned
    table = Table(
        "name", "description", "N", "T ms", "max_batch_tokens", "lanes high / bulk N", title=f"on {kind}"
    )
    notes: list[str] = [] if not isinstance(tuned, str) else [f"tuned limits not shown: {tuned}"]
    known = [name for name in rows if _importable(name)]
    for description in describe(known):
        name = description.name
        limits = effective(name, model_class(name), settings, rows.get(name))
        normal = limits.lanes["normal"]
        table.add_row(
            name,
            description.description,
            f"{normal.max_batch_size} ({limits.sources['max_batch_size']})",
            f"{normal.max_wait_s * 1000:g} ({limits.sources['max_wait_ms']})",
            f"{normal.max_batch_tokens or '-'} ({limits.sources['max_batch_tokens']})",
            f"{limits.lanes['high'].max_batch_size} / {limits.lanes['bulk'].max_batch_size}",
        )
        if limits.oom_flag:
            notes.append(f"{name}: {limits.oom_flag}")
    return [table, *notes]


def _importable(name: str) -> bool:
    """A tuned model this installation can still resolve (one renamed since is left out)."""
    try:
        model_class(name)
    except InvalidInput:
        return False
    return True
