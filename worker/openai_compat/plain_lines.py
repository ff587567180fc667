"""A whole batch file of plain embeddings lines checked in one pass: ``plain_plan``.

Nearly every large batch file is made by a script, one line per text:
``{"custom_id": "...", "method": "POST", "url": "/v1/embeddings", "body": {"model": "...", "input": "..."}}``.
Such a file is parsed as one JSON array (one ``orjson.loads`` call in place of one per line) and its
lines are checked together: the models once each, the custom_ids as one set. Anything else (another field,
a list of inputs, a blank line, a duplicate id, an input the model refuses) makes ``plain_plan`` answer
None, and the caller checks the file line by line (``batchfile.plan_batch``), which finds every error and
its line exactly as before: this pass only ever accepts a file that one would accept too, with the same
plan.

Why one array is the file's lines: each newline is replaced by a comma, and every line begins with ``{``,
so each newline becomes ``,{`` (a blank line would be ``,,``: not JSON). Every value must be a plain
object, whose only nested object is its ``body`` (after ``"body":``, where no comma may sit) and whose only
values are strings, none of which holds ``,{``. So no value holds a newline's ``,{``: none spans two lines,
and as many values as lines means one value per line. (A string that did hold ``,{`` could be one line's
end and the next line's start, a value of two lines, made up for by a line of two values.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson

from worker.jsonl import BOM
from worker.models.base import Model
from worker.openai_compat.batchfile import MAX_CUSTOM_ID_CHARS, BatchLine, BatchPlan, collection_paused
from worker.openai_compat.requests import EMBEDDINGS, Request, RequestError, model_for

if TYPE_CHECKING:
    from worker.settings import Settings

_LINE_KEYS = frozenset(("custom_id", "method", "url", "body"))
_BODY_KEYS = frozenset(("model", "input"))
_TEXT_CHECK = Model.__dict__["validate"].__func__  # the common check of a text (a classmethod's function)


def plain_plan(data: bytes, endpoint: str | None, settings: Settings, check: bool = True) -> BatchPlan | None:
    """The plan of ``data`` (a whole file) if every line is a plain embeddings request that runs; None for
    any other file (``plan_batch`` it line by line). ``endpoint``, ``check`` as ``plan_batch`` takes them."""
    if endpoint not in (None, EMBEDDINGS):
        return None
    with collection_paused():
        return _plan(data, settings, check)


def _plan(data: bytes, settings: Settings, check: bool) -> BatchPlan | None:
    values = _values(data)
    if values is None or len(values) > settings.max_items_per_job:
        return None
    fields = _fields(values)
    if fields is None:
        return None
    ids, models, texts = fields
    names = dict.fromkeys(models)
    for name in names:
        cls = _model(name, settings)
        if cls is None:
            return None
        own = texts if len(names) == 1 else [t for t, m in zip(texts, models, strict=True) if m == name]
        if check and not _runs(cls, own, settings):
            return None
    return _made(ids, models, texts)


def _fields(values: list[Any]) -> tuple[list[str], list[str], list[str]] | None:
    """Each line's custom_id, model and input if every line is a plain embeddings request with a unique
    custom_id; None otherwise. A pass per check over the whole list (each a tight loop in C, nearly)."""
    if not all(type(value) is dict and value.keys() <= _LINE_KEYS for value in values):
        return None
    ids = [value.get("custom_id") for value in values]
    bodies = [value.get("body") for value in values]
    if not (
        all(type(custom_id) is str and 0 < len(custom_id) <= MAX_CUSTOM_ID_CHARS for custom_id in ids)
        and len(set(ids)) == len(ids)  # a duplicate custom_id: its error names the line
        and all(value.get("url") == EMBEDDINGS and value.get("method", "POST") == "POST" for value in values)
        and all(type(body) is dict and body.keys() == _BODY_KEYS for body in bodies)
    ):
        return None
    texts = [body["input"] for body in bodies]
    models = [body["model"] for body in bodies]
    if not all(type(text) is str for text in texts) or not all(type(model) is str for model in models):
        return None
    if any(",{" in "\n".join(strings) for strings in (ids, models, texts)):  # maybe a string of two lines
        return None
    return ids, models, texts


def _values(data: bytes) -> list[Any] | None:
    """The file's lines as one list, or None if it is not one JSON object per line, every line ``{...``."""
    data = data.removeprefix(BOM).rstrip(b"\n\r\t ")
    if not data.startswith(b"{"):
        return None
    newlines = data.count(b"\n")
    if data.count(b"\n{") != newlines:  # a blank line, or a line that begins with anything else
        return None
    try:
        values = orjson.loads(b"[" + data.replace(b"\n", b",") + b"]")
    except orjson.JSONDecodeError:
        return None
    return values if len(values) == newlines + 1 else None


def _model(name: str, settings: Settings) -> type[Model] | None:
    try:
        return model_for(name, EMBEDDINGS, settings)
    except RequestError:
        return None


def _runs(cls: type[Model], texts: list[str], settings: Settings) -> bool:
    """Does the model take every text? The common check (``Model.validate``: a non-blank string of at most
    BATCHWORK_MAX_INPUT_CHARS) over the whole list at once, a model's own check text by text."""
    if getattr(cls.validate, "__func__", None) is _TEXT_CHECK:  # not overridden
        return all(map(str.strip, texts)) and max(map(len, texts)) <= settings.max_input_chars
    try:
        for text in texts:
            cls.validate(0, text, settings)
    except Exception:  # refused (or its check broke): the line by line pass words the error
        return False
    return True


def _made(ids: list[str], models: list[str], texts: list[str]) -> BatchPlan:
    """The plan of checked lines: one request of one text each, its items the next of its model's."""
    plan = BatchPlan()
    lines = plan.lines
    items = plan.items
    for number, (custom_id, model, text) in enumerate(zip(ids, models, texts, strict=True), start=1):
        model_items = items.get(model)
        if model_items is None:
            model_items = items[model] = []
        one = [text]  # the request's items and texts: the one list, as parse_request makes it
        lines.append(
            BatchLine(
                number, custom_id, Request(EMBEDDINGS, model, one, "float", None, one), len(model_items)
            )
        )
        model_items.append(text)
    return plan
