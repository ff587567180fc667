"""batchwork's HTTP front door: a FastAPI app over the same client, store and checks as Python producers.

It validates inputs through the model registry and never loads a model (nor torch); ``api.app.create_app``
builds the app, ``batchwork api`` serves it.
"""
