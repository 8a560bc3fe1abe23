"""Built-in handlers on real (small) models: batched results equal unbatched ones, per request."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from loom.workloads.server.chargpt_handler import CharGPTModel, save_for_serving
from loom.workloads.server.handlers import (
    MLflowPyfuncModel,
    NoopModel,
    TorchExportModel,
    TorchScriptModel,
    load_handler_class,
)
from loom.workloads.server.model import InferRequest, InferResponse, Model, ModelError, Tensor, TensorSpec
from loom.workloads.server.signature import SETTINGS_FILE, torch_datatype
from loom.workloads.trainer.examples import chargpt


def text_request(*prompts: str, **parameters: Any) -> InferRequest:
    data = np.empty(len(prompts), dtype=object)
    data[:] = list(prompts)
    return InferRequest(inputs={"text_input": Tensor("text_input", "BYTES", data)}, parameters=parameters)


def float_request(rows: list[list[float]], name: str = "x") -> InferRequest:
    return InferRequest(inputs={name: Tensor(name, "FP32", np.array(rows, dtype=np.float32))})


def ok(result: InferResponse | Exception) -> InferResponse:
    assert isinstance(result, InferResponse), result
    return result


@pytest.fixture(scope="module")
def gpt_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    model = chargpt.GPT(chargpt.GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32))
    return save_for_serving(model, tmp_path_factory.mktemp("chargpt") / "final")


@pytest.fixture(scope="module")
def gpt(gpt_folder: Path) -> CharGPTModel:
    model = CharGPTModel("chargpt", "1", {"device": "cpu"})
    model.load(gpt_folder.parent)  # the handler finds config.json below the folder it is given
    return model


def test_chargpt_batched_greedy_generation_equals_one_by_one(gpt: CharGPTModel) -> None:
    prompts = ["Tom ", "Huck", "The fence was long", ""]
    batch = [text_request(p, temperature=0, max_tokens=10 + i) for i, p in enumerate(prompts)]
    results = gpt.predict(batch)
    for i, (prompt, result) in enumerate(zip(prompts, results, strict=True)):
        expected = chargpt.generate(gpt.model, prompt[-16:] or "\n", max_new_tokens=10 + i, temperature=0)
        output = ok(result).outputs[0]
        assert output.name == "text_output" and output.datatype == "BYTES"
        assert output.data.tolist() == [expected]


def test_chargpt_request_with_several_prompts_and_a_bad_neighbour(gpt: CharGPTModel) -> None:
    good = text_request("ab", "cd", temperature=0, max_tokens=3)
    bad = text_request("ef", max_tokens=-1)
    wrong_input = InferRequest(inputs={"x": Tensor("x", "FP32", np.zeros(1, dtype=np.float32))})
    results = gpt.predict([good, bad, wrong_input])
    texts = ok(results[0]).outputs[0].data.tolist()
    assert len(texts) == 2 and all(len(t) == 3 for t in texts)
    assert isinstance(results[1], ModelError) and "max_tokens" in str(results[1])
    assert isinstance(results[2], ModelError) and "text_input" in str(results[2])


def test_chargpt_loads_a_sharded_training_checkpoint(gpt: CharGPTModel, tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    # The trainer's checkpoint state: {"model": ..., "optim": ...}, written with DCP (no process group here).
    optimizer = torch.optim.AdamW(gpt.model.parameters())
    dcp.save({"model": gpt.model.state_dict(), "optim": optimizer.state_dict()}, checkpoint_id=str(tmp_path / "step"))
    restored = CharGPTModel("chargpt", "step-1", {"device": "cpu", "model": {"n_head": 2}})
    restored.load(tmp_path)
    assert restored.model.config == gpt.model.config
    prompt = text_request("Injun Joe", temperature=0, max_tokens=12)
    expected = ok(gpt.predict([prompt])[0]).outputs[0].data.tolist()
    assert ok(restored.predict([prompt])[0]).outputs[0].data.tolist() == expected


def test_chargpt_stream_yields_the_same_text_piece_by_piece(gpt: CharGPTModel) -> None:
    pieces = list(gpt.generate("Becky", {"temperature": 0, "max_tokens": 8}))
    assert len(pieces) == 8
    assert "".join(pieces) == chargpt.generate(gpt.model, "Becky", max_new_tokens=8, temperature=0)


def test_chargpt_sampling_respects_top_k_one(gpt: CharGPTModel) -> None:
    # top_k=1 leaves one candidate: sampling at any temperature is greedy.
    sampled = ok(gpt.predict([text_request("Tom", temperature=5.0, top_k=1, max_tokens=6)])[0])
    assert sampled.outputs[0].data.tolist() == [chargpt.generate(gpt.model, "Tom", 6, temperature=0)]


class Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.layer = torch.nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.layer(x)
        return y, y.sum(dim=1)


def _check_tensor_model(model: Model, reference: torch.nn.Module) -> None:
    rows = [[[1.0, 2.0, 3.0]], [[0.0, 0.5, 1.0], [2.0, 2.0, 2.0]], [[9.0, 8.0, 7.0]]]
    batch = [float_request(r) for r in rows]
    batch.append(float_request([[1.0, 2.0]]))  # wrong width: fails alone
    batch[2].requested_outputs = ["out_sum"]
    results = model.predict(batch)
    for request_rows, result, request in zip(rows, results, batch, strict=False):
        with torch.no_grad():
            full, total = reference(torch.tensor(request_rows))
        outputs = {t.name: t.data for t in ok(result).outputs}
        if request.requested_outputs:
            assert list(outputs) == ["out_sum"]
        else:
            np.testing.assert_allclose(outputs["out"], full.numpy(), rtol=1e-5)
        np.testing.assert_allclose(outputs["out_sum"], total.numpy(), rtol=1e-5)
    assert isinstance(results[3], Exception)


def test_torchscript_handler(tmp_path: Path) -> None:
    reference = Mlp().eval()
    torch.jit.script(reference).save(str(tmp_path / "model.pt"))
    model = TorchScriptModel("mlp", None, {"device": "cpu", "outputs": ["out", "out_sum"]})
    model.load(tmp_path)
    _check_tensor_model(model, reference)


def test_torch_export_handler_with_a_dynamic_batch_dimension(tmp_path: Path) -> None:
    reference = Mlp().eval()
    batch = torch.export.Dim("batch", min=1, max=1024)
    program = torch.export.export(reference, (torch.zeros(2, 3),), dynamic_shapes={"x": {0: batch}})
    torch.export.save(program, str(tmp_path / "model.pt2"))
    model = TorchExportModel("mlp", None, {"device": "cpu", "outputs": ["out", "out_sum"]})
    model.load(tmp_path)
    _check_tensor_model(model, reference)


class Pair(torch.nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"diff": a - b.to(torch.float32), "count": (a > 0).sum(dim=1)}


def test_torch_export_metadata_comes_from_the_program_signature(tmp_path: Path) -> None:
    batch = torch.export.Dim("batch", min=1, max=1024)
    mlp = torch.export.export(Mlp().eval(), (torch.zeros(2, 3),), dynamic_shapes={"x": {0: batch}})
    torch.export.save(mlp, str(tmp_path / "model.pt2"))
    named = TorchExportModel("mlp", None, {"device": "cpu", "outputs": ["out", "out_sum"]})
    named.load(tmp_path)
    assert named.inputs() == [TensorSpec("x", "FP32", [-1, 3])]
    assert named.outputs() == [TensorSpec("out", "FP32", [-1, 2]), TensorSpec("out_sum", "FP32", [-1])]
    unnamed = TorchExportModel("mlp", None, {"device": "cpu"})
    unnamed.load(tmp_path)
    assert [o.name for o in unnamed.outputs()] == ["output__0", "output__1"]
    assert [t.name for t in ok(unnamed.predict([float_request([[1.0, 2.0, 3.0]])])[0]).outputs] == [
        "output__0", "output__1",
    ]

    # A static shape stays static; a dict result names the outputs by its keys.
    pair = torch.export.export(Pair(), (torch.zeros(4, 2), torch.zeros(4, 2, dtype=torch.int32)))
    (tmp_path / "pair").mkdir()
    torch.export.save(pair, str(tmp_path / "pair" / "model.pt2"))
    model = TorchExportModel("pair", None, {"device": "cpu"})
    model.load(tmp_path / "pair")
    assert model.inputs() == [TensorSpec("a", "FP32", [4, 2]), TensorSpec("b", "INT32", [4, 2])]
    assert model.outputs() == [TensorSpec("diff", "FP32", [4, 2]), TensorSpec("count", "INT64", [4])]

    # Inputs named as advertised are matched by name, whatever their order in the request.
    a = np.arange(8, dtype=np.float32).reshape(4, 2)
    b = np.ones((4, 2), dtype=np.int32)
    request = InferRequest(inputs={"b": Tensor("b", "INT32", b), "a": Tensor("a", "FP32", a)})
    outputs = {t.name: t.data for t in ok(model.predict([request])[0]).outputs}
    np.testing.assert_array_equal(outputs["diff"], a - 1)
    np.testing.assert_array_equal(outputs["count"], [1, 2, 2, 2])


def test_torchscript_metadata_comes_from_model_settings_beside_the_weights(tmp_path: Path) -> None:
    weights = tmp_path / "nested"
    weights.mkdir()
    torch.jit.script(Mlp().eval()).save(str(weights / "model.pt"))
    bare = TorchScriptModel("mlp", None, {"device": "cpu"})
    bare.load(tmp_path)
    assert (bare.inputs(), bare.outputs()) == ([], [])  # nothing to say without the settings file

    settings = {
        "name": "mlp", "parameters": {"version": "1"},  # MLServer keys that do not concern us
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 3]}],
        "outputs": [{"name": "out", "datatype": "FP32", "shape": [-1, 2]},
                    {"name": "out_sum", "datatype": "FP32", "shape": [-1]}],
    }
    (weights / SETTINGS_FILE).write_text(json.dumps(settings))
    model = TorchScriptModel("mlp", None, {"device": "cpu"})
    model.load(tmp_path)
    assert model.inputs() == [TensorSpec("x", "FP32", [-1, 3])]
    assert model.outputs() == [TensorSpec("out", "FP32", [-1, 2]), TensorSpec("out_sum", "FP32", [-1])]
    _check_tensor_model(model, Mlp().eval())  # the settings' output names name the returned tuple

    with pytest.raises(ValueError, match=r"handlerOptions.outputs \['a', 'b'\] disagrees"):
        TorchScriptModel("mlp", None, {"device": "cpu", "outputs": ["a", "b"]}).load(tmp_path)
    for broken, message in [
        ({"inputs": [{"name": "x", "datatype": "FLOAT", "shape": [3]}]}, "datatype"),
        ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [-2]}]}, "shape dimensions"),
        ({"outputs": [{"name": "y", "datatype": "FP32", "shape": [1]}] * 2}, "unique"),
    ]:
        (weights / SETTINGS_FILE).write_text(json.dumps(broken))
        with pytest.raises(ValueError, match=message):
            TorchScriptModel("mlp", None, {"device": "cpu"}).load(tmp_path)
    (weights / SETTINGS_FILE).write_text("{not json")
    with pytest.raises(ValueError, match="not a valid model settings file"):
        TorchScriptModel("mlp", None, {"device": "cpu"}).load(tmp_path)


def test_torch_dtypes_map_to_protocol_datatypes() -> None:
    assert [torch_datatype(d) for d in (torch.float32, torch.int64, torch.bool, torch.float16, torch.bfloat16)] == [
        "FP32", "INT64", "BOOL", "FP16", "BF16",
    ]
    with pytest.raises(ValueError, match="no Open Inference Protocol datatype"):
        torch_datatype(torch.complex64)


def test_mlflow_pyfunc_handler(tmp_path: Path) -> None:
    import mlflow.pyfunc

    class Affine(mlflow.pyfunc.PythonModel):  # type: ignore[misc]
        # No type hints here: MLflow would read them as an input schema.
        def predict(self, context, model_input, params=None):  # type: ignore[no-untyped-def]
            return np.asarray(model_input) * 3 + 1

    mlflow.pyfunc.save_model(str(tmp_path / "nested" / "affine"), python_model=Affine())
    model = MLflowPyfuncModel("affine", "1")
    model.load(tmp_path)
    results = model.predict([float_request([[1.0, 2.0]]), float_request([[0.0, -1.0], [5.0, 5.0]])])
    assert ok(results[0]).outputs[0].data.tolist() == [[4.0, 7.0]]
    assert ok(results[1]).outputs[0].name == "predictions"
    assert ok(results[1]).outputs[0].data.tolist() == [[1.0, -2.0], [16.0, 16.0]]


def test_noop_echoes_and_honours_requested_outputs() -> None:
    request = float_request([[1.0]])
    request.requested_outputs = ["missing"]
    results = NoopModel("n").predict([float_request([[1.0]]), request])
    assert ok(results[0]).outputs[0].data.tolist() == [[1.0]]
    assert isinstance(results[1], ModelError)


def test_handler_lookup() -> None:
    assert load_handler_class("noop") is NoopModel
    assert load_handler_class("chargpt") is CharGPTModel
    assert load_handler_class("loom.workloads.server.handlers:TorchScriptModel") is TorchScriptModel
    with pytest.raises(TypeError, match=r"not a loom\.workloads\.server\.model\.Model"):
        load_handler_class("loom.workloads.server.protocol:ProtocolError")
