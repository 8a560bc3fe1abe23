"""spec.finetune under torchrun (2 CPU ranks, gloo) against a real S3 server: LoRA on a frozen Hugging Face Llama with
both engines, a rank killed and the run resumed from the adapter checkpoint, the adapter exported in peft's format."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

import psutil
import pytest

from loom.devstack.servers import MLflowEndpoint, S3Endpoint
from loom.e2e.trainer_harness import TrainerRun, torchrun_argv, trainer_env, write_wide_llama
from loom.workloads.common.s3 import S3Location, download_tree, list_keys, upload_file
from loom.workloads.llm.hf_model import LlamaShape
from loom.workloads.trainer.config import BaseModelSpec, FinetuneSpec
from loom.workloads.trainer.finetune import fetch_base_model

pytestmark = pytest.mark.slow

SHAPE = LlamaShape(max_positions=128)


@pytest.fixture
def base_model(s3: S3Endpoint, bucket: str, tmp_path: Path) -> str:
    """A random-weight Hugging Face Llama (with its own tokenizer) in S3: the frozen base."""
    folder = write_wide_llama(tmp_path / "base", seed=7)
    client = s3.client()
    for path in folder.iterdir():
        upload_file(client, path, S3Location(bucket, f"models/base/{path.name}"))
    return f"s3://{bucket}/models/base"


def lora_config(tmp_path: Path, uri: str, base: str, engine: str, max_steps: int) -> dict[str, Any]:
    return {
        "engine": engine,
        "entrypoint": "loom.workloads.trainer.examples.instructions:task",
        "training": {"maxSteps": max_steps, "batchSize": 8, "learningRate": 0.01, "device": "cpu",
                     "taskArgs": {"examples": 128, "blockSize": 48}},
        "checkpoint": {"uri": uri, "everySteps": 5, "keepLast": 2, "stagingDir": str(tmp_path / "staging")},
        "progress": {"file": str(tmp_path / "progress.json")},
        "finetune": {"baseModel": {"uri": base}, "rank": 8, "alpha": 16, "dropout": 0.0,
                     "cacheDir": str(tmp_path / "base-cache")},
    }


def _rank_process(parent: psutil.Process, rank: int) -> psutil.Process | None:
    for child in parent.children(recursive=True):
        try:
            if f"RANK={rank}" in Path(f"/proc/{child.pid}/environ").read_text().split("\0"):
                return child
        except (OSError, psutil.Error):
            continue
    return None


def run_and_kill_rank_1(config: dict[str, Any], s3: S3Endpoint, tmp_path: Path, after_step: int) -> TrainerRun:
    """torchrun with one elastic restart allowed; rank 1 is SIGKILLed once a checkpoint at or after `after_step`
    is committed."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    process = subprocess.Popen(torchrun_argv(path, nproc=2, max_restarts=1), env=trainer_env(s3),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    killed: list[int] = []

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            if not killed and '"event": "committed"' in line and json.loads(line)["step"] >= after_step:
                victim = _rank_process(psutil.Process(process.pid), 1)
                assert victim is not None
                killed.append(victim.pid)
                os.kill(victim.pid, signal.SIGKILL)

    reader = threading.Thread(target=pump)
    reader.start()
    try:
        process.wait(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
        reader.join(timeout=10)
    run = TrainerRun(process.returncode, "".join(lines))
    (tmp_path / "torchrun.log").write_text(run.output)
    assert run.returncode == 0, run.output[-4000:]
    assert killed, "the run finished before a rank could be killed"
    return run


def checkpoint_tensors(s3: S3Endpoint, bucket: str, prefix: str, tmp_path: Path) -> list[str]:
    """The tensor names a DCP checkpoint holds (its .metadata)."""
    import torch.distributed.checkpoint as dcp

    local = tmp_path / "ckpt-meta"
    download_tree(s3.client(), S3Location(bucket, prefix), local)
    return list(dcp.FileSystemReader(str(local)).read_metadata().state_dict_metadata)


def test_lora_with_fsdp_on_two_ranks_survives_a_killed_rank_and_exports_a_peft_adapter(
    s3: S3Endpoint, bucket: str, base_model: str, tmp_path: Path
) -> None:
    config = lora_config(tmp_path, f"s3://{bucket}/lora", base_model, "fsdp", max_steps=20)
    run = run_and_kill_rank_1(config, s3, tmp_path, after_step=10)

    # torchrun restarted the ranks once; they resumed from the newest adapter checkpoint and went on.
    assert [s["restart"] for s in run.of("start")] == [0, 1]
    before, after = run.output.split('"restart": 1', 1)
    resumed = run.of("resume")[0]["step"]
    assert resumed == max(e["step"] for e in TrainerRun(0, before).of("committed")) >= 10
    first_losses = {e["step"]: e["loss"] for e in TrainerRun(0, before).of("step")}
    later = TrainerRun(0, after).losses()
    assert min(later) == resumed + 1 and max(later) == 20
    # Same adapter, optimizer state and data position: a step seen before the kill repeats its loss exactly.
    for step in set(first_losses) & set(later):
        assert later[step] == pytest.approx(first_losses[step], abs=1e-4), step
    # The adapter learns: the answer-only loss falls far below where it started (about 10.9 -> 5).
    assert later[20] < first_losses[1] - 3.0, (first_losses[1], later[20])

    # The frozen base never changed on any rank, in either gang.
    frozen = run.of("frozenBase")
    assert len(frozen) == 2 and all(e["loaded"] == e["final"] for e in frozen)

    # Checkpoints hold the adapter and its optimizer state only: no base weight.
    names = checkpoint_tensors(s3, bucket, "lora/step-000000020", tmp_path)
    weights = [n for n in names if n.startswith("model.")]
    assert weights and all(".lora_A." in n or ".lora_B." in n for n in weights), weights[:5]
    assert not any("embed_tokens" in n or "mlp." in n for n in names)

    # The export is peft's adapter, named as Hugging Face's LlamaForCausalLM names its modules.
    keys = {k.removeprefix("lora/final/") for k, _ in list_keys(s3.client(), S3Location(bucket, "lora/final"))}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= keys
    download_tree(s3.client(), S3Location(bucket, "lora/final"), tmp_path / "adapter")
    adapter_config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["peft_type"] == "LORA" and adapter_config["r"] == 8 and adapter_config["lora_alpha"] == 16
    assert sorted(adapter_config["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    from safetensors.torch import load_file

    tensors = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert len(tensors) == SHAPE.num_layers * 4 * 2
    a = tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    b = tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    assert tuple(a.shape) == (8, SHAPE.hidden_size) and tuple(b.shape) == (SHAPE.hidden_size, 8)
    assert float(b.abs().max()) > 0  # B starts at zero: it trained


def test_lora_with_deepspeed_on_two_ranks_tracks_to_mlflow_and_resumes_at_world_size_one(
    s3: S3Endpoint, mlflow: MLflowEndpoint, bucket: str, base_model: str, tmp_path: Path
) -> None:
    config = lora_config(tmp_path, f"s3://{bucket}/ds-lora", base_model, "deepspeed", max_steps=10)
    config["deepspeed"] = {"zeroStage": 2}
    config["tracking"] = {"mlflow": {"trackingUri": mlflow.url, "experiment": "lora-tests"}}
    first = run_trainer(config, s3, tmp_path, nproc=2)
    losses = first.losses()
    assert sorted(losses) == list(range(1, 11)) and losses[10] < losses[1] - 1.5, losses
    assert all(e["loaded"] == e["final"] for e in first.of("frozenBase")) and len(first.of("frozenBase")) == 2
    weights = [n for n in checkpoint_tensors(s3, bucket, "ds-lora/step-000000010", tmp_path) if n.startswith("model.")]
    assert weights and all(".lora_" in n for n in weights)

    # Resume from the adapter checkpoint with half the ranks: the adapter and its moments come back.
    config["training"]["maxSteps"] = 12
    second = run_trainer(config, s3, tmp_path, nproc=1)
    assert second.of("resume")[0]["step"] == 10
    resumed = second.losses()
    assert sorted(resumed) == [11, 12] and resumed[11] < losses[1] - 1.5, resumed

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow.url)
    experiment = client.get_experiment_by_name("lora-tests")
    (run,) = client.search_runs([experiment.experiment_id])  # the resumed run logged into the same one
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == list(range(1, 13))
    assert run.data.params["finetune.rank"] == "8"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "model")}
    assert {"model/adapter_config.json", "model/adapter_model.safetensors"} <= artifacts


