"""Every refusal of the vllm runtime's front is OpenAI-shaped (`{"error": {"message", "type", "code"}}`), also those
answered before any route runs (the shared body limit's 413, 408 and 400), so the official `openai` client reads
them as it reads OpenAI's own. The front is driven in process with no engine started (its lifespan does not run):
the body limit and the routes' own refusals need none.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
from starlette.testclient import TestClient

from loom.workloads.common.body_limit import plain_error_body
from loom.workloads.llm.app import build_app
from loom.workloads.llm.config import LlmLimits, LlmServerConfig
from loom.workloads.llm.openai_protocol import body_limit_error
from loom.workloads.server.config import AuthConfig

LIMIT = 2048


@pytest.fixture
def front(tmp_path: Path) -> TestClient:
    config = LlmServerConfig(model_name="tiny", model_dir=str(tmp_path), max_request_bytes=LIMIT)
    return TestClient(build_app(config))  # not entered: no lifespan, so no engine is started


def test_an_oversized_body_is_a_413_in_openais_shape_that_the_openai_client_reads(front: TestClient) -> None:
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="k", http_client=front, max_retries=0)
    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x" * (2 * LIMIT)}])
    assert refused.value.status_code == 413
    assert refused.value.body == {
        "message": f"request body of {refused.value.response.request.headers['content-length']} bytes exceeds the "
                   f"limit of {LIMIT}",
        "type": "invalid_request_error", "param": None, "code": "request_too_large",
    }


def test_a_streamed_oversized_body_is_refused_the_same_way(front: TestClient) -> None:
    chunks = (b"x" * 1024 for _ in range(4))  # no Content-Length: refused at the first chunk past the limit
    response = front.post("/v1/completions", content=chunks, headers={"content-type": "application/json"})
    assert response.status_code == 413
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "request_too_large")
    assert str(LIMIT) in error["message"]


def test_a_bad_content_length_is_a_400_in_openais_shape(front: TestClient) -> None:
    response = front.post("/v1/completions", content=b"{}", headers={"content-length": "many"})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_content_length"


def test_the_fronts_other_refusals_are_openai_shaped_too(front: TestClient) -> None:
    loading = front.post("/v1/completions", json={"model": "tiny", "prompt": "hi"})
    assert loading.status_code == 503 and loading.json()["error"]["code"] == "model_not_ready"
    missing = front.get("/v1/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"


def test_the_error_shapes_differ_only_in_their_body() -> None:
    assert json.loads(plain_error_body(413, "too big")) == {"error": "too big"}  # the model server's, unchanged
    assert json.loads(body_limit_error(408, "slow")) == {
        "error": {"message": "slow", "type": "timeout_error", "param": None, "code": "request_body_timeout"}
    }
    assert isinstance(httpx.Response(413, content=body_limit_error(413, "x")).json()["error"], dict)


def test_past_the_request_budget_a_key_gets_429_with_when_to_retry(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOOM_TEST_KEYS", "k1,k2")
    config = LlmServerConfig(model_name="tiny", model_dir=str(tmp_path), auth=AuthConfig(api_keys_env="LOOM_TEST_KEYS"),
                             limits=LlmLimits(requests_per_minute=2))
    front = TestClient(build_app(config))
    body = {"model": "tiny", "prompt": "hi"}
    for _ in range(2):  # let through by the guard: the route answers (no engine here: still loading)
        assert front.post("/v1/completions", json=body, headers={"authorization": "Bearer k1"}).status_code == 503
    refused = front.post("/v1/completions", json=body, headers={"authorization": "Bearer k1"})
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert "requests per minute" in refused.json()["error"]["message"]
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    assert front.post("/v1/completions", json=body, headers={"authorization": "Bearer k2"}).status_code == 503
    unknown = front.post("/v1/completions", json=body, headers={"authorization": "Bearer nope"})
    assert unknown.status_code == 401 and unknown.headers["www-authenticate"] == "Bearer"
