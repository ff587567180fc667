"""OpenAI batch files: input lines ``{custom_id, method, url, body}`` checked and made into each model's items
(``plan_batch``), and stored results made into output and error lines in input order (``answer_lines``).

Items of one model keep the order of their lines, so a line's results are the next ones of its model: a
plan made again from the same file finds every line's results without any stored map. The HTTP API's
``/v1/batches`` and ``batchwork run`` both use it.
"""

from __future__ import annotations

import gc
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import chain, islice
from typing import TYPE_CHECKING, Any

import orjson

from worker.models.registry import shown
from worker.openai_compat.requests import (
    EMBEDDINGS,
    ENDPOINT_KINDS,
    Detokenizer,
    Request,
    RequestError,
    parse_request,
)
from worker.openai_compat.responses import OutputError, RawJson, error_object, response_body

if TYPE_CHECKING:
    from worker.settings import Settings

MAX_CUSTOM_ID_CHARS = 512
MAX_REPORTED_ERRORS = 100  # errors.data[] of a batch that failed validation lists at most this many
ANSWER_CHUNK_LINES = 1000  # lines answered at once (their inputs' tokens are counted in one call)
_REQUEST_IDS = uuid.UUID("8a1d7f0e-3c55-4f7e-9a58-0b6d8a3c2e11")


@dataclass(frozen=True, slots=True)
class LineError:
    """Why a line of an input file cannot run: OpenAI's ``errors.data[]`` entry (``line`` from 1)."""

    code: str
    message: str
    line: int
    param: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "line": self.line, "param": self.param}


@dataclass(slots=True)  # not frozen: one is made per line of a file, and a frozen one costs 3x to make
class BatchLine:
    number: int  # the line in the file, from 1
    custom_id: str
    request: Request
    first: int = 0  # the index of its first item among its model's items (the job's item index)


@dataclass
class BatchPlan:
    """A file's requests in line order, each model's items in that order, and every mistake found."""

    lines: list[BatchLine] = field(default_factory=list)
    items: dict[str, list[Any]] = field(default_factory=dict)
    errors: list[LineError] = field(default_factory=list)
    error_count: int = 0

    @property
    def endpoints(self) -> set[str]:
        return {line.request.endpoint for line in self.lines}


def plan_batch(
    lines: Iterable[bytes],
    endpoint: str | None,
    settings: Settings,
    detokenize: Detokenizer | None = None,
    check: bool = True,
) -> BatchPlan:
    """Every non-blank line of a batch file, checked. ``endpoint`` is the batch's (each line's ``url`` must
    name it); None takes each line's own ``url`` (``batchwork run``). Items are kept only while no line has
    failed: a plan with errors is only reported, never run."""
    plan = BatchPlan()
    seen: set[str] = set()
    classes: dict[tuple[str, str], Any] = {}
    number = 0
    with collection_paused():
        for number, raw in enumerate(lines, start=1):
            if not raw or raw.isspace():
                continue
            try:
                custom_id, request = _line(raw, endpoint, seen, settings, detokenize, check, classes)
            except _Refused as refused:
                plan.error_count += 1
                if len(plan.errors) < MAX_REPORTED_ERRORS:
                    plan.errors.append(LineError(refused.code, refused.message, number, refused.param))
                continue
            seen.add(custom_id)
            if plan.error_count:
                continue
            items = plan.items.get(request.model)
            if items is None:
                items = plan.items[request.model] = []
            plan.lines.append(BatchLine(number, custom_id, request, len(items)))
            items.extend(request.items)
            if len(items) > settings.max_items_per_job:
                plan.errors.append(_too_many(request.model, number, settings))
                plan.error_count += 1
    if not plan.lines and not plan.error_count:
        plan.errors.append(LineError("empty_file", "the file holds no requests", max(number, 1)))
        plan.error_count = 1
    return plan


