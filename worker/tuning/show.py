"""`batchwork models`: each model's effective N, T and token budget on this worker's device kind, and
where each came from (setting > tuned > default), with a flag where N reaches a size that ran out of memory.
"""

from __future__ import annotations

from typing import Any

from rich.table import Table

from worker.models.registry import ModelDescription, model_class, served_models
from worker.settings import Settings
from worker.tuning.limits import effective, read_tuned


def models_table(settings: Settings) -> list[Any]:
    from worker.models.device import device_kind, resolve_device

    kind = device_kind(resolve_device(settings.device))
    tuned = read_tuned(settings.database_url, kind)
    rows = {} if isinstance(tuned, str) else tuned
    table = Table(
        "name",
        "kind",
        "checkpoint",
        "description",
        "N",
        "T ms",
        "max_batch_tokens",
        "lanes high / bulk N",
        title=f"on {kind}",
    )
    notes: list[str] = [] if not isinstance(tuned, str) else [f"tuned limits not shown: {tuned}"]
    for description in served_models(settings):
        if not isinstance(description, ModelDescription):
            notes.append(str(description))  # an allowed model that cannot be imported: its one line
            continue
        name = description.name
        limits = effective(name, model_class(name, settings), settings, rows.get(name))
        normal = limits.lanes["normal"]
        spec, cls = settings.served[name], model_class(name, settings)
        table.add_row(
            name,
            cls.kind or "-",
            spec.checkpoint or "-",
            description.description,
            f"{normal.max_batch_size} ({limits.sources['max_batch_size']})",
            f"{normal.max_wait_s * 1000:g} ({limits.sources['max_wait_ms']})",
            f"{normal.max_batch_tokens or '-'} ({limits.sources['max_batch_tokens']})",
            f"{limits.lanes['high'].max_batch_size} / {limits.lanes['bulk'].max_batch_size}",
        )
        if limits.oom_flag:
            notes.append(f"{name}: {limits.oom_flag}")
    return [table, *notes]
