"""Celery's and kombu's private seams, in one room: every place batchwork relies on something the frameworks
do not promise (a private method, an attribute, a message layout, a default) goes through this package.

One module per framework, one section per seam, each naming the private thing it uses and why:
``kombu_seams`` (the Redis transport's internals, the hub's timers, ack marking, the serializer registry, the
embedded run's memory transport) and ``celery_seams`` (the hand-written protocol-2 task message, publishing
past a task's own ``apply_async``, the consumer's steps and strategy, bulk task events, the result backend's
reads). tests/unit/celery_compat/test_celery_compat.py holds one contract test per seam, pinned to the
versions in pyproject.toml; tests/unit/test_code_quality.py fails if a module outside this package reaches
one of those private things. Public Celery and kombu API (``Celery``, ``Task``, ``bootsteps``,
``kombu.Queue``) is used where it stands. Importing this package loads nothing; each module loads only its
framework.
"""
