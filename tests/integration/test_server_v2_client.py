"""A standard Open Inference Protocol v2 client (Triton's tritonclient.http, unchanged) against a real
server process: health, metadata, JSON and binary tensors, request ids, API keys and errors."""

from __future__ import annotations

import json
from collections.abc import Iterator

import numpy as np
import pytest
from tritonclient.http import InferenceServerClient, InferInput, InferRequestedOutput
from tritonclient.utils import InferenceServerException

from loom.devstack.servers import free_port
from loom.workloads.server.testing import model_server

pytestmark = pytest.mark.timeout(180)



def auth() -> dict[str, str]:
    # A fresh dict per call: tritonclient adds Inference-Header-Content-Length to the dict it is given.
    return {"Authorization": "Bearer triton-test-key"}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InferenceServerClient]:
    workdir = tmp_path_factory.mktemp("v2-client")
    (workdir / "keys").write_text("triton-test-key\n")
    config = workdir / "server.json"
    port = free_port()
    config.write_text(json.dumps({
        "modelName": "echo", "modelVersion": "7", "handler": "noop", "storageUri": str(workdir),
        "host": "127.0.0.1", "port": port, "auth": {"apiKeysFile": str(workdir / "keys")},
        "batching": {"maxBatchSize": 8, "maxLatencyMs": 2},
    }))
    with model_server(config, workdir / "server.log"):
        triton = InferenceServerClient(url=f"127.0.0.1:{port}")
        yield triton
        triton.close()


def test_health_and_metadata(client: InferenceServerClient) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("echo", headers=auth())
    assert client.is_model_ready("echo", "7", headers=auth())
    assert client.get_server_metadata(headers=auth())["name"] == "loom-model-server"
    metadata = client.get_model_metadata("echo", headers=auth())
    assert (metadata["name"], metadata["versions"]) == ("echo", ["7"])


@pytest.mark.parametrize("binary", [True, False])
def test_infer_with_binary_and_json_tensors(client: InferenceServerClient, binary: bool) -> None:
    floats = np.arange(6, dtype=np.float32).reshape(2, 3) / 4
    ints = np.array([[1, -2, 2**40]], dtype=np.int64)
    texts = np.array([b"hello", "wörld".encode()], dtype=np.object_)
    inputs = [InferInput("f", [2, 3], "FP32"), InferInput("i", [1, 3], "INT64"), InferInput("s", [2], "BYTES")]
    for tensor, values in zip(inputs, (floats, ints, texts), strict=True):
        tensor.set_data_from_numpy(values, binary_data=binary)
    outputs = [InferRequestedOutput(name, binary_data=binary) for name in ("s", "f", "i")]
    result = client.infer("echo", inputs, model_version="7", outputs=outputs, request_id="req-42", headers=auth())
    np.testing.assert_array_equal(result.as_numpy("f"), floats)
    np.testing.assert_array_equal(result.as_numpy("i"), ints)
    strings = [v if isinstance(v, bytes) else str(v).encode() for v in result.as_numpy("s").reshape(-1)]
    assert strings == [b"hello", "wörld".encode()]
    response = result.get_response()
    assert (response["id"], response["model_name"], response["model_version"]) == ("req-42", "echo", "7")
    assert [o["name"] for o in response["outputs"]] == ["s", "f", "i"]


def test_errors_come_back_as_client_exceptions(client: InferenceServerClient) -> None:
    tensor = InferInput("x", [2], "FP32")
    tensor.set_data_from_numpy(np.zeros(2, dtype=np.float32))
    with pytest.raises(InferenceServerException, match="model 'nope' not found"):
        client.infer("nope", [tensor], headers=auth())
    with pytest.raises(InferenceServerException, match="a valid API key is required"):
        client.infer("echo", [tensor])
    with pytest.raises(InferenceServerException, match="unknown requested output"):
        client.infer("echo", [tensor], outputs=[InferRequestedOutput("y")], headers=auth())
