"""The SQL edge of batchwork: jobs, per-item results and batch records, on PostgreSQL or SQLite.

Import from here; the store must never import the runtime, the scheduler or a model.
"""

from worker.store.db import make_engine
from worker.store.results import ResultStore
from worker.store.values import BatchRecord, ItemRecord, JobSpec, JobStatus

__all__ = ["BatchRecord", "ItemRecord", "JobSpec", "JobStatus", "ResultStore", "make_engine"]
