"""The errors batchwork raises to its users: one base, a specific class per kind of mistake or outage.

Each message is one line a user can act on; the CLI prints it as it is, never with a traceback.
"""

from __future__ import annotations

# What a model's own code may raise, caught where batchwork calls it: a model that calls sys.exit() fails its
# items, never ends the engine's thread (KeyboardInterrupt, the user's Ctrl-C, is left alone).
MODEL_FAILURES = (Exception, SystemExit)


class BatchworkError(Exception):
    """Base of every error batchwork raises on purpose."""


class InvalidInput(BatchworkError, ValueError):
    """An input that cannot run; the message names the item (when there is one) and the field."""

    def __init__(self, detail: str, index: int | None = None) -> None:
        self.detail = detail
        self.index = index
        super().__init__(detail if index is None else f"item {index}: {detail}")


class JobNotFound(BatchworkError, LookupError):
    """No job with this id where the client looked (the message says where)."""


class BrokerUnavailable(BatchworkError, ConnectionError):
    """The broker cannot be reached; the message names it."""


class DatabaseUnavailable(BatchworkError, ConnectionError):
    """The database cannot be reached, or has no batchwork schema; the message says which and what to do."""


class UsageError(BatchworkError, ValueError):
    """A command or argument that cannot do what was asked (a key that does not exist, ...)."""


class SetupError(BatchworkError, RuntimeError):
    """batchwork is not set up for what was asked (no broker configured, a database not migrated, ...)."""


class NoWorker(SetupError):
    """A job was submitted where nothing could ever run it (no broker configured and no in-process worker)."""


class JobFailed(BatchworkError):
    """Raised by ``AsyncResult.get()`` for a job whose items did not all succeed.

    ``outputs`` holds every item's output in input order (None where it failed), ``errors`` the error of each
    failed item by index, so a caller can still use what succeeded.
    """

    def __init__(
        self, message: str, outputs: list[object] | None = None, errors: dict[int, str] | None = None
    ):
        super().__init__(message)
        self.outputs = outputs or []
        self.errors = errors or {}