@contextmanager
def collection_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused while a file is read or its answers are made: its lines become
    hundreds of thousands of objects (and no cycles), and the full collections that so many allocations set
    off once took half of the time of checking a file, and of writing answers in an API process that holds
    a plan. The collector is process-wide and several threads pause it at once (the API's checker and its
    batch runner): it resumes when the last of them leaves, and only if it ran before the first came."""
    global _pausers, _resume
    with _pause_lock:
        if _pausers == 0:
            _resume = gc.isenabled()
            gc.disable()
        _pausers += 1
    try:
        yield
    finally:
        with _pause_lock:
            _pausers -= 1
            if _pausers == 0 and _resume:
                gc.enable()


_pause_lock = threading.Lock()
_pausers = 0  # threads inside collection_paused now
_resume = False  # whether the collector ran before the first of them paused it


def _too_many(model: str, number: int, settings: Settings) -> LineError:
    message = (
        f"more than {settings.max_items_per_job} inputs for model {model!r} in one batch "
        "(BATCHWORK_MAX_ITEMS_PER_JOB)"
    )
    return LineError("too_many_requests", message, number)


class _Refused(Exception):
    """Why a line cannot run (its number is added by the caller)."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


def _line(
    raw: bytes,
    endpoint: str | None,
    seen: set[str],
    settings: Settings,
    detokenize: Detokenizer | None,
    check: bool,
    classes: dict[tuple[str, str], Any],
) -> tuple[str, Request]:
    """A line's custom_id and request; _Refused saying why not."""
    try:
        line = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise _Refused("invalid_json", f"not valid JSON ({exc.msg}, column {exc.colno})") from None
    if not isinstance(line, dict):
        raise _Refused("invalid_request", "a line must be a JSON object {custom_id, method, url, body}")
    custom_id = _custom_id(line.get("custom_id"), seen)
    if line.get("method", "POST") != "POST":
        raise _Refused("invalid_method", "field 'method' must be POST", "method")
    url = line.get("url")
    if url not in ENDPOINT_KINDS:
        raise _Refused("invalid_url", f"field 'url' must be one of {', '.join(ENDPOINT_KINDS)}", "url")
    if endpoint is not None and url != endpoint:
        raise _Refused("mismatched_url", f"url {url} is not the batch's endpoint {endpoint}", "url")
    try:
        request = parse_request(str(url), line.get("body"), settings, detokenize, check, classes)
    except RequestError as exc:
        param = f"body.{exc.param}" if exc.param else "body"
        raise _Refused(exc.code, f"{exc.message}", param) from None
    return custom_id, request


def _custom_id(value: object, seen: set[str]) -> str:
    if not isinstance(value, str) or not value:
        message = "missing field 'custom_id' (a non-empty string)"
        raise _Refused("missing_required_parameter", message, "custom_id")
    if len(value) > MAX_CUSTOM_ID_CHARS:
        message = f"'custom_id' is over {MAX_CUSTOM_ID_CHARS} characters"
        raise _Refused("invalid_custom_id", message, "custom_id")
    if value in seen:
        raise _Refused("duplicate_custom_id", f"custom_id {shown(value, 60)} appears twice", "custom_id")
    return value


# -- answers --------------------------------------------------------------------------------------


@dataclass(slots=True)  # not frozen: one per line written (see BatchLine)
class Answer:
    """One output line (``ok``) or error line, as bytes with its newline."""

    ok: bool
    line: bytes


# One model's stored items in index order, as (index, output, error) tuples (ItemResult less the user id).
StoredResults = Iterator[tuple[int, Any, str | None]]
# Counts tokens of texts for a model, for ``usage``.
Counter = Callable[[str, list[str]], list[int]]


def request_id(batch_key: str, line: int) -> str:
    """A request's id: its batch's (hashed) and its line, 32 hex digits like OpenAI's."""
    return f"{batch_key}{line:012x}"


def batch_key(batch_id: str) -> str:
    return uuid.uuid5(_REQUEST_IDS, batch_id).hex[:20]


def answer_lines(
    plan: BatchPlan,
    outcomes: dict[str, StoredResults],
    batch_id: str,
    missing: str,
    count_tokens: Counter | None = None,
) -> Iterator[Answer]:
    """Every line of ``plan`` answered in input order from its model's ``outcomes``; an item with no stored
    outcome fails with ``missing`` (e.g. ``cancelled`` or ``expired: ...``)."""
    return answer_range(plan.lines, outcomes, batch_id, missing, count_tokens)


