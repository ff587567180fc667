"""Waits for the results of synchronous requests (POST /v1/embeddings): one poller per API process reads the
stored results of every waiting job in one query every POLL_S, so 32 waiting clients cost one query, not 32.
"""

from __future__ import annotations

import asyncio
import contextlib

from starlette.concurrency import run_in_threadpool

from worker.store.outputs import OutputOrError, outcomes_of
from worker.store.results import ResultStore

POLL_S = 0.005  # between reads while some request waits (each read is one indexed query)


class ResultWaiter:
    def __init__(self, store: ResultStore) -> None:
        self.store = store
        self._waiting: dict[str, tuple[int, asyncio.Future[list[OutputOrError]]]] = {}
        self._poller: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None

    async def wait(self, job_id: str, total: int, timeout_s: float) -> list[OutputOrError] | None:
        """The outcomes of the job's ``total`` items in index order, or None after ``timeout_s``."""
        future: asyncio.Future[list[OutputOrError]] = asyncio.get_running_loop().create_future()
        self._waiting[job_id] = (total, future)
        self._ensure_poller()
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout_s)
        except TimeoutError:
            return None
        finally:
            self._waiting.pop(job_id, None)

    def _ensure_poller(self) -> None:
        if self._wake is None:
            self._wake = asyncio.Event()
        self._wake.set()
        if self._poller is None or self._poller.done():
            self._poller = asyncio.ensure_future(self._poll())

    async def _poll(self) -> None:
        assert self._wake is not None
        while True:
            if not self._waiting:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), 60)
                if not self._waiting:
                    return
            job_ids = list(self._waiting)
            try:
                rows = await run_in_threadpool(self._read, job_ids)
            except Exception as exc:  # the database away: every waiter gets the error (a 503)
                for _, future in list(self._waiting.values()):
                    if not future.done():
                        future.set_exception(exc)
                self._waiting.clear()
                continue
            for job_id, outcomes in rows.items():
                entry = self._waiting.get(job_id)
                if entry is not None and len(outcomes) >= entry[0] and not entry[1].done():
                    entry[1].set_result([outcomes[index] for index in range(entry[0])])
            await asyncio.sleep(POLL_S)

    def _read(self, job_ids: list[str]) -> dict[str, dict[int, OutputOrError]]:
        return outcomes_of(self.store.engine, job_ids)
