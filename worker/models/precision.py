"""Numeric precision of a model (BATCHWORK_MODEL_OPTIONS ``precision``): fp32, bf16, fp16 or int8.

fp32 is the reference. bf16 and fp16 cast the weights once (fp16 needs CUDA); the model pools in float32:
MiniLM's embeddings stayed within cosine 0.9999 of fp32's where a bf16 pooling fell to 0.996. torch.autocast
kept the same accuracy but re-cast the weights every batch and measured 1.15x fp32 on the 2-core CPU
against 1.6x for weights cast once. int8 is torch's dynamic quantization of Linear layers, CPU only.
torch is imported only inside the functions.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, get_args

from worker.models.base import Precision

if TYPE_CHECKING:
    import torch

PRECISIONS: tuple[str, ...] = get_args(Precision)  # the setting's own list: one place names them


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
    """The module as ``precision`` runs it: weights cast once to bf16 / fp16, or Linear layers quantized
    to int8; fp32 unchanged. Callers pool and normalize the outputs in float32."""
    import torch

    if precision == "int8":
        from torch.ao.quantization import quantize_dynamic

        # torch 2.13 warns that eager-mode quantization moves to torchao; it still works, and a worker's
        # log should not carry the notice for every load.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", (DeprecationWarning, UserWarning))
            return quantize_dynamic(module, {torch.nn.Linear}, dtype=torch.qint8)
    if precision in ("bf16", "fp16"):
        return module.to(torch.bfloat16 if precision == "bf16" else torch.float16)
    return module