def answer_range(
    lines: Iterable[BatchLine],
    outcomes: dict[str, StoredResults],
    batch_id: str,
    missing: str,
    count_tokens: Counter | None = None,
) -> Iterator[Answer]:
    """``lines`` (consecutive lines of a plan) answered in order from each model's ``outcomes``, which start
    at the first item of that model's first line here."""
    taken = list(lines)
    starts: dict[str, int] = {}
    for line in taken:
        starts.setdefault(line.request.model, line.first)
    cursors = {model: _Cursor(outcomes.get(model, iter(())), start) for model, start in starts.items()}
    key = batch_key(batch_id)
    rest = iter(taken)
    while chunk := list(islice(rest, ANSWER_CHUNK_LINES)):
        with collection_paused():
            plain = _plain_model(chunk)
            if plain is not None:
                answers = _plain_answers(key, chunk, cursors[plain], missing, count_tokens)
            else:
                results = [
                    cursors[line.request.model].take(len(line.request.items), missing) for line in chunk
                ]
                tokens = _count_chunk(chunk, count_tokens)
                answers = [
                    _answer(key, line, outputs, error, tokens.get(line.number))
                    for line, (outputs, error) in zip(chunk, results, strict=True)
                ]
        yield from answers


def _plain_model(chunk: list[BatchLine]) -> str | None:
    """The model of a chunk of plain embeddings lines (one text each, of one model, float vectors as stored);
    None for any other chunk."""
    model = chunk[0].request.model
    for line in chunk:
        request = line.request
        if (
            len(request.items) != 1
            or request.model != model
            or request.endpoint != EMBEDDINGS
            or request.encoding_format != "float"
            or request.dimensions is not None
        ):
            return None
    return model


_PLAIN_LINE = (
    b'{"id":"batch_req_%s%012x","custom_id":%s,"response":{"status_code":200,"request_id":"%s%012x","body":'
    b'{"object":"list","data":[{"object":"embedding","index":0,"embedding":%s}],"model":%s,'
    b'"usage":{"prompt_tokens":%d,"total_tokens":%d}}},"error":null}\n'
)


def _plain_answers(
    key: str, chunk: list[BatchLine], cursor: _Cursor, missing: str, count_tokens: Counter | None
) -> list[Answer]:
    """A chunk of plain lines answered in bulk: its outcomes taken at once, its tokens counted in one call,
    each answered line one format of the bytes ``embedding_line`` makes (a line with an error, or an
    output stored otherwise, answered as any other)."""
    model = chunk[0].request.model
    results = cursor.take_run(len(chunk), missing)
    texts = [line.request.texts[0] for line in chunk]
    tokens = [0] * len(chunk) if count_tokens is None else count_tokens(model, texts)
    key_bytes, model_json = key.encode(), orjson.dumps(model)
    answers = []
    dumps = orjson.dumps
    for line, (output, error), count in zip(chunk, results, tokens, strict=True):
        if error is None and type(output) is RawJson:
            vector = output.text if isinstance(output.text, bytes) else output.text.encode()
            number = line.number
            text = _PLAIN_LINE % (
                key_bytes,
                number,
                dumps(line.custom_id),
                key_bytes,
                number,
                b"[0.0]" if vector == b"0" else vector,
                model_json,
                count,
                count,
            )
            answers.append(Answer(True, text))
        else:
            answers.append(_answer(key, line, [output], error, None if count_tokens is None else count))
    return answers


def _count_chunk(chunk: list[BatchLine], count_tokens: Counter | None) -> dict[int, int]:
    """Input tokens of each embeddings line of the chunk, counted in one call per model."""
    if count_tokens is None:
        return {}
    by_model: dict[str, list[BatchLine]] = {}
    for line in chunk:
        if line.request.endpoint == EMBEDDINGS:
            by_model.setdefault(line.request.model, []).append(line)
    counted: dict[int, int] = {}
    for model, lines in by_model.items():
        counts = iter(count_tokens(model, [text for line in lines for text in line.request.texts]))
        for line in lines:
            counted[line.number] = sum(islice(counts, len(line.request.texts)))
    return counted


