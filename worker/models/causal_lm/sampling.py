"""Chooses each sequence's next token from its logits: argmax when greedy, else a seeded draw on the CPU.

It must never let one sequence's choice depend on the others in its batch: every sampled sequence draws
from its own torch.Generator over its own row of logits, on the CPU, whatever shares the step.
"""

from __future__ import annotations

import torch

from worker.models.causal_lm.inputs import Sampling


def new_generator(sampling: Sampling) -> torch.Generator:
    generator = torch.Generator(device="cpu")
    if sampling.seed is None:
        generator.seed()  # nondeterministic, as asked for by leaving the seed out
    else:
        generator.manual_seed(sampling.seed)
    return generator


def choose_tokens(
    logits: torch.Tensor, samplings: list[Sampling], generators: list[torch.Generator | None]
) -> list[int]:
    """One token id per row of ``logits`` [batch, vocab]."""
    # float32 before argmax, as transformers' generate does, so a float64 run breaks ties the same way.
    scores = logits.float()
    chosen = scores.argmax(dim=-1).tolist()
    sampled = [row for row, sampling in enumerate(samplings) if not sampling.greedy]
    if not sampled:
        return chosen
    # One transfer for all sampled rows; each is then drawn from on its own.
    rows = scores[sampled].cpu()
    for row, values in zip(sampled, rows, strict=True):
        generator = generators[row]
        assert generator is not None, "a sampled sequence has its own generator"
        chosen[row] = _draw(values, samplings[row], generator)
    return chosen


def _draw(scores: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """transformers' order: temperature, then top-k, then top-p, then a multinomial draw."""
    scores = scores / sampling.temperature
    if 0 < sampling.top_k < scores.numel():
        kth_best = torch.topk(scores, sampling.top_k).values[-1]
        scores = scores.masked_fill(scores < kth_best, float("-inf"))
    if sampling.top_p < 1:
        ascending, order = torch.sort(scores)
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        dropped = cumulative <= 1 - sampling.top_p
        dropped[-1] = False  # the most likely token always stays
        scores = scores.index_fill(0, order[dropped], float("-inf"))
    probabilities = scores.softmax(dim=-1)
    return int(torch.multinomial(probabilities, 1, generator=generator))
