"""The backends an embed or classify checkpoint runs on: torch (transformers' AutoModel with the pooling or
the classifier's logits on top) or ONNX Runtime (that same module exported once with torch's exporter,
cached by content hash, opset and ORT version; int8 is ORT's dynamic per-channel quantization).

Only ``Encoder.load`` imports this module; torch, transformers and onnxruntime are imported in functions.
Once a checkpoint's ONNX folder is cached (graph and tokenizer as transformers built it), loading it imports
neither torch nor transformers: 3-7 s of a short ``batchwork run`` on a 2-core CPU.
Never trust_remote_code, never a hub: everything loads with local_files_only.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from worker.models.checkpoint import CheckpointError
from worker.models.precision import UnsupportedPrecision, check_precision, prepare_module

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    from tokenizers import Tokenizer

    from worker.settings import Settings

log = logging.getLogger(__name__)

ONNX_OPSET = 17
ONNX_PRECISIONS = ("fp32", "int8")
# Architectures whose position ids start at padding_idx + 1, so max_position_embeddings overstates the limit
# (XLM-RoBERTa: 514 positions, 512 tokens). sentence-transformers caps at the positions alone and fails on
# inputs between the two; here they are truncated.
OFFSET_POSITIONS = frozenset(
    {"roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "mpnet", "data2vec-text"}
)
# A tokenizer without a limit of its own says so with a huge model_max_length; positions cap it then.
UNLIMITED = 10**6
# In a checkpoint's ONNX cache folder beside the graph: the tokenizer as transformers built it.
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_META = "tokenizer-meta.json"


class Encoder(Protocol):
    """What the backends read of the model they load (encoders.py's Encoder, which imports this module)."""

    @property
    def name(self) -> str: ...
    @property
    def kind(self) -> str | None: ...
    @property
    def checkpoint(self) -> str | None: ...
    @property
    def settings(self) -> Settings: ...
    @property
    def opts(self) -> Any: ...
    def label(self) -> str: ...


class Runner(Protocol):
    def run(self, input_ids: np.ndarray, mask: np.ndarray, type_ids: np.ndarray | None) -> np.ndarray:
        """float32 rows: the pooled vectors (embed) or the logits (classify), one per input."""
        ...


@dataclass(frozen=True, slots=True)
class TokenizerSetup:
    """A checkpoint's tokenizer as the model runs it: truncating where sentence-transformers and the pipeline
    do and never padding; its pad id, its limit, and whether the model takes segment ids."""

    tokenizer: Tokenizer
    pad_id: int
    max_length: int
    type_ids: bool


def load_tokenizer(
    source: Path,
    config: dict[str, Any],
    option_limit: int | None,
    layout_limit: int | None,
    lower: bool,
) -> TokenizerSetup:
    """The tokenizer of ``source``: a checkpoint directory (transformers' AutoTokenizer builds it) or an ONNX
    cache folder holding what AutoTokenizer built, saved by ``save_tokenizer`` (no transformers import)."""
    from tokenizers import Tokenizer

    if (source / TOKENIZER_META).is_file():
        meta = json.loads((source / TOKENIZER_META).read_text(encoding="utf-8"))
        backend = Tokenizer.from_file(str(source / TOKENIZER_FILE))
    else:
        backend, meta = _auto_tokenizer(source)
    positions = int(config.get("max_position_embeddings") or UNLIMITED)
    if config.get("model_type") in OFFSET_POSITIONS:  # position ids start after the padding index
        positions -= int(config.get("pad_token_id") or 0) + 1
    own = int(min(meta["model_max_length"], UNLIMITED))
    limit = min(option_limit or layout_limit or own, positions)
    # Set once here, never per call: encode_batch then only reads the tokenizer (a change while another
    # thread tokenizes raises "Already borrowed", huggingface/tokenizers#537).
    backend.no_padding()
    backend.enable_truncation(max_length=limit, strategy="longest_first")
    if lower:
        _lowercase(backend)
    pad_id = meta["pad_token_id"]
    return TokenizerSetup(backend, 0 if pad_id is None else int(pad_id), limit, bool(meta["type_ids"]))


def _auto_tokenizer(model_dir: Path) -> tuple[Tokenizer, dict[str, Any]]:
    """transformers' fast tokenizer of the checkpoint (its Rust tokenizer) and what else the model needs."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(
            str(model_dir), local_files_only=True, trust_remote_code=False
        )
    except Exception as exc:
        raise CheckpointError(f"{model_dir}: cannot load the tokenizer ({_first_line(exc)})") from None
    meta = {
        "model_max_length": min(tokenizer.model_max_length, UNLIMITED),
        "pad_token_id": tokenizer.pad_token_id,
        "type_ids": "token_type_ids" in tokenizer.model_input_names,
    }
    return tokenizer.backend_tokenizer, meta


def save_tokenizer(model_dir: Path, folder: Path) -> None:
    """What AutoTokenizer builds of the checkpoint, kept in its ONNX folder for loads without transformers."""
    backend, meta = _auto_tokenizer(model_dir)

    def write(tmp: Path) -> None:
        backend.save(str(tmp.parent / TOKENIZER_FILE))
        tmp.write_text(json.dumps(meta), encoding="utf-8")

    _atomic(folder / TOKENIZER_META, write)


def _lowercase(backend: Tokenizer) -> None:
    """sentence_bert_config's do_lower_case, as sentence-transformers applies it."""
    from tokenizers import normalizers

    current = backend.normalizer
    if current is not None and "Lowercase" in repr(current):
        return
    backend.normalizer = normalizers.Sequence([normalizers.Lowercase(), *([current] if current else [])])


def choose_backend(model: Encoder, device: str) -> tuple[str, str]:
    """(backend, precision): the options; under ``auto`` tune's stored choice for this model and device kind
    (its precision unless one is set), else onnx on a CPU and torch on CUDA."""
    opts = model.opts
    backend, precision = opts.backend, opts.precision
    if backend == "auto":
        stored = tuned_choice(model, device)
        if stored is not None:
            backend = stored[0]
            precision = precision if "precision" in opts.model_fields_set else stored[1]
        else:
            on_cpu = not device.startswith("cuda")
            backend = "onnx" if on_cpu and precision in ONNX_PRECISIONS else "torch"
    if backend == "onnx":
        if precision not in ONNX_PRECISIONS:
            raise UnsupportedPrecision(
                f"precision {precision} under backend onnx: use fp32 or int8 there, or backend torch"
            )
        if precision == "int8" and device.startswith("cuda"):
            raise UnsupportedPrecision("precision int8 under backend onnx runs on the CPU only")
    return backend, precision


def tuned_choice(model: Encoder, device: str) -> tuple[str, str] | None:
    """The backend and precision `batchwork tune --backends ... --apply` stored, if any (read at load)."""
    from worker.models.device import device_kind
    from worker.tuning.limits import read_tuned

    rows = read_tuned(model.settings.database_url, device_kind(device))
    row = None if isinstance(rows, str) else rows.get(model.name)
    detail = (row.detail or {}) if row is not None else {}
    if detail.get("backend") in ("torch", "onnx") and detail.get("precision"):
        return str(detail["backend"]), str(detail["precision"])
    return None


def load_backend(
    model: Encoder,
    model_dir: Path,
    device: str,
    pooling: str | None,
    tokenizer_of: Callable[[Path], TokenizerSetup],
) -> tuple[TokenizerSetup, Runner, str, str]:
    """The tokenizer and the runner of the chosen backend, its name and precision. ``tokenizer_of`` reads a
    tokenizer (load_tokenizer with the model's limits) from the checkpoint or from its ONNX folder. An ONNX
    export that fails falls back to torch with one warning line."""
    backend, precision = choose_backend(model, device)
    if backend == "onnx":
        try:
            folder = onnx_folder(model, model_dir, pooling)
            setup = tokenizer_of(folder)
            graph = cached_graph(folder, model_dir, pooling, setup.type_ids, precision, model.label())
            return setup, OnnxRunner(graph, device, model.name), "onnx", precision
        except OnnxExportFailed as exc:
            log.warning("%s: %s; running it on torch", model.name, exc)
    setup = tokenizer_of(model_dir)
    check_precision(precision, device)
    head = prepare_module(load_head(model_dir, pooling, model.label()).to(device), precision)
    return setup, TorchRunner(head, device, setup.type_ids), "torch", precision


def load_head(model_dir: Path, pooling: str | None, label: str) -> torch.nn.Module:
    """The transformers model with the pooling (embed) or as its logits (classify), in eval mode, fp32."""
    import torch
    from transformers import AutoModel, AutoModelForSequenceClassification

    auto = AutoModel if pooling is not None else AutoModelForSequenceClassification
    try:
        model = auto.from_pretrained(
            str(model_dir), local_files_only=True, trust_remote_code=False, dtype=torch.float32
        )
    except Exception as exc:
        raise CheckpointError(f"{label}: cannot load the weights ({_first_line(exc)})") from None
    return _head_class()(model, pooling).eval()


def _head_class() -> type[torch.nn.Module]:
    import torch

    class Head(torch.nn.Module):
        """One graph from token ids to what the kind returns: pooled vectors, or logits (float32)."""

        def __init__(self, model: torch.nn.Module, pooling: str | None) -> None:
            super().__init__()
            self.model = model
            self.pooling = pooling

        def forward(
            self,
            input_ids: torch.Tensor,
            attention_mask: torch.Tensor,
            token_type_ids: torch.Tensor | None = None,
        ) -> torch.Tensor:
            extra = {} if token_type_ids is None else {"token_type_ids": token_type_ids}
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, **extra)
            if self.pooling is None:
                return out.logits.float()
            # Pooled in float32 whatever the precision (a bf16 mean over long, padded rows lost 3 digits).
            return pool(out.last_hidden_state.float(), attention_mask, self.pooling)

    return Head


