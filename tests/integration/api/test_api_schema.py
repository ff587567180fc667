"""schemathesis against the API's own OpenAPI document, on a live `batchwork api` over PostgreSQL with a valid
key: no answer is a server error, and every answer matches the document (status, content type, headers,
schema). Each route alone, then the stateful phase: sequences that follow the document's links from a
submitted job to reading, streaming and cancelling it.

No worker runs: submitted jobs stay queued, which every route handles the same. One check is left out:
"schema-valid data is accepted". Whether an input fits a model is the model's own check (the registry's,
shared with every producer), which no JSON schema of the API can state, so a schema-valid job for a model
that needs {"text": ...} is rightly refused with 422.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.core.result import Err
from schemathesis.specs.openapi.checks import positive_data_acceptance

from tests.integration.api_server import api_server, make_key
from tests.integration.processes import service_env
from worker.store.api_keys import KeyStore
from worker.store.db import make_engine
from worker.store.results import ResultStore

EXAMPLES_PER_ROUTE = 50


@schemathesis.serializer("application/x-ndjson")
def ndjson(_context: schemathesis.SerializationContext, value: Any) -> bytes:
    """A generated NDJSON body: a list becomes one line per element; anything else, one line."""
    items = value if isinstance(value, list) else [value]
    return b"".join(orjson.dumps(item) + b"\n" for item in items)


@pytest.fixture
def live_api(redis_url: str, pg_url: str, pg_store: ResultStore) -> Iterator[tuple[str, str]]:
    # No worker runs: a synchronous POST /v1/embeddings gives up (503) after this long.
    env = service_env(redis_url, pg_url, metrics_port=0, api_embeddings_timeout_s=0.2)
    key = make_key(pg_url, "fuzz")
    with api_server(env) as api:
        yield api.url, key


@pytest.mark.slow
def test_every_route_answers_as_its_schema_says(live_api: tuple[str, str]) -> None:
    # Each operation's strategy run by hypothesis directly: schemathesis' pytest plugin (from_fixture)
    # renames test nodes through a pytest internal that pytest 9 no longer has.
    url, key = live_api
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    failures = []
    routes = calls = 0
    for result in schema.get_all_operations():
        if isinstance(result, Err):
            failures.append(f"an operation the schema cannot describe: {result.err()}")
            continue
        operation = result.ok()
        routes += 1
        try:
            calls += _fuzz(operation, key)
        except Exception as exc:  # collect every route's failure, then report them all
            failures.append(f"{operation.method.upper()} {operation.path}: {exc}")
    assert routes >= 7
    assert calls >= routes * 10, f"only {calls} requests over {routes} routes"
    assert not failures, "\n\n".join(failures)


@pytest.mark.slow
def test_sequences_along_the_links_answer_as_the_schema_says(live_api: tuple[str, str], pg_url: str) -> None:
    url, _key = live_api
    # The jobs routes and their links; the OpenAI routes have no links between them and are fuzzed route by
    # route above (in one machine they took the steps and the jobs' links were rarely reached).
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json").include(path_regex="^/v1/jobs")
    # Valid requests only, as the route-by-route test sends: a generated "negative" case without the
    # Authorization header gets one all the same (get_call_kwargs), and was then "accepted" by chance.
    schema.config.generation.update(modes=[GenerationMode.POSITIVE])
    calls: dict[str, int] = {}
    engine = make_engine(pg_url)

    class Sequences(schema.as_state_machine()):  # type: ignore[misc]
        def setup(self) -> None:
            # A tenant of its own per sequence: what it lists is only what it made, so a replayed sequence
            # meets the same answers (hypothesis requires it) however many jobs earlier ones left.
            self.key = KeyStore(engine).create(f"fuzz-{uuid.uuid4().hex[:12]}")[1]

        def before_call(self, case: schemathesis.Case) -> None:
            # A generated job names no served model, or an input it cannot take, and ends at 422 (the route
            # tests cover that). Here a JSON submit keeps what was generated (priority, deadline, metadata)
            # but carries a job that runs, so the links to its routes are followed. Deterministic: the
            # choice depends on the case alone, as hypothesis requires.
            submit = (case.operation.method.upper(), case.operation.path) == ("POST", "/v1/jobs")
            if submit and isinstance(case.body, dict):
                case.body = {**case.body, "model": "noop", "inputs": ["a", {"id": "b", "text": "c"}]}

        def get_call_kwargs(self, case: schemathesis.Case) -> dict[str, Any]:
            return {"headers": {"Authorization": f"Bearer {self.key}"}}

        def after_call(self, response: Any, case: schemathesis.Case) -> None:
            label = f"{case.operation.method.upper()} {case.operation.path} {response.status_code}"
            calls[label] = calls.get(label, 0) + 1
            super().after_call(response, case)

        def validate_response(self, response: Any, case: schemathesis.Case, **kwargs: Any) -> None:
            case.validate_response(response, excluded_checks=[positive_data_acceptance])

    try:
        Sequences.run(
            settings=settings(
                max_examples=EXAMPLES_PER_ROUTE,
                # 10, not 6: with 6 steps a run followed the link to GET /v1/jobs/{job_id} 3-6 times and
                # in two runs of a few never (the assertion below failed by chance).
                stateful_step_count=10,
                deadline=None,
                database=None,
                suppress_health_check=list(HealthCheck),
            )
        )
    finally:
        engine.dispose()
    served = {label.rsplit(" ", 1)[0] for label, count in calls.items() if label.endswith((" 200", " 202"))}
    # The links were followed: a job submitted, then read, streamed and cancelled by its id.
    assert {"POST /v1/jobs", "GET /v1/jobs/{job_id}", "GET /v1/jobs/{job_id}/results"} <= served, calls
    assert not [label for label in calls if label.endswith(tuple(f" {c}" for c in range(500, 600)))], calls


def _fuzz(operation: Any, key: str) -> int:
    """Run the operation's generated cases against the server; returns how many requests were sent."""
    calls = 0

    @given(case=operation.as_strategy())
    @settings(
        max_examples=EXAMPLES_PER_ROUTE,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    def route(case: schemathesis.Case) -> None:
        nonlocal calls
        calls += 1
        case.call_and_validate(
            headers={"Authorization": f"Bearer {key}"}, excluded_checks=[positive_data_acceptance]
        )

    route()
    return calls
