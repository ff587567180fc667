"""One batch's run: an output or an error per item, never both, never neither."""

from __future__ import annotations

import math

import numpy as np

from worker.runtime.forward import NO_OUTPUT, run_batch


def test_an_output_json_cannot_hold_is_that_item_s_error_and_the_rest_stand() -> None:
    outputs = [1.5, math.nan, -math.inf, np.float32("nan"), None, [1.0, 2.0], np.float64(0.25), 7]
    report = run_batch(lambda payloads: outputs, list(range(len(outputs))))
    cannot = "the model returned {} for this item, which JSON cannot hold"
    assert report.errors == [None, cannot.format("nan"), cannot.format("-inf"), cannot.format("nan"),
                             NO_OUTPUT, None, None, None]  # fmt: skip
    assert report.outputs == [1.5, None, None, None, None, [1.0, 2.0], np.float64(0.25), 7]


def test_a_batch_of_plain_outputs_is_kept_as_it_came() -> None:
    outputs = [[0.5] * 4, {"label": "a"}, "text", 0]
    report = run_batch(lambda payloads: outputs, [0, 1, 2, 3])
    assert report.outputs == outputs and report.errors == [None] * 4


def test_a_vector_holding_nan_or_infinity_is_that_item_s_error() -> None:
    # An embedding gone wrong (an fp16 overflow) would be stored as a row of nulls: refused, row by row.
    rows = np.array([[0.5, 0.25], [np.nan, 1.0], [1.0, np.inf]], dtype=np.float32)
    outputs: list[object] = [
        *rows,
        [0.5, math.nan],
        (1e308, 1e308),
        [1, "a", None],
        [10**400, 1.5],
        [[math.nan]],
    ]
    report = run_batch(lambda payloads: outputs, list(range(len(outputs))))
    vector = "the model returned a vector holding NaN or infinity for this item, which JSON cannot hold"
    # A sum that overflows alone (1e308 twice) is finite item by item; a list of lists is not looked into.
    assert report.errors == [None, vector, vector, vector, None, None, None, None]
