"""`batchwork tune MODEL --from-history`: no sweep; fit run time ~ a + b * padded tokens over the stored
batches (what production actually ran) and say whether the limits in force still meet each lane's bound.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from rich.console import Console
from rich.table import Table

from worker.settings import Settings
from worker.tuning.choice import lane_bounds
from worker.tuning.history import MARGIN_SIGMAS, NotEnoughHistory, fit_cost
from worker.tuning.limits import effective, read_tuned
from worker.tuning.request import TuneError, TuneRequest

HISTORY_WINDOW = timedelta(days=7)


def from_history(request: TuneRequest, settings: Settings) -> dict[str, Any]:
    from worker.models.device import device_kind, resolve_device
    from worker.models.registry import model_class
    from worker.store.tuned import TunedLimits

    device = resolve_device(settings.device)
    kind = device_kind(device)
    tuned = read_tuned(settings.database_url, kind)
    if isinstance(tuned, str):
        raise TuneError(f"--from-history: {tuned}")
    store = TunedLimits.from_url(settings.database_url)
    try:
        rows = store.batches(request.model, HISTORY_WINDOW)
    finally:
        store.close()
    try:
        fit = fit_cost([r.padded_tokens for r in rows], [r.run_ms for r in rows])
    except NotEnoughHistory as exc:
        raise TuneError(
            f"--from-history: {request.model}: {exc} in the last {HISTORY_WINDOW.days} days"
        ) from None
    # The longest item a batch held, as history saw it: what a count-only limit multiplies by.
    longest = max(r.padded_tokens // max(1, r.size) for r in rows)
    limits = effective(
        request.model, model_class(request.model, settings), settings, tuned.get(request.model)
    )
    lanes: dict[str, dict[str, Any]] = {}
    for lane, bound in lane_bounds(request.max_batch_ms).items():
        policy = limits.lanes[lane]
        worst = policy.max_batch_tokens or policy.max_batch_size * longest
        worst = min(worst, policy.max_batch_size * longest)
        predicted = fit.predict_ms(worst)
        lanes[lane] = {
            "bound_ms": bound,
            "max_batch_size": policy.max_batch_size,
            "max_batch_tokens": policy.max_batch_tokens,
            "max_wait_ms": round(policy.max_wait_s * 1000, 3),
            "worst_padded_tokens": worst,
            "predicted_ms": round(predicted, 2),
            "meets_bound": fit.meets(worst, bound),
        }
    normal = lanes["normal"]
    return {
        "model": request.model,
        "device": device,
        "device_kind": kind,
        "max_batch_ms": request.max_batch_ms,
        "max_batch_size": normal["max_batch_size"],
        "max_batch_tokens": normal["max_batch_tokens"],
        "max_wait_ms": normal["max_wait_ms"],
        "p99_batch_ms": normal["predicted_ms"],
        "items_per_s": round(normal["max_batch_size"] / normal["predicted_ms"] * 1000, 1),
        "fit": {
            "a_ms": round(fit.a_ms, 4),
            "b_ms_per_token": round(fit.b_ms_per_token, 6),
            "rmse_ms": round(fit.rmse_ms, 3),
            "r2": round(fit.r2, 5),
            "batches": fit.rows,
            "longest_item_tokens": longest,
        },
        "sources": limits.sources,
        "lanes": lanes,
    }


def print_fit(console: Console, result: dict[str, Any]) -> None:
    fit = result["fit"]
    console.print(
        f"{result['model']}: run_ms ~ {fit['a_ms']:.2f} + {fit['b_ms_per_token']:.4f} x padded tokens over "
        f"{fit['batches']} stored batches (rmse {fit['rmse_ms']:.2f} ms, r2 {fit['r2']:.3f})",
        highlight=False,
    )
    table = Table("lane", "N", "max_batch_tokens", "worst padded tokens", "predicted ms", "bound ms", "meets")
    for lane, row in result["lanes"].items():
        table.add_row(
            lane,
            str(row["max_batch_size"]),
            str(row["max_batch_tokens"] or "-"),
            str(row["worst_padded_tokens"]),
            f"{row['predicted_ms']:.1f}",
            f"{row['bound_ms']:g}",
            "yes" if row["meets_bound"] else f"NO (prediction + {MARGIN_SIGMAS:g} rmse over the bound)",
        )
    console.print(table)
