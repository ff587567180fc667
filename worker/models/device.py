"""Turns the ``device`` setting into a concrete torch device name for ``Model.load``, and refuses one this
machine does not have.

It must never import torch at module import: only ``resolve_device`` does, when a worker is about to load.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from worker.errors import SetupError


class DeviceUnavailable(SetupError):
    """BATCHWORK_DEVICE names a device this machine does not have (cuda without a GPU, cuda:3 of 2, ...)."""


def resolve_device(setting: str) -> str:
    """``"auto"`` becomes ``"cuda"`` when a GPU is visible, else ``"cpu"``; any other device is returned as it
    is once this machine is seen to have it (else DeviceUnavailable, one line naming the cause)."""
    if setting == "cpu" or (setting == "auto" and not _gpu_device_files()):
        return "cpu"
    import torch

    if setting == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    kind, _, index = setting.partition(":")
    if kind == "cuda":
        _check_cuda(torch, setting, int(index or 0))
    elif kind == "mps" and not torch.backends.mps.is_available():
        raise DeviceUnavailable(f"BATCHWORK_DEVICE={setting}: this machine has no MPS (Apple GPU) device")
    return setting


# Device files a Linux GPU driver creates (NVIDIA; WSL's GPU; AMD's ROCm, which torch.cuda serves too).
# Without any, torch.cuda.is_available() is False, and "auto" is the CPU without importing torch (1-3 s of a
# short `batchwork run`, which an ONNX model never needs).
GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/dxg", "/dev/kfd")


def _gpu_device_files() -> bool:
    """Whether this machine might have a GPU torch can use (elsewhere than Linux: always, torch decides)."""
    if not sys.platform.startswith("linux"):
        return True
    return any(os.path.exists(path) for path in GPU_DEVICE_FILES)


def _check_cuda(torch: Any, setting: str, index: int) -> None:
    cuda = torch.cuda
    if not cuda.is_available():
        build = torch.__version__
        why = "torch was built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        raise DeviceUnavailable(
            f"BATCHWORK_DEVICE={setting}: CUDA is not available here ({why}; torch {build}); use auto or cpu"
        )
    if index >= cuda.device_count():
        raise DeviceUnavailable(
            f"BATCHWORK_DEVICE={setting}: this machine has {cuda.device_count()} CUDA device(s), "
            f"numbered from 0"
        )


def device_kind(device: str) -> str:
    """What tuned limits are keyed by: ``"cpu"``, or ``"cuda:"`` and the GPU's name (``"cuda:NVIDIA H200"``).

    Limits measured on one GPU model hold for its twins, not for another model or for the CPU.
    """
    if not device.startswith("cuda"):
        return device.split(":")[0]
    import torch

    return f"cuda:{torch.cuda.get_device_name(torch.device(device))}"
