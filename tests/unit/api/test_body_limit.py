"""The body limit by route and kind: only the NDJSON submit and the file upload take more than a JSON body,
whatever Content-Type another route is sent with (it would be read whole into memory)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from api.limits import BodyLimit
from worker.settings import Settings

SETTINGS = Settings(api_max_body_bytes=1000, api_max_ndjson_bytes=5000, api_max_file_bytes=3000)


async def read_whole(request: Request) -> PlainTextResponse:
    return PlainTextResponse(str(len(await request.body())))


def client() -> TestClient:
    paths = ("/v1/jobs", "/v1/files", "/v1/batches", "/v1/embeddings")
    app = Starlette(routes=[Route(path, read_whole, methods=["POST"]) for path in paths])
    return TestClient(BodyLimit(app, SETTINGS))


@pytest.mark.parametrize(
    ("path", "content_type", "limit"),
    [
        ("/v1/jobs", "application/json", 1000),
        ("/v1/jobs", "application/x-ndjson", 5000),
        ("/v1/jobs", "Application/X-NDJSON; charset=utf-8", 5000),
        ("/v1/jobs", "multipart/form-data; boundary=x", 1000),  # a JSON submit by another name
        ("/v1/files", "multipart/form-data; boundary=x", 3000 + 64 * 1024),
        ("/v1/files", "application/x-ndjson", 1000),
        ("/v1/batches", "multipart/form-data", 1000),
        ("/v1/embeddings", "application/x-ndjson", 1000),
    ],
)
@pytest.mark.parametrize("streamed", [False, True])
def test_a_body_over_its_route_and_kind_limit_is_413(
    path: str, content_type: str, limit: int, streamed: bool
) -> None:
    def body(size: int) -> bytes | Iterator[bytes]:
        data = b"x" * size
        return iter([data[i : i + 700] for i in range(0, size, 700)]) if streamed else data

    with client() as http:
        headers = {"Content-Type": content_type}
        assert http.post(path, content=body(limit), headers=headers).text == str(limit)
        answer = http.post(path, content=body(limit + 1), headers=headers)
        assert answer.status_code == 413
        assert f"over {limit} bytes" in answer.text
