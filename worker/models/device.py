"""Turns the ``device`` setting into a concrete torch device name for ``Model.load``.

It must never import torch at module import: only ``resolve_device`` does, when a worker is about to load.
"""

from __future__ import annotations


def resolve_device(setting: str) -> str:
    """``"auto"`` becomes ``"cuda"`` when a GPU is visible, else ``"cpu"``; anything else passes through."""
    if setting != "auto":
        return setting
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