def pool(hidden: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """sentence-transformers' Pooling over right-padded rows: mean, cls, max or lasttoken."""
    import torch

    weights = mask.unsqueeze(-1).to(hidden.dtype)
    if mode == "mean":
        return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
    if mode == "cls":
        return hidden[:, 0]
    if mode == "max":
        return hidden.masked_fill(weights == 0, float("-inf")).max(dim=1).values
    last = (mask.sum(dim=1) - 1).clamp(min=0)
    index = last.view(-1, 1, 1).expand(-1, 1, hidden.shape[-1])
    return torch.gather(hidden, 1, index).squeeze(1)


class TorchRunner:
    def __init__(self, head: torch.nn.Module, device: str, type_ids: bool) -> None:
        self.head = head
        self.device = device
        self.type_ids = type_ids

    def run(self, input_ids: np.ndarray, mask: np.ndarray, type_ids: np.ndarray | None) -> np.ndarray:
        import torch

        inputs = [input_ids, mask]
        if self.type_ids:
            inputs.append(np.zeros_like(input_ids) if type_ids is None else type_ids)
        with torch.inference_mode():
            tensors = [self._to_device(array) for array in inputs]
            return self.head(*tensors).float().cpu().numpy()

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        import torch

        tensor = torch.from_numpy(array)
        if not self.device.startswith("cuda"):
            return tensor
        return tensor.pin_memory().to(self.device, non_blocking=True)


class OnnxExportFailed(RuntimeError):
    """torch's exporter (or ORT's quantizer) could not make a graph of this checkpoint."""


class OnnxRunner:
    """An ORT session over the cached graph: full graph optimization, the worker's thread count, CUDA's
    execution provider where the GPU build of onnxruntime is installed and the device is a GPU."""

    def __init__(self, graph: Path, device: str, name: str) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads = _threads()
        options.inter_op_num_threads = 1
        # ORT's pool threads spin between ops by default, taking the CPU the worker's own threads (prepare,
        # store, the run's writer) need; on the loaded 2-core box a whole `batchwork run` took 1.3-1.7x the
        # wall time and 1.4-1.5x the CPU with spinning (bench/README.md, "bench.encoders_vs_references").
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        providers = ["CPUExecutionProvider"]
        if device.startswith("cuda") and "CUDAExecutionProvider" in ort.get_available_providers():
            providers.insert(0, "CUDAExecutionProvider")
        elif device.startswith("cuda"):
            log.warning("%s: onnxruntime has no CUDA provider here; the ONNX graph runs on the CPU", name)
        self.session = ort.InferenceSession(str(graph), options, providers=providers)
        self.names = [node.name for node in self.session.get_inputs()]

    def run(self, input_ids: np.ndarray, mask: np.ndarray, type_ids: np.ndarray | None) -> np.ndarray:
        feeds = {"input_ids": input_ids, "attention_mask": mask}
        if "token_type_ids" in self.names:
            feeds["token_type_ids"] = np.zeros_like(input_ids) if type_ids is None else type_ids
        return np.asarray(self.session.run(None, feeds)[0], dtype=np.float32)


def _threads() -> int:
    """The worker's intra-op thread count: torch's where the process has imported it (a setting there holds
    for both backends), else OMP_NUM_THREADS, else 0 (ORT's own default: one per physical core, as torch)."""
    if "torch" in sys.modules:
        return int(sys.modules["torch"].get_num_threads())
    omp = os.environ.get("OMP_NUM_THREADS", "")
    return int(omp) if omp.isdigit() else 0


def onnx_folder(model: Encoder, model_dir: Path, pooling: str | None) -> Path:
    """The checkpoint's ONNX cache folder, keyed by its content hash, the kind, pooling, opset and the
    versions of ORT, torch (the exporter) and transformers (the model code and the tokenizer); the tokenizer
    is saved there first, so the graph (exported by ``cached_graph``) is all that can be missing."""
    import onnxruntime as ort

    versions = "|".join(f"{name}{_version(name)}" for name in ("torch", "transformers"))
    salt = f"{model.kind}|{pooling}|opset{ONNX_OPSET}|ort{ort.__version__}|{versions}"
    root = Path(model.settings.onnx_cache_dir).expanduser()
    checkpoint = content_hash(Path(model.checkpoint or model_dir), root / "hashes")
    folder = root / hashlib.sha256(f"{checkpoint}|{salt}".encode()).hexdigest()[:32]
    if not (folder / TOKENIZER_META).is_file():
        save_tokenizer(model_dir, folder)
    return folder


def cached_graph(
    folder: Path, model_dir: Path, pooling: str | None, type_ids: bool, precision: str, label: str
) -> Path:
    """The ONNX graph in ``folder`` (exported on first use) and, for int8, its quantized copy."""
    fp32 = folder / "model.onnx"
    if not fp32.exists():
        head = load_head(model_dir, pooling, label)
        _atomic(fp32, lambda tmp: export(head, tmp, type_ids))
        del head
    if precision != "int8":
        return fp32
    int8 = folder / "model.int8.onnx"
    if not int8.exists():
        _atomic(int8, lambda tmp: quantize(fp32, tmp))
    return int8


def _version(distribution: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return "none"


def export(head: torch.nn.Module, path: Path, type_ids: bool) -> None:
    """torch's exporter with dynamic batch and sequence axes. The example batch has padding, so a traced
    branch on "is anything padded?" takes the general (masked) way."""
    import torch

    names = ["input_ids", "attention_mask", *(["token_type_ids"] if type_ids else [])]
    ids = torch.full((2, 8), 5, dtype=torch.long)
    mask = torch.ones((2, 8), dtype=torch.long)
    mask[1, 5:] = 0
    example = (ids, mask, *([torch.zeros_like(ids)] if type_ids else []))
    axes = {name: {0: "batch", 1: "sequence"} for name in names} | {"output": {0: "batch"}}
    try:
        # The legacy exporter's deprecation notice and the tracer's warnings about shape checks would land in
        # a worker's log at every export; the tests compare the graph's outputs instead.
        with torch.inference_mode(False), torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(
                head,
                example,
                str(path),
                input_names=names,
                output_names=["output"],
                dynamic_axes=axes,
                opset_version=ONNX_OPSET,
                dynamo=False,
            )
    except Exception as exc:  # any exporter failure is the same outcome: this checkpoint runs on torch
        raise OnnxExportFailed(f"ONNX export failed ({type(exc).__name__}: {_first_line(exc)})") from None


def quantize(source: Path, path: Path) -> None:
    """ORT's dynamic quantization: int8 weights per output channel, activations quantized per batch."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    try:
        quantize_dynamic(str(source), str(path), per_channel=True, weight_type=QuantType.QInt8)
    except Exception as exc:
        raise OnnxExportFailed(
            f"ONNX int8 quantization failed ({type(exc).__name__}: {_first_line(exc)})"
        ) from None


def content_hash(directory: Path, memo_dir: Path) -> str:
    """sha256 over every file of the checkpoint (relative path and bytes). Remembered in ``memo_dir`` with
    each file's size and modification time, so a start reads the weights again only when a file changed."""
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    stats = [[str(p.relative_to(directory)), st.st_size, st.st_mtime_ns] for p in files for st in [p.stat()]]
    memo = memo_dir / f"{hashlib.sha256(str(directory.resolve()).encode()).hexdigest()[:32]}.json"
    try:
        remembered = json.loads(memo.read_text(encoding="utf-8"))
        if remembered["files"] == stats:
            return str(remembered["hash"])
    except (OSError, ValueError, KeyError, TypeError):
        pass  # none yet, or unreadable: hash the files
    digest = hashlib.sha256()
    for path in files:
        digest.update(str(path.relative_to(directory)).encode() + b"\0")
        with path.open("rb") as handle:
            for chunk in iter(lambda: handle.read(2**20), b""):
                digest.update(chunk)
    found = digest.hexdigest()[:32]
    with contextlib.suppress(OSError):  # a read-only cache only costs the next start the hashing
        _atomic(memo, lambda tmp: tmp.write_text(json.dumps({"files": stats, "hash": found})))
    return found


def _atomic(target: Path, make: Any) -> None:
    """Make ``target`` in a temporary folder beside it, then rename: a worker that dies mid-export leaves no
    half file, and two workers exporting at once each publish a whole one."""
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=target.parent, prefix=".export-"))
    try:
        tmp = scratch / target.name
        make(tmp)
        # External data (models over 2 GB) lands beside the graph; move every file the export wrote.
        # The graph goes last, so a graph that exists is whole.
        for produced in sorted(scratch.iterdir(), key=lambda p: p.name == target.name):
            os.replace(produced, target.parent / produced.name)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0][:200] if lines else type(exc).__name__