class _Cursor:
    """Walks one model's outcomes by item index; an index with no outcome is ``missing``."""

    def __init__(self, outcomes: StoredResults, start: int = 0) -> None:
        self._outcomes = outcomes
        self._next = next(outcomes, None)
        self._index = start

    def take_run(self, count: int, missing: str) -> list[tuple[Any, str | None]]:
        """The outcomes of the next ``count`` items, one each: at once when they are all stored (indices
        are unique and ascending, so a run from the next index that ends ``count - 1`` later has no gap)."""
        start = self._index
        if self._next is not None and self._next[0] == start:
            run = [self._next, *islice(self._outcomes, count - 1)]
            if len(run) == count and run[-1][0] == start + count - 1:
                self._next = next(self._outcomes, None)
                self._index += count
                return [(output, error) for _, output, error in run]
            self._outcomes = chain(run[1:], self._outcomes)  # a gap: item by item, from the same place
        taken = []
        for _ in range(count):
            outputs, error = self.take(1, missing)
            taken.append((outputs[0], error))
        return taken

    def take(self, count: int, missing: str) -> tuple[list[Any], str | None]:
        outputs: list[Any] = []
        first_error: str | None = None
        for index in range(self._index, self._index + count):
            while self._next is not None and self._next[0] < index:
                self._next = next(self._outcomes, None)
            if self._next is not None and self._next[0] == index:
                _, output, error = self._next
                self._next = next(self._outcomes, None)
            else:
                output, error = None, missing
            outputs.append(output)
            if error is not None and first_error is None:
                first_error = error
        self._index += count
        return outputs, first_error


def _answer(key: str, line: BatchLine, outputs: list[Any], error: str | None, tokens: int | None) -> Answer:
    rid = request_id(key, line.number)
    if error is None:
        joined = embedding_line(rid, line, outputs, tokens)
        if joined is not None:
            return Answer(True, joined)
        try:
            body = response_body(line.request, outputs, rid, None if tokens is None else lambda _: [tokens])
        except OutputError as exc:
            error = f"invalid input: {exc}"
        else:
            response = {"status_code": 200, "request_id": rid, "body": body}
            return Answer(True, _dump(rid, line.custom_id, response, None))
    status, detail = error_object(error)
    if status is None:
        return Answer(False, _dump(rid, line.custom_id, None, detail))
    response = {"status_code": status, "request_id": rid, "body": {"error": detail}}
    return Answer(False, _dump(rid, line.custom_id, response, None))


_EMBEDDING = b'{"object":"embedding","index":%d,"embedding":%s}'
_EMBEDDING_LINE = (
    b'{"id":"batch_req_%s","custom_id":%s,"response":{"status_code":200,"request_id":"%s","body":'
    b'{"object":"list","data":[%s],"model":%s,"usage":{"prompt_tokens":%d,"total_tokens":%d}}},"error":null}\n'
)


def embedding_line(rid: str, line: BatchLine, outputs: list[Any], tokens: int | None) -> bytes | None:
    """The output line of an embeddings request whose vectors go out as stored (float, no ``dimensions``):
    the very bytes ``_dump`` makes of ``response_body``, joined without building the dicts, which was most
    of the cost of a large batch's output. None for any other request."""
    request = line.request
    if request.endpoint != EMBEDDINGS or request.encoding_format != "float" or request.dimensions is not None:
        return None
    pieces = []
    for index, output in enumerate(outputs):
        if not isinstance(output, RawJson):
            return None
        text = output.text if isinstance(output.text, bytes) else output.text.encode()
        pieces.append(_EMBEDDING % (index, b"[0.0]" if text == b"0" else text))
    data = pieces[0] if len(pieces) == 1 else b",".join(pieces)
    rid_bytes = rid.encode()
    count = tokens or 0
    custom_id, model = orjson.dumps(line.custom_id), orjson.dumps(request.model)
    return _EMBEDDING_LINE % (rid_bytes, custom_id, rid_bytes, data, model, count, count)


def _dump(rid: str, custom_id: str, response: Any, error: Any) -> bytes:
    line = {"id": f"batch_req_{rid}", "custom_id": custom_id, "response": response, "error": error}
    return orjson.dumps(line, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_APPEND_NEWLINE)
