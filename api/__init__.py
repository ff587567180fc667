"""Placeholder for the HTTP API (FastAPI over the same store and client; roadmap step 5).

Nothing is served yet: use `worker.client` or the `batchwork` command.
"""
