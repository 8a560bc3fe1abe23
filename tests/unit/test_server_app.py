"""The model server's HTTP surface, through Starlette's TestClient (the real ASGI app, in process)."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from starlette.testclient import TestClient

from loom.workloads.server.app import build_app
from loom.workloads.server.config import ServerConfig
from loom.workloads.server.model import InferRequest, InferResponse, Model, ModelError, Tensor, TensorSpec


class Doubler(Model):
    """y = 2 * x; x == 13 is refused; `gate` (when set) holds predict; generate spells its prompt."""

    platform = "test"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.load_gate = threading.Event()
        self.load_gate.set()
        self.predict_gate = threading.Event()
        self.predict_gate.set()
        self.entered = threading.Event()
        self.batch_sizes: list[int] = []
        self.fail_load = False

    def load(self, folder: Path) -> None:
        self.load_gate.wait(timeout=60)
        if self.fail_load:
            raise OSError("weights missing")

    def predict(self, batch: list[InferRequest]) -> list[InferResponse | Exception]:
        self.entered.set()
        self.predict_gate.wait(timeout=60)
        self.batch_sizes.append(len(batch))
        results: list[InferResponse | Exception] = []
        for request in batch:
            x = request.inputs["x"].data
            if (x == 13).any():
                results.append(ModelError("13 is unlucky"))
            else:
                results.append(InferResponse(outputs=[Tensor("y", "FP32", (x * 2).astype(np.float32))]))
        return results

    def generate(self, prompt: str, parameters: dict[str, Any]) -> Iterator[str]:
        for char in prompt[: int(parameters.get("max_tokens", 100))]:
            yield char.upper()

    def inputs(self) -> list[TensorSpec]:
        return [TensorSpec("x", "FP32", [-1])]

    def outputs(self) -> list[TensorSpec]:
        return [TensorSpec("y", "FP32", [-1])]


def make(config: dict[str, Any] | None = None, model: Doubler | None = None) -> tuple[TestClient, Doubler]:
    cfg = ServerConfig.model_validate({"modelName": "dbl", "modelVersion": "2", **(config or {})})
    model = model or Doubler("dbl", "2")
    return TestClient(build_app(cfg, model, Path("/nonexistent"))), model


def wait_ready(client: TestClient) -> None:
    eventually(lambda: client.get("/v2/health/ready").status_code == 200, "server never became ready")


def eventually(condition: Callable[[], bool], message: str, within_s: float = 30.0) -> None:
    """Poll for a state (not a timing): generous, because the test machine may be busy."""
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(message)
        time.sleep(0.01)


def queue_depth_is(client: TestClient, depth: int) -> bool:
    return f'loom_server_queue_depth{{model="dbl"}} {float(depth)}' in client.get("/metrics").text


def infer_body(*values: float, request_id: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"inputs": [{"name": "x", "shape": [len(values)], "datatype": "FP32", "data": list(values)}]}
    if request_id:
        body["id"] = request_id
    return body


def test_live_at_once_ready_only_after_the_model_loaded() -> None:
    model = Doubler("dbl", "2")
    model.load_gate.clear()
    client, _ = make(model=model)
    with client:
        assert client.get("/v2/health/live").json() == {"live": True}
        assert client.get("/v2/health/ready").status_code == 503
        assert client.get("/v2/models/dbl/ready").status_code == 503
        assert client.post("/v2/models/dbl/infer", json=infer_body(1)).status_code == 503
        model.load_gate.set()
        wait_ready(client)
        assert client.get("/v2/models/dbl/ready").json() == {"name": "dbl", "ready": True}
        assert client.get("/v2/models/dbl/versions/2/ready").status_code == 200


def test_a_model_that_fails_to_load_is_never_ready_and_says_why() -> None:
    model = Doubler("dbl", "2")
    model.fail_load = True
    client, _ = make(model=model)
    with client:
        eventually(
            lambda: "weights missing" in client.post("/v2/models/dbl/infer", json=infer_body(1)).text,
            "the load failure was never reported",
        )
        response = client.post("/v2/models/dbl/infer", json=infer_body(1))
        assert response.status_code == 503
        assert "OSError: weights missing" in response.json()["error"]
        assert client.get("/v2/health/ready").status_code == 503


def test_metadata_endpoints() -> None:
    client, _ = make()
    with client:
        server = client.get("/v2").json()
        assert server["name"] == "loom-model-server"
        assert "generate_stream" in server["extensions"]
        assert client.get("/v2/models/dbl").json() == {
            "name": "dbl",
            "versions": ["2"],
            "platform": "test",
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}],
            "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}],
        }
        assert client.get("/v2/models/dbl/versions/2").status_code == 200
        assert client.get("/v2/models/other").status_code == 404
        assert client.get("/v2/models/dbl/versions/9").json()["error"].startswith("model 'dbl' has no version")


def test_infer_roundtrip_and_errors() -> None:
    client, _ = make()
    with client:
        wait_ready(client)
        ok = client.post("/v2/models/dbl/versions/2/infer", json=infer_body(1, 2.5, request_id="r-1"))
        assert ok.status_code == 200
        assert ok.json() == {
            "model_name": "dbl",
            "model_version": "2",
            "id": "r-1",
            "outputs": [{"name": "y", "datatype": "FP32", "shape": [2], "data": [2.0, 5.0]}],
        }
        assert client.post("/v2/models/nope/infer", json=infer_body(1)).status_code == 404
        bad_shape = client.post(
            "/v2/models/dbl/infer", json={"inputs": [{"name": "x", "shape": [3], "datatype": "FP32", "data": [1]}]}
        )
        assert bad_shape.status_code == 400
        assert "needs 3 elements" in bad_shape.json()["error"]
        refused = client.post("/v2/models/dbl/infer", json=infer_body(13))
        assert (refused.status_code, refused.json()) == (400, {"error": "13 is unlucky"})
        assert client.get("/v2/models/dbl/infer").status_code == 405
        assert client.get("/nothing/here").json() == {"error": "no route for GET /nothing/here"}


def test_concurrent_requests_are_batched_and_one_failure_stays_local() -> None:
    client, model = make({"batching": {"maxBatchSize": 8, "maxLatencyMs": 200}})
    with client:
        wait_ready(client)
        model.predict_gate.clear()
        with ThreadPoolExecutor(max_workers=6) as pool:
            warm = pool.submit(client.post, "/v2/models/dbl/infer", json=infer_body(0))
            assert model.entered.wait(60)
            futures = [pool.submit(client.post, "/v2/models/dbl/infer", json=infer_body(v, request_id=str(v)))
                       for v in (1, 13, 3, 4, 5)]
            eventually(lambda: queue_depth_is(client, 5), "the five requests never queued")
            model.predict_gate.set()
            responses = [f.result() for f in futures]
            assert warm.result().status_code == 200
        assert [r.status_code for r in responses] == [200, 400, 200, 200, 200]
        assert [r.json().get("id") for r in responses] == ["1", None, "3", "4", "5"]
        assert [r.json()["outputs"][0]["data"] for r in responses if r.status_code == 200] == [[2], [6], [8], [10]]
        assert model.batch_sizes == [1, 5]


def test_a_full_queue_answers_503_with_retry_after() -> None:
    client, model = make({"batching": {"maxBatchSize": 1, "maxLatencyMs": 0, "maxQueue": 1}})
    with client:
        wait_ready(client)
        model.predict_gate.clear()
        with ThreadPoolExecutor(max_workers=2) as pool:
            running = pool.submit(client.post, "/v2/models/dbl/infer", json=infer_body(1))
            assert model.entered.wait(60)
            queued = pool.submit(client.post, "/v2/models/dbl/infer", json=infer_body(2))
            eventually(lambda: queue_depth_is(client, 1), "the second request never queued")
            refused = client.post("/v2/models/dbl/infer", json=infer_body(3))
            model.predict_gate.set()
            assert (running.result().status_code, queued.result().status_code) == (200, 200)
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "1"
        assert "queue is full" in refused.json()["error"]


def test_api_keys_are_required_checked_and_never_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    keys = tmp_path / "keys"
    keys.write_text("good-key-123\n")
    client, _ = make({"auth": {"apiKeysFile": str(keys)}})
    caplog.set_level(logging.DEBUG)
    with client:
        wait_ready(client)  # probes need no key
        assert client.get("/metrics").status_code == 200
        missing = client.post("/v2/models/dbl/infer", json=infer_body(1))
        assert missing.status_code == 401
        assert missing.headers["www-authenticate"] == "Bearer"
        wrong = client.post("/v2/models/dbl/infer", json=infer_body(1), headers={"Authorization": "Bearer bad-key-456"})
        assert wrong.status_code == 401
        assert client.get("/v2", headers={"x-api-key": "bad-key-456"}).status_code == 401
        good = {"Authorization": "Bearer good-key-123"}
        bearer = client.post("/v2/models/dbl/infer", json=infer_body(1), headers=good)
        assert bearer.status_code == 200
        assert client.get("/v2", headers={"X-API-Key": "good-key-123"}).status_code == 200
    assert "refused request" in caplog.text
    assert "good-key-123" not in caplog.text and "bad-key-456" not in caplog.text


def test_rate_limit_is_per_key_with_429_and_retry_after(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("alice\nbob\n")
    client, _ = make({"auth": {"apiKeysFile": str(keys), "rateLimit": {"requestsPerSecond": 0.1, "burst": 2}}})
    with client:
        wait_ready(client)
        alice = {"Authorization": "Bearer alice"}
        codes = [client.post("/v2/models/dbl/infer", json=infer_body(1), headers=alice).status_code for _ in range(3)]
        assert codes == [200, 200, 429]
        limited = client.post("/v2/models/dbl/infer", json=infer_body(1), headers=alice)
        assert limited.json() == {"error": "rate limit exceeded"}
        assert 1 <= int(limited.headers["retry-after"]) <= 20
        assert client.post("/v2/models/dbl/infer", json=infer_body(1), headers={"x-api-key": "bob"}).status_code == 200
        assert client.get("/v2/health/ready").status_code == 200  # probes are never limited
        text = client.get("/metrics").text
        assert 'loom_server_request_errors_total{code="429",model="dbl"} 2.0' in text


def test_generate_and_server_sent_events_stream() -> None:
    client, _ = make()
    with client:
        wait_ready(client)
        with client.stream(
            "POST", "/v2/models/dbl/generate_stream", json={"text_input": "hey", "id": "g1"}
        ) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            events = [json.loads(line[len("data: "):]) for line in response.iter_lines() if line.startswith("data: ")]
        assert [e["text_output"] for e in events] == ["H", "E", "Y"]
        assert all(e["model_name"] == "dbl" and e["id"] == "g1" for e in events)
        limited = client.post(
            "/v2/models/dbl/generate_stream", json={"text_input": "abcdef", "parameters": {"max_tokens": 2}}
        )
        assert limited.text.count("data: ") == 2
        bad = client.post("/v2/models/dbl/generate_stream", json={"prompt": "x"})
        assert bad.status_code == 400 and "text_input" in bad.json()["error"]


def test_a_handler_bug_is_a_500_naming_the_exception() -> None:
    client, _ = make()
    with client:
        wait_ready(client)
        # The Doubler's predict reads input "x", which a generate request does not have.
        response = client.post("/v2/models/dbl/generate", json={"text_input": "hi"})
        assert response.status_code == 500
        assert response.json()["error"] == "KeyError: 'x'"


def test_a_server_bug_is_still_a_json_error_and_counted() -> None:
    class Broken(Doubler):
        def outputs(self) -> list[TensorSpec]:
            raise RuntimeError("metadata exploded")

    client, _ = make(model=Broken("dbl", "2"))
    with client:
        response = client.get("/v2/models/dbl")
        metrics = client.get("/metrics").text
    assert (response.status_code, response.json()) == (500, {"error": "internal error: RuntimeError"})
    assert 'loom_server_request_errors_total{code="500",model="dbl"} 1.0' in metrics


def test_metrics_count_requests_batches_and_errors() -> None:
    client, _ = make()
    with client:
        wait_ready(client)
        client.post("/v2/models/dbl/infer", json=infer_body(1))
        client.post("/v2/models/dbl/infer", json=infer_body(13))
        client.post("/v2/models/nope/infer", json=infer_body(1))
        text = client.get("/metrics").text
    assert 'loom_server_requests_total{code="200",endpoint="infer",model="dbl"} 1.0' in text
    assert 'loom_server_request_errors_total{code="400",model="dbl"} 1.0' in text
    assert 'loom_server_request_errors_total{code="404",model="dbl"} 1.0' in text
    assert 'loom_server_request_duration_seconds_count{endpoint="infer",model="dbl"} 3.0' in text
    assert 'loom_server_batch_size_count{model="dbl"} 2.0' in text
    assert 'loom_server_inflight_requests{model="dbl"} 0.0' in text
    assert 'loom_server_model_ready{model="dbl"} 1.0' in text
