"""Numeric precision of a model (BATCHWORK_MODEL_OPTIONS ``precision``): fp32, bf16, fp16 or int8.

fp32 is the reference. bf16 and fp16 run matrix products under torch.autocast (norms, softmax and the
pooling stay float32, which kept MiniLM's embeddings within cosine 0.9999 of fp32 where casting the
whole model to bf16 fell to 0.996); fp16 needs CUDA. int8 is torch's dynamic quantization of Linear
layers, CPU only. torch is imported only inside the functions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

PRECISIONS = ("fp32", "bf16", "fp16", "int8")


class UnsupportedPrecision(ValueError):
    """A precision this device cannot run (fp16 on a CPU, bf16 on a CPU without bf16 instructions, ...)."""


def check_precision(precision: str, device: str) -> None:
    """Raise UnsupportedPrecision, saying what would run, unless ``device`` supports ``precision``."""
    import torch

    on_cuda = device.startswith("cuda")
    if precision not in PRECISIONS:
        raise UnsupportedPrecision(f"unknown precision {precision!r}: use one of {', '.join(PRECISIONS)}")
    if precision == "fp16" and not on_cuda:
        raise UnsupportedPrecision("precision fp16 needs CUDA; on the CPU use fp32, bf16 or int8")
    if precision == "int8" and on_cuda:
        raise UnsupportedPrecision(
            "precision int8 (dynamic quantization) runs on the CPU only; use bf16 or fp16"
        )
    if precision == "int8" and not set(torch.backends.quantized.supported_engines) - {"none"}:
        raise UnsupportedPrecision("precision int8: this torch build has no quantized CPU engine")
    if precision == "bf16" and not (torch.cuda.is_bf16_supported() if on_cuda else _cpu_has_bf16()):
        raise UnsupportedPrecision(f"precision bf16: this {'GPU' if on_cuda else 'CPU'} has no bf16 support")


def _cpu_has_bf16() -> bool:
    import torch

    # Without native bf16 (AVX512-BF16 or AMX) oneDNN emulates it, slower than fp32.
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def prepare_module(module: torch.nn.Module, precision: str) -> torch.nn.Module:
    """The module as ``precision`` runs it: quantized for int8, else unchanged (autocast does the rest)."""
    if precision != "int8":
        return module
    import torch
    from torch.ao.quantization import quantize_dynamic

    return quantize_dynamic(module, {torch.nn.Linear}, dtype=torch.qint8)


@contextlib.contextmanager
def autocast(precision: str, device: str) -> Iterator[None]:
    """Run the block under autocast for bf16 / fp16; plainly for fp32 and int8."""
    if precision not in ("bf16", "fp16"):
        yield
        return
    import torch

    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    with torch.autocast(device_type=device.split(":")[0], dtype=dtype):
        yield