def run_trainer(config: dict[str, Any], s3: S3Endpoint, tmp_path: Path, nproc: int) -> TrainerRun:
    path = tmp_path / f"config-{nproc}.json"
    path.write_text(json.dumps(config))
    done = subprocess.run(torchrun_argv(path, nproc), env=trainer_env(s3), capture_output=True, text=True,
                          timeout=600)
    run = TrainerRun(done.returncode, done.stdout + done.stderr)
    assert run.returncode == 0, run.output[-4000:]
    return run


def test_an_mlflow_registered_base_is_fetched_from_its_version_source(
    s3: S3Endpoint, mlflow: MLflowEndpoint, bucket: str, base_model: str, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from mlflow.tracking import MlflowClient

    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)
    client = MlflowClient(tracking_uri=mlflow.url)
    client.create_registered_model("lora-base")
    version = client.create_model_version("lora-base", source=base_model)
    client.set_registered_model_alias("lora-base", "champion", version.version)
    spec = FinetuneSpec(base_model=BaseModelSpec(mlflow="models:/lora-base@champion", tracking_uri=mlflow.url),
                        cache_dir=str(tmp_path / "cache"))
    folder = fetch_base_model(spec, s3.url)
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    assert json.loads((folder / "config.json").read_text())["hidden_size"] == SHAPE.hidden_size
