"""The OpenAI surface's pure parts: request bodies to items, batch files checked line by line, outputs to
OpenAI's response bodies and batch lines in input order (no servers, no weights)."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import orjson
import pytest

from worker.openai_compat.batchfile import _dump, answer_lines, answer_range, embedding_line, plan_batch
from worker.openai_compat.requests import CHAT, COMPLETIONS, EMBEDDINGS, RequestError, parse_request
from worker.openai_compat.responses import RawJson, response_body
from worker.settings import Settings

SETTINGS = Settings(models=["minilm", "noop", "gpt2", "tests.support.models:ChatEcho"])
CHAT_MODEL = "tests.support.models:ChatEcho"


def line(custom_id: str, body: dict[str, Any], url: str = EMBEDDINGS) -> bytes:
    return orjson.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def test_embedding_inputs_become_one_item_per_text() -> None:
    request = parse_request(EMBEDDINGS, {"model": "minilm", "input": ["a b", "c"]}, SETTINGS)
    assert request.items == ["a b", "c"] and request.encoding_format == "float"
    assert parse_request(EMBEDDINGS, {"model": "noop", "input": "x"}, SETTINGS).items == ["x"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "gpt2", "input": "x"}, "model"),
        ({"model": "nope", "input": "x"}, "model"),
        ({"model": "minilm", "input": ""}, "text"),
        ({"model": "minilm", "input": []}, "input"),
        ({"model": "minilm", "input": "x", "dimensions": 385}, "dimensions"),
        ({"model": "minilm", "input": "x", "encoding_format": "hex"}, "encoding_format"),
        ({"model": "minilm", "input": "x", "n": 2}, "n"),
        ({"model": "minilm", "input": "x", "temperature": 1}, "temperature"),
    ],
)
def test_a_bad_embeddings_body_names_its_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(RequestError) as refused:
        parse_request(EMBEDDINGS, body, SETTINGS)
    assert refused.value.param == param


def test_generation_bodies_take_openai_defaults_and_noop_serves_them() -> None:
    request = parse_request(COMPLETIONS, {"model": "gpt2", "prompt": ["a", "b"], "seed": 3}, SETTINGS)
    assert request.items == [
        {"prompt": "a", "max_new_tokens": 16, "temperature": 1.0, "seed": 3},
        {"prompt": "b", "max_new_tokens": 16, "temperature": 1.0, "seed": 3},
    ]
    chat = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4}
    assert parse_request(CHAT, chat, SETTINGS).items[0]["max_new_tokens"] == 4
    assert parse_request(CHAT, {**chat, "model": "noop"}, SETTINGS).items == ["hi"]
    # gpt2 is the generate kind now: chat messages reach it as messages, for its chat template.
    assert parse_request(CHAT, {**chat, "model": "gpt2"}, SETTINGS).items[0]["messages"] == chat["messages"]


def test_a_batch_file_reports_every_bad_line_and_keeps_no_items() -> None:
    lines = [
        line("a", {"model": "noop", "input": "x"}),
        b"not json",
        line("a", {"model": "noop", "input": "y"}),
        line("c", {"model": "noop", "input": "y"}, url=COMPLETIONS),
        b"",
        line("d", {"model": "minilm", "input": "y", "extra": 1}),
    ]
    plan = plan_batch(lines, EMBEDDINGS, SETTINGS)
    assert [(e.line, e.code) for e in plan.errors] == [
        (2, "invalid_json"),
        (3, "duplicate_custom_id"),
        (4, "mismatched_url"),
        (6, "invalid_request"),
    ]
    assert plan.errors[3].param == "body.extra"


def test_answers_follow_input_order_across_models_and_name_missing_items() -> None:
    lines = [
        line("m0", {"model": "minilm", "input": ["p", "q"]}),
        line("n0", {"model": "noop", "input": "x"}),
        line("m1", {"model": "minilm", "input": "r", "dimensions": 2, "encoding_format": "base64"}),
        line("m2", {"model": "minilm", "input": "s"}),
    ]
    plan = plan_batch(lines, EMBEDDINGS, SETTINGS)
    assert plan.items == {"minilm": ["p", "q", "r", "s"], "noop": ["x"]}
    minilm = iter([(0, [1.0, 0.0, 0.0], None), (1, [0.0, 1.0, 0.0], None), (2, [3.0, 4.0, 9.0], None)])
    noop = iter([(0, 0, None)])
    answers = list(answer_lines(plan, {"minilm": minilm, "noop": noop}, "batch_x", "cancelled"))
    assert [a.ok for a in answers] == [True, True, True, False]
    bodies = [orjson.loads(a.line) for a in answers]
    assert [b["custom_id"] for b in bodies] == ["m0", "n0", "m1", "m2"]
    assert [d["embedding"] for d in bodies[0]["response"]["body"]["data"]] == [
        [1.0, 0.0, 0.0],
        [0.0, 1.0, 0.0],
    ]
    assert bodies[1]["response"]["body"]["data"][0]["embedding"] == [0.0]
    packed = bodies[2]["response"]["body"]["data"][0]["embedding"]
    assert np.allclose(np.frombuffer(base64.b64decode(packed), dtype="<f4"), [0.6, 0.8])
    assert bodies[3]["response"] is None and bodies[3]["error"]["code"] == "batch_cancelled"
    assert bodies[0]["id"] == f"batch_req_{bodies[0]['response']['request_id']}"


def test_completion_and_chat_bodies_are_openais() -> None:
    output = {"text": "ok", "tokens": 2, "finish_reason": "eos", "prompt_tokens": 5}
    completion = parse_request(COMPLETIONS, {"model": "gpt2", "prompt": "p"}, SETTINGS)
    body = response_body(completion, [output], "r1")
    assert body["object"] == "text_completion" and body["id"] == "cmpl-r1"
    assert body["choices"] == [{"index": 0, "text": "ok", "logprobs": None, "finish_reason": "stop"}]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    chat = parse_request(CHAT, {"model": "noop", "messages": [{"role": "user", "content": "hi"}]}, SETTINGS)
    body = response_body(chat, [0], "r2")
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "", "refusal": None}


@pytest.mark.parametrize(
    ("custom_id", "texts", "outputs", "tokens"),
    [
        ("n-1", "x", ["0"], None),
        ('quote " and é \\ ✓', ["a", "b"], ["[0.25,-1.5e-07,3.0]", "[1.0]"], 7),
        ("bytes", "y", [b"[0.5,0.5]"], 0),
    ],
)
def test_a_joined_embeddings_line_is_the_bytes_of_the_generic_answer(
    custom_id: str, texts: Any, outputs: list[Any], tokens: int | None
) -> None:
    plan = plan_batch([line(custom_id, {"model": "noop", "input": texts})], EMBEDDINGS, SETTINGS)
    batch_line = plan.lines[0]
    stored = [RawJson(output) for output in outputs]
    counted = None if tokens is None else (lambda _: [tokens])
    body = response_body(batch_line.request, stored, "abc", counted)
    generic = _dump("abc", custom_id, {"status_code": 200, "request_id": "abc", "body": body}, None)
    assert embedding_line("abc", batch_line, stored, tokens) == generic


def test_a_range_of_lines_is_answered_from_its_models_items_mid_way() -> None:
    lines = [
        line("a", {"model": "noop", "input": ["p", "q"]}),
        line("b", {"model": "minilm", "input": "r"}),
        line("c", {"model": "noop", "input": "s"}),
        line("d", {"model": "minilm", "input": ["t", "u"]}),
    ]
    plan = plan_batch(lines, EMBEDDINGS, SETTINGS)
    assert [batch_line.first for batch_line in plan.lines] == [0, 0, 2, 1]
    noop = iter([(2, 0, None)])
    minilm = iter([(1, [1.0], None), (2, [2.0], "invalid input: too long")])
    answers = list(answer_range(plan.lines[2:], {"noop": noop, "minilm": minilm}, "batch_y", "cancelled"))
    assert [(a.ok, orjson.loads(a.line)["custom_id"]) for a in answers] == [(True, "c"), (False, "d")]
    assert orjson.loads(answers[1].line)["response"]["status_code"] == 400


def test_the_collector_resumes_when_the_last_pausing_thread_leaves() -> None:
    """Two threads pause the process-wide collector and leave in the other order: it stays paused until the
    second leaves, then runs again; one that was off before anyone paused it stays off."""
    import gc
    import threading

    from worker.openai_compat.batchfile import collection_paused

    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen: list[bool] = []

    def first() -> None:
        with collection_paused():
            first_in.set()
            second_in.wait(5)
        first_out.set()

    def second() -> None:
        first_in.wait(5)
        with collection_paused():
            second_in.set()
            first_out.wait(5)
            seen.append(gc.isenabled())  # the first left while this one is still inside

    was = gc.isenabled()
    gc.enable()
    try:
        threads = [threading.Thread(target=first), threading.Thread(target=second)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        assert seen == [False] and gc.isenabled()
        gc.disable()
        with collection_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable() if was else gc.disable()
