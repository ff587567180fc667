"""Celery's and kombu's private seams, in one room: every place batchwork relies on something the frameworks
do not promise (a private method, an attribute, a message layout, a default) goes through a module here.

One module per seam, each opening with the private thing it uses and why;
tests/unit/test_celery_compat.py holds one contract test per seam, pinned to the versions in pyproject.toml,
and tests/unit/test_code_quality.py fails if a module outside this package reaches one of those private
things. Public Celery and kombu API
(``Celery``, ``Task``, ``bootsteps``, ``kombu.Queue``) is used where it stands. Importing this package loads
nothing; each module loads only the framework it adapts.

- ``redis_transport``: kombu's Redis channel, poller and QoS internals (``_brpop_start``,
  ``_register_BRPOP``, ``_create_client``, ``_channels``, ``_delivered``, ``connection._deliver``).
- ``hub``: kombu's event loop sleeping a whole second after a busy turn (``Hub.fire_timers``' ``min_delay``).
- ``messages``: marking a message acknowledged without kombu's per-message ack (``Message._state``).
- ``events``: task events in bulk, written by orjson (kombu's serializer ``registry.type_to_name``;
  ``EventDispatcher.buffer_limit`` and ``.serializer``).
- ``protocol``: the task message a producer writes by hand (Celery's protocol 2 in kombu's Redis envelope).
- ``tasks``: publishing through Celery's own ``Task.apply_async`` past a task class that overrides it.
- ``consumer``: the worker's consumer bootsteps by their module paths, and the task strategy's call shape.
- ``results``: a read-only result backend (``BaseBackend._get_task_meta_for`` and its meta dict).
- ``memory_transport``: the in-memory broker of the embedded run, stopping promptly (Celery's ``synloop``
  waits ``drain_events(timeout=2.0)`` between looks for a stop request).
"""
