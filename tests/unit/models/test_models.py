"""Model adapters without weights: input validation, name resolution, noop and simulated outputs, imports.

Nothing here may load weights or need a service.
"""

from __future__ import annotations

import time

import pytest

from tests.support.fresh import fresh_python
from tests.support.models import Echo
from worker.models.base import InvalidInput
from worker.models.noop import Noop
from worker.models.registry import BUILTIN_MODELS, UnknownModel, model_class, served_models
from worker.models.simulated import Simulated
from worker.settings import Settings

MAX_CHARS = 100
ECHO = "tests.support.models:Echo"
BAD_PATHS = [
    "no_such_package.models:Thing",
    "tests.support.models:Missing",
    "tests.support.models:annotations",
    "tests.support.models:Sequence",
]
SETTINGS = Settings(max_input_chars=MAX_CHARS, models=[*sorted(BUILTIN_MODELS), ECHO, *BAD_PATHS])


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ({"id": 1}, "item 3: missing field 'text'"),
        ({"text": 42}, "item 3: field 'text' must be a string"),
        ({"text": "   "}, "item 3: field 'text' is empty"),
        ("", "item 3: field 'text' is empty"),
        ("x" * (MAX_CHARS + 1), "item 3: field 'text' has 101 characters, over the limit of 100"),
        ({"text": "x" * (MAX_CHARS + 1)}, "over the limit of 100"),
        (17, "item 3: expected a string or an object with field 'text'"),
        (["a list"], "item 3: expected a string or an object with field 'text'"),
    ],
)
@pytest.mark.parametrize("name", ["minilm", "noop", "simulated"])
def test_validation_names_the_item_and_the_problem(name: str, item: object, message: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        model_class(name, SETTINGS).validate(3, item, SETTINGS)
    assert message in str(caught.value)


@pytest.mark.parametrize("item", ["hello", {"text": "hello", "id": "a"}, "x" * MAX_CHARS])
def test_valid_inputs_pass(item: object) -> None:
    assert model_class("minilm", SETTINGS).validate(0, item, SETTINGS) == (
        item if isinstance(item, str) else "hello"
    )


def test_builtin_names_resolve_to_their_classes() -> None:
    assert {"minilm", "noop", "simulated"} <= set(BUILTIN_MODELS)
    assert Settings().models == sorted(BUILTIN_MODELS)
    assert model_class("noop", SETTINGS) is Noop
    assert model_class("simulated", SETTINGS) is Simulated
    assert model_class("minilm", SETTINGS).name == "minilm"


def test_unknown_name_lists_the_served_ones() -> None:
    with pytest.raises(UnknownModel) as caught:
        model_class("bert-large", Settings())
    message = str(caught.value)
    assert "'bert-large'" in message and "BATCHWORK_MODELS" in message
    for name in BUILTIN_MODELS:
        assert name in message
    assert isinstance(caught.value, InvalidInput)


@pytest.mark.parametrize("name", ["this:Zen", "antigravity:Fly", ECHO, "tests.support.models:OOM"])
def test_a_model_outside_the_allow_list_is_refused_without_importing_it(name: str) -> None:
    module = name.partition(":")[0]
    code = (
        "import sys\n"
        "from worker.models.registry import UnknownModel, model_class\n"
        "from worker.settings import Settings\n"
        "try:\n"
        f"    model_class({name!r}, Settings())\n"
        "except UnknownModel as exc:\n"
        "    print(exc)\n"
        f"assert {module!r} not in sys.modules, 'imported'\n"
    )
    printed = fresh_python(code)
    assert "unknown model" in printed
    assert "The Zen of Python" not in printed


@pytest.mark.parametrize("value", [None, 7, ["minilm"], "x" * 10_000])
def test_a_model_name_of_any_type_or_length_is_refused_in_one_line(value: object) -> None:
    with pytest.raises(UnknownModel) as caught:
        model_class(value, Settings())
    assert len(str(caught.value)) < 300


@pytest.mark.parametrize("models", ['["a:b:c"]', '["os.path"]', '["-m"]', '"minilm"'])
def test_an_allow_list_entry_that_is_no_model_name_is_a_bad_setting(
    models: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BATCHWORK_MODELS", models)
    with pytest.raises(ValueError, match="models"):
        Settings()


@pytest.mark.parametrize(
    ("path", "fragment"),
    [
        ("no_such_package.models:Thing", "cannot import module 'no_such_package.models'"),
        ("tests.support.models:Missing", "has no attribute 'Missing'"),
        ("tests.support.models:annotations", "is not a subclass of worker.models.base.Model"),
        ("tests.support.models:Sequence", "is not a subclass of worker.models.base.Model"),
    ],
)
def test_bad_import_paths_say_what_is_wrong(path: str, fragment: str) -> None:
    settings = Settings(models=[path])
    with pytest.raises(UnknownModel, match=path.replace(".", r"\.")) as caught:
        model_class(path, settings)
    assert fragment in str(caught.value)


def test_user_model_by_import_path_runs() -> None:
    cls = model_class(ECHO, SETTINGS)
    assert cls is Echo
    model = cls(SETTINGS)
    model.load("cpu")
    prepared = model.prepare(
        [cls.validate(i, item, SETTINGS) for i, item in enumerate(["héllo", {"text": "ab"}])]
    )
    assert list(model.forward([p.payload for p in prepared])) == [
        {"echo": "héllo", "n": 5},
        {"echo": "ab", "n": 2},
    ]


def test_describe_gives_defaults_for_the_cli() -> None:
    rows = {row.name: row for row in served_models(Settings()) if not isinstance(row, Exception)}
    assert set(rows) == set(BUILTIN_MODELS)
    assert (rows["noop"].max_batch_size, rows["noop"].max_wait_ms) == (1024, 5.0)
    assert (rows["simulated"].max_batch_size, rows["simulated"].max_wait_ms) == (64, 20.0)
    assert rows["minilm"].max_wait_ms == 50.0
    assert all(row.description and "\n" not in row.description for row in rows.values())


def test_noop_returns_zero_per_item() -> None:
    model = Noop(Settings())
    prepared = model.prepare(["a", "b", "c"])
    assert list(model.forward([p.payload for p in prepared])) == [0, 0, 0]


def test_simulated_returns_text_lengths() -> None:
    model = Simulated(Settings(simulated_base_ms=0, simulated_per_item_ms=0))
    prepared = model.prepare(["abc", "日本語です", "x" * 40])
    assert model.forward([p.payload for p in prepared]) == [3, 5, 40]


@pytest.mark.parametrize("n", [1, 10, 40])
def test_simulated_takes_at_least_a_plus_b_n(n: int) -> None:
    model = Simulated(Settings(simulated_base_ms=15, simulated_per_item_ms=1))
    payloads = [p.payload for p in model.prepare(["text"] * n)]
    started = time.perf_counter()
    model.forward(payloads)
    elapsed_ms = (time.perf_counter() - started) * 1000
    # A lower bound only: a loaded CI machine may oversleep, never undersleep.
    assert elapsed_ms >= 15 + 1 * n - 1


def test_importing_models_does_not_load_torch() -> None:
    code = (
        "import sys\n"
        "import worker.models.registry, worker.models.minilm, worker.models.device\n"
        "from worker.settings import Settings\n"
        "worker.models.registry.served_models(Settings())\n"
        "worker.models.registry.model_class('minilm', Settings()).validate(0, 'text', Settings())\n"
        "heavy = [m for m in ('torch', 'transformers', 'sentence_transformers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    fresh_python(code)
