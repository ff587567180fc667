"""Where an NDJSON body's pieces are checked: a pool of processes (BATCHWORK_API_CHECK_PROCESSES, one per CPU
up to 8 by default), so one large upload parses and checks on every core while the API reads on; with 0, a
thread of the API's own.

Parsing and checking are Python for every line, and threads of one process share one interpreter lock. The
processes start with the app (spawned, never forked from a process that runs threads) and take pieces as
byte ranges of the body's temporary file, which they read themselves; only their verdicts and the messages'
parts, as byte ranges, come back.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from contextlib import suppress

from starlette.concurrency import run_in_threadpool

from api.spool import CheckedPiece, NdjsonSpool, Piece, check_piece, publisher, send_ranges
from worker.calls import NewJob
from worker.errors import SetupError
from worker.models.registry import UnknownModel, model_class
from worker.settings import Settings


class Checker:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.processes = settings.api_check_processes
        self._pool: ProcessPoolExecutor | None = None

    @property
    def width(self) -> int:
        """Pieces of one body worth checking at once."""
        return max(1, self.processes)

    def start(self) -> None:
        """Start the processes now, so that the first upload does not wait for them."""
        if self.processes:
            pool = self._running_pool()
            for future in [pool.submit(_ready, self.settings) for _ in range(self.processes)]:
                future.result()

    async def check(self, piece: Piece, model: str, priority: str) -> CheckedPiece:
        args = (piece, model, priority, self.settings)
        if not self.processes:
            return await run_in_threadpool(check_piece, *args)
        # A pool whose process died is found broken only by its next use, and the pool's own thread may see it
        # after a piece was submitted: so a piece that meets a broken pool runs once more on a new one (the
        # check is pure). Dying twice is this body's doing (out of memory): the upload fails, the next one
        # gets a new pool.
        for last_try in (False, True):
            pool = self._running_pool()
            try:
                return await asyncio.wrap_future(pool.submit(check_piece, *args))
            except BrokenProcessPool:
                self._drop(pool)
                if last_try:
                    raise SetupError("a process checking uploads died: send the body again") from None
        raise AssertionError("unreachable")

    def send(self, spool: NdjsonSpool, call: NewJob) -> None:
        """Send a checked body's messages from the checking processes, a run of consecutive parts each, all at
        once (encoding a message is Python, one process at a time); SetupError if a process died."""
        pool = self._running_pool()
        futures = []
        try:
            for i, ranges in enumerate(spool.part_ranges(self.processes)):
                futures.append(pool.submit(send_ranges, spool.path, ranges, call, i == 0, self.settings))
            wait(futures)  # every process has stopped sending before a failure is told
            for future in futures:
                future.result()
        except BrokenProcessPool:  # broken before or while sending: no retry, a part may have been sent
            wait(futures)
            self._drop(pool)
            raise SetupError(
                "a process publishing an upload died: the job failed, send the body again"
            ) from None

    def close(self) -> None:
        if self._pool is not None:
            self._drop(self._pool)

    def _running_pool(self) -> ProcessPoolExecutor:
        if self._pool is None:
            context = multiprocessing.get_context("spawn")
            self._pool = ProcessPoolExecutor(
                self.processes, mp_context=context, initializer=_die_with, initargs=(os.getpid(),)
            )
        return self._pool

    def _drop(self, pool: ProcessPoolExecutor) -> None:
        """Shut ``pool`` down; uploads checking on it at once find it dropped already."""
        if self._pool is pool:
            self._pool = None
        pool.shutdown(wait=False, cancel_futures=True)


# How often a checking process looks whether the API that started it is still there.
PARENT_POLL_S = 0.5


def _die_with(parent_pid: int) -> None:
    """Run first in each checking process: it ends within PARENT_POLL_S of the API process, however that ends
    (a SIGKILL included), instead of living on as an orphan holding its memory.

    A watch on the parent's pid rather than prctl(PR_SET_PDEATHSIG): that signal follows the *thread* that
    started the process, and the pool starts its processes from whichever thread submits (a request thread
    that may end while the API lives on).
    """

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="batchwork-parent-watch", daemon=True).start()


def _ready(settings: Settings) -> None:
    """Import what checking and sending need, each served model's module included, so that no upload waits
    for it."""
    if not settings.embedded:  # the publisher's module and its connection, before the first upload sends
        with suppress(Exception):  # a broker away now: the first upload says so
            publisher(settings).client.ping()
    for name in settings.served:
        with suppress(UnknownModel):  # a model that cannot be imported: its uploads say so, one line each
            model_class(name, settings)
