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


def device_kind(device: str) -> str:
    """What tuned limits are keyed by: ``"cpu"``, or ``"cuda:"`` and the GPU's name (``"cuda:NVIDIA H200"``).

    Limits measured on one GPU model hold for its twins, not for another model or for the CPU.
    """
    if not device.startswith("cuda"):
        return device.split(":")[0]
    import torch

    return f"cuda:{torch.cuda.get_device_name(torch.device(device))}"
