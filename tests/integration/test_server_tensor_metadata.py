"""A generic OIP client (Triton's tritonclient.http, unchanged) discovers a tensor model's inputs and
outputs from its metadata alone, then infers with exactly what the metadata says: names, datatypes
and shapes. torch.export programs describe themselves; TorchScript through model-settings.json."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tritonclient.http import InferenceServerClient, InferInput, InferRequestedOutput
from tritonclient.utils import triton_to_np_dtype

from loom.devstack.servers import free_port
from loom.workloads.server.testing import model_server

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


class Scorer(torch.nn.Module):
    """Two inputs of different dtypes, two outputs of different dtypes and ranks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.layer = torch.nn.Linear(3, 2)

    def forward(self, features: torch.Tensor, offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.layer(features) + offset.unsqueeze(1).to(torch.float32)
        return scores, scores.argmax(dim=1)


SETTINGS = {
    "name": "scorer",  # MLServer's other keys are ignored
    "implementation": "mlserver_whatever.Model",
    "inputs": [
        {"name": "features", "datatype": "FP32", "shape": [-1, 3]},
        {"name": "offset", "datatype": "INT64", "shape": [-1]},
    ],
    "outputs": [
        {"name": "scores", "datatype": "FP32", "shape": [-1, 2]},
        {"name": "best", "datatype": "INT64", "shape": [-1]},
    ],
}


def write_torch_export(folder: Path) -> None:
    batch = torch.export.Dim("batch", min=1, max=1024)
    program = torch.export.export(
        Scorer().eval(),
        (torch.zeros(2, 3), torch.zeros(2, dtype=torch.int64)),
        dynamic_shapes={"features": {0: batch}, "offset": {0: batch}},
    )
    torch.export.save(program, str(folder / "model.pt2"))


def write_torchscript(folder: Path) -> None:
    torch.jit.script(Scorer().eval()).save(str(folder / "model.pt"))
    (folder / "model-settings.json").write_text(json.dumps(SETTINGS))


@pytest.fixture(scope="module", params=["torch-export", "torchscript"])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    handler: str = request.param
    workdir = tmp_path_factory.mktemp(handler)
    weights = workdir / "weights"
    weights.mkdir()
    (write_torch_export if handler == "torch-export" else write_torchscript)(weights)
    port = free_port()
    config = workdir / "server.json"
    config.write_text(json.dumps({
        "modelName": "scorer", "handler": handler, "storageUri": str(weights),
        "host": "127.0.0.1", "port": port, "device": "cpu",
    }))
    with model_server(config, workdir / "server.log"):
        yield handler, f"127.0.0.1:{port}"


def concrete(shape: list[int], rows: int) -> list[int]:
    return [rows if d == -1 else d for d in shape]


def test_a_generic_client_infers_with_only_what_the_metadata_says(served: tuple[str, str]) -> None:
    handler, url = served
    client = InferenceServerClient(url=url)
    try:
        metadata: dict[str, Any] = client.get_model_metadata("scorer")
        assert metadata["platform"] == ("pytorch_export" if handler == "torch-export" else "pytorch_torchscript")
        assert [(t["datatype"], t["shape"]) for t in metadata["inputs"]] == [("FP32", [-1, 3]), ("INT64", [-1])]
        assert [(t["datatype"], t["shape"]) for t in metadata["outputs"]] == [("FP32", [-1, 2]), ("INT64", [-1])]

        # Everything below is driven by the metadata: no tensor name, dtype or width is hard-coded.
        rng = np.random.default_rng(0)
        inputs, arrays = [], []
        for entry in metadata["inputs"]:
            shape = concrete(entry["shape"], rows=4)
            array = (rng.standard_normal(shape) * 5).astype(triton_to_np_dtype(entry["datatype"]))
            tensor = InferInput(entry["name"], shape, entry["datatype"])
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
            arrays.append(array)
        outputs = [InferRequestedOutput(entry["name"]) for entry in metadata["outputs"]]
        result = client.infer("scorer", inputs, outputs=outputs)

        with torch.no_grad():
            expected = Scorer().eval()(*(torch.from_numpy(a) for a in arrays))
        for entry, reference in zip(metadata["outputs"], expected, strict=True):
            got = result.as_numpy(entry["name"])
            assert got is not None, f"output {entry['name']} missing"
            assert got.dtype == triton_to_np_dtype(entry["datatype"])
            assert list(got.shape) == concrete(entry["shape"], rows=4)
            np.testing.assert_allclose(got, reference.numpy(), rtol=1e-5)
    finally:
        client.close()
