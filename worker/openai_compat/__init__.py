"""The OpenAI-compatible surface's pure parts: request bodies of /v1/embeddings, /v1/completions and
/v1/chat/completions made into model items, outputs made into OpenAI response bodies, and batch files
(``{custom_id, method, url, body}`` lines) parsed and answered. No Celery, Redis, SQL or torch here: the
HTTP API and ``batchwork run`` share it.
"""
