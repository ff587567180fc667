"""GPT-2 without weights: request validation messages, light imports, and the admission/preemption
accounting of its SequenceScheduler driven by a fake page pool (every sequence finishes, none fails)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.fresh import fresh_python
from worker.batching.sequences import RetiredSequence, SequenceScheduler
from worker.models.base import InvalidInput
from worker.models.causal_lm.inputs import Prompt
from worker.models.gpt2 import GPT2
from worker.settings import Settings

MAX_CHARS = 100
SETTINGS = Settings(max_input_chars=MAX_CHARS)
OK = {"prompt": "Hello", "max_new_tokens": 5}


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("Hello", "item 4: expected an object with fields 'prompt' (or 'messages')"),
        (
            ["Hello", 5],
            "item 4: expected an object with fields 'prompt' (or 'messages')",
        ),
        ({"max_new_tokens": 5}, "item 4: missing field 'prompt'"),
        ({**OK, "prompt": ""}, "item 4: field 'prompt' is empty"),
        ({**OK, "prompt": "  \n"}, "item 4: field 'prompt' is empty"),
        ({**OK, "prompt": 42}, "item 4: field 'prompt' must be a string"),
        ({**OK, "prompt": "x" * 101}, "item 4: field 'prompt' has 101 characters, over the limit of 100"),
        ({"prompt": "Hello"}, "item 4: missing field 'max_new_tokens'"),
        ({**OK, "max_new_tokens": 0}, "item 4: field 'max_new_tokens' must be at least 1, not 0"),
        ({**OK, "max_new_tokens": -3}, "item 4: field 'max_new_tokens' must be at least 1, not -3"),
        ({**OK, "max_new_tokens": "5"}, "item 4: field 'max_new_tokens' must be an integer, not str"),
        ({**OK, "max_new_tokens": 2.5}, "item 4: field 'max_new_tokens' must be an integer, not 2.5"),
        ({**OK, "max_new_tokens": True}, "item 4: field 'max_new_tokens' must be an integer, not True"),
        ({**OK, "max_new_tokens": 10**7}, "field 'max_new_tokens' is 10000000, over the model's context of"),
        ({**OK, "temperature": -0.5}, "item 4: field 'temperature' must be 0 (greedy) or more, not -0.5"),
        ({**OK, "temperature": "hot"}, "item 4: field 'temperature' must be a finite number, not str"),
        ({**OK, "temperature": float("nan")}, "item 4: field 'temperature' must be a finite number, not nan"),
        ({**OK, "top_p": 0}, "item 4: field 'top_p' must be more than 0 and at most 1, not 0.0"),
        ({**OK, "top_p": 1.5}, "item 4: field 'top_p' must be more than 0 and at most 1, not 1.5"),
        ({**OK, "top_k": -1}, "item 4: field 'top_k' must be 0 (no limit) or more, not -1"),
        ({**OK, "top_k": 2.5}, "item 4: field 'top_k' must be an integer, not 2.5"),
        ({**OK, "seed": -1}, "item 4: field 'seed' must be between 0 and 2**64-1, not -1"),
        ({**OK, "seed": "seven"}, "item 4: field 'seed' must be an integer, not str"),
        (
            {**OK, "max_tokens": 5},
            "item 4: unknown field 'max_tokens' (known: prompt, messages,",
        ),
    ],
)
def test_validation_names_the_item_and_the_problem(item: object, message: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        GPT2.validate(4, item, SETTINGS)
    assert message in str(caught.value)


@pytest.mark.parametrize(
    "item",
    [
        OK,
        {**OK, "id": "a-1", "temperature": 0},
        {**OK, "temperature": 0.7, "top_k": 40, "top_p": 0.95, "seed": 2**64 - 1},
        {**OK, "temperature": 1, "seed": None},
        {"prompt": "x" * MAX_CHARS, "max_new_tokens": 1},
    ],
)
def test_valid_inputs_pass(item: object) -> None:
    GPT2.validate(0, item, SETTINGS)


def test_max_new_tokens_is_bounded_by_the_checkpoint_context(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"n_positions": 128}))
    settings = Settings(max_input_chars=MAX_CHARS, model_options={"gpt2": {"path": str(tmp_path)}})
    GPT2.validate(0, {**OK, "max_new_tokens": 128}, settings)
    with pytest.raises(InvalidInput, match="'max_new_tokens' is 129, over the model's context of 128 tokens"):
        GPT2.validate(0, {**OK, "max_new_tokens": 129}, settings)


def test_importing_and_validating_does_not_load_torch() -> None:
    code = (
        "import sys\n"
        "import worker.models.causal_lm\n"
        "from worker.models.registry import model_class\n"
        "from worker.settings import Settings\n"
        "model_class('gpt2', Settings()).validate(0, {'prompt': 'Hi', 'max_new_tokens': 3}, Settings())\n"
        "entry = 'generate:/models/absent'\n"
        "chat = {'messages': [{'role': 'user', 'content': 'Hi'}], 'max_new_tokens': 3}\n"
        "model_class(entry, Settings(models=[entry])).validate(0, chat, Settings(models=[entry]))\n"
        "heavy = [m for m in ('torch', 'transformers', 'tokenizers', 'safetensors') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    fresh_python(code)


# -- the SequenceScheduler, driven as GPT2.advance drives it, with every token "1" --------------


class FakePages:
    page_tokens = 16

    def __init__(self, pages: int) -> None:
        self.pages = pages
        self.free = list(range(pages))

    @property
    def free_pages(self) -> int:
        return len(self.free)

    def allocate(self, count: int, after: int | None = None) -> list[int]:
        assert count <= len(self.free), "the scheduler asked for pages that are not free"
        taken, self.free = self.free[:count], self.free[count:]
        return taken

    def release(self, pages: list[int]) -> None:
        assert not set(pages) & set(self.free), "a page was released twice"
        self.free.extend(pages)


def step(scheduler: SequenceScheduler) -> list[RetiredSequence]:
    decoding, joining, rejected = scheduler.schedule()
    for seq in decoding:
        assert seq.cached < len(seq.pages) * FakePages.page_tokens, "no room for the token it feeds"
        seq.cached += 1
    for seq in joining:
        seq.cached = len(seq.context)
        assert seq.cached <= len(seq.pages) * FakePages.page_tokens
    for seq in decoding + joining:
        seq.generated.append(1)
    return rejected + scheduler.retire(frozenset())


def prompt(tokens: int, max_new_tokens: int) -> Prompt:
    return Prompt(tuple(range(tokens)), max_new_tokens)


def test_admission_promises_the_newcomers_worst_case() -> None:
    scheduler = SequenceScheduler(FakePages(6), max_running=8)
    assert scheduler.can_admit(90)  # idle: anything prepare let through
    scheduler.admit("a", prompt(10, 40))  # up to 50 tokens: 4 pages promised
    assert scheduler.can_admit(32)  # 2 pages: 4 + 2 <= 6
    assert not scheduler.can_admit(33)  # 3 pages: 4 + 3 > 6
    step(scheduler)  # "a" holds 1 page now; 1 more is kept for its growth
    assert scheduler.can_admit(64)  # 4 pages + 1 spare <= 5 free
    assert not scheduler.can_admit(65)


def test_the_newest_is_preempted_and_resumes_before_any_newcomer() -> None:
    pages = FakePages(4)
    scheduler = SequenceScheduler(pages, max_running=8)
    scheduler.admit("old", prompt(15, 40))
    scheduler.admit("new", prompt(15, 40))
    done: dict[str, RetiredSequence] = {}
    while scheduler.preemptions == 0:
        done.update((g.key, g) for g in step(scheduler))
    assert not scheduler.can_admit(2)  # a preempted sequence waits: it goes first
    while scheduler.running():
        done.update((g.key, g) for g in step(scheduler))
    assert {key: len(g.token_ids) for key, g in done.items()} == {"old": 40, "new": 40}
    assert pages.free_pages == 4


def test_a_rejected_payload_leaves_at_the_next_step_with_its_error() -> None:
    scheduler = SequenceScheduler(FakePages(4), max_running=2)
    scheduler.admit("bad", Prompt((), 0, error="too long"))
    scheduler.admit("good", prompt(3, 2))
    assert not scheduler.can_admit(1)  # both slots taken
    assert step(scheduler) == [RetiredSequence("bad", error="too long")]
    assert step(scheduler) == [RetiredSequence("good", (1, 1), "length")]
    assert scheduler.running() == 0


def test_after_a_failed_step_every_admitted_sequence_leaves_with_the_error_and_frees_its_pages() -> None:
    pages = FakePages(4)
    scheduler = SequenceScheduler(pages, max_running=4)
    scheduler.admit("running", prompt(15, 40))
    step(scheduler)  # "running" holds pages now
    scheduler.admit("waiting", prompt(3, 2))
    scheduler.admit("bad", Prompt((), 0, error="too long"))
    gone = scheduler.abort("the model failed")
    assert [(g.key, g.error) for g in gone] == [
        ("bad", "too long"),
        ("running", "the model failed"),
        ("waiting", "the model failed"),
    ]
    assert scheduler.running() == 0 and pages.free_pages == 4
    scheduler.admit("after", prompt(3, 2))  # and it goes on serving
    assert step(scheduler) == [] and step(scheduler) == [RetiredSequence("after", (1, 1), "length")]


@settings(max_examples=60, deadline=None)
@given(
    pages=st.integers(min_value=4, max_value=12),
    max_running=st.integers(min_value=1, max_value=6),
    sizes=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 34)), min_size=1, max_size=12),
)
def test_every_sequence_finishes_with_all_its_tokens(
    pages: int, max_running: int, sizes: list[tuple[int, int]]
) -> None:
    pool = FakePages(pages)
    scheduler = SequenceScheduler(pool, max_running)
    fitting = [(p, n) for p, n in sizes if -(-(p + n) // 16) <= pages]  # what prepare lets through
    queued = list(enumerate(prompt(p, n) for p, n in fitting))
    done: dict[int, RetiredSequence] = {}
    for _ in range(10_000):
        while queued and scheduler.can_admit(queued[0][1].kv_tokens):
            scheduler.admit(*queued.pop(0))
        done.update((g.key, g) for g in step(scheduler))
        if not queued and not scheduler.running():
            break
    assert {key: len(g.token_ids) for key, g in done.items()} == {i: n for i, (_, n) in enumerate(fitting)}
    assert pool.free_pages == pages
