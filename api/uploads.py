"""Batch input files checked as they arrive: an upload of at most CACHED_BYTES is kept in this API process
with its bytes, and its check (``checked_plan``) starts in a thread of its own while the bytes are written
to the store, so that the batch made of it starts its jobs without reading the file back or checking it
then.

Only a speed-up: every API process can still plan any file from the store (``BatchRunner.plan``), and a
plan made here is used only where it is the one the batch's own check would make (``UploadCache.plan``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from worker.jsonl import BOM
from worker.openai_compat.batchfile import BatchPlan, plan_batch
from worker.openai_compat.plain_lines import plain_plan
from worker.openai_compat.tokens import detokenize

if TYPE_CHECKING:
    from worker.settings import Settings

CACHED_BYTES = 32 * 2**20  # uploads up to this size are kept here and checked as they are stored
KEPT_UPLOADS = 2  # the most recent ones (a batch is usually made of the file just uploaded)


def file_lines(data: bytes) -> list[bytes]:
    """A whole file's lines as ``FileStore.lines`` gives them from the store: a leading BOM dropped, no
    empty last line after the final newline."""
    lines = data.removeprefix(BOM).split(b"\n")
    if lines[-1] == b"":
        lines.pop()
    return lines


def checked_plan(data: bytes, endpoint: str | None, settings: Settings, check: bool = True) -> BatchPlan:
    """The plan of a whole file: the one-pass check of plain embeddings lines (``plain_plan``), or else line
    by line, which finds the same plan and every error."""
    plan = plain_plan(data, endpoint, settings, check)
    if plan is not None:
        return plan
    return plan_batch(file_lines(data), endpoint, settings, detokenize, check)


class UploadCache:
    """The last KEPT_UPLOADS small uploads' bytes and their checks (made with no endpoint: each line's
    own ``url``), by file id."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._lock = threading.Lock()
        self._kept: OrderedDict[str, tuple[bytes, Future[BatchPlan]]] = OrderedDict()
        self._checker = ThreadPoolExecutor(1, thread_name_prefix="batchwork-upload-check")

    def put(self, file_id: str, data: bytes) -> None:
        """Keep ``data`` and start its check."""
        checked = self._checker.submit(checked_plan, data, None, self.settings)
        with self._lock:
            self._kept[file_id] = (data, checked)
            while len(self._kept) > KEPT_UPLOADS:
                self._kept.popitem(last=False)

    def drop(self, file_id: str) -> None:
        with self._lock:
            self._kept.pop(file_id, None)

    def data(self, file_id: str) -> bytes | None:
        with self._lock:
            kept = self._kept.get(file_id)
        return None if kept is None else kept[0]

    def plan(self, file_id: str, endpoint: str) -> BatchPlan | None:
        """The upload's plan (waiting for its check) if it is the batch's: no line failed and every line
        names ``endpoint`` (a line checked against its own url passes or fails as it would against the
        batch's, the same url). None otherwise: the batch checks the file itself."""
        with self._lock:
            kept = self._kept.get(file_id)
        if kept is None:
            return None
        try:
            plan = kept[1].result()
        except Exception:  # the check broke here: the batch's own check reports it
            return None
        if plan.error_count or not plan.endpoints <= {endpoint}:
            return None
        return plan

    def close(self) -> None:
        self._checker.shutdown(wait=False, cancel_futures=True)
