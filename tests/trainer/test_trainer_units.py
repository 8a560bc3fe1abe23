"""Pure parts of the trainer: the config contract, manifests, retention, the example model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from loom.workloads.trainer.checkpoint.manifest import (
    FileEntry,
    RankReport,
    checkpoint_dir_name,
    complete_steps,
    merge_reports,
    step_of,
    steps_to_delete,
)
from loom.workloads.trainer.config import EXIT_PERMANENT, ConfigError, TrainerConfig, load_config

SHA = "0" * 64


def test_config_accepts_kubernetes_camel_case_and_round_trips() -> None:
    config = TrainerConfig.model_validate(
        {
            "engine": "deepspeed",
            "deepspeed": {"zeroStage": 3, "offload": "cpu", "bf16": True, "config": {"zero_optimization": {"x": 1}}},
            "training": {"maxSteps": 50, "batchSize": 4},
            "checkpoint": {"uri": "s3://bucket/runs/a", "everySteps": 10, "async": False, "keepLast": 2},
            "tracking": {"mlflow": {"trackingUri": "http://mlflow:5000", "experiment": "e"}},
        }
    )
    assert config.deepspeed.zero_stage == 3
    assert config.checkpoint is not None and config.checkpoint.async_ is False
    assert (config.checkpoint.bucket, config.checkpoint.prefix) == ("bucket", "runs/a")
    assert config.output_uri() == "s3://bucket/runs/a/final"
    again = TrainerConfig.model_validate(json.loads(config.to_json()))
    assert again == config
    assert '"zeroStage": 3' in config.to_json() and '"async": false' in config.to_json()


@pytest.mark.parametrize(
    "bad",
    [
        {"deepspeed": {"zeroStage": 4}},
        {"engine": "horovod"},
        {"training": {"maxSteps": 0}},
        {"checkpoint": {"uri": "http://not-s3/x"}},
        {"checkpoint": {"uri": "s3://bucket/x", "resume": "yesterday"}},
        {"training": {"maxStep": 10}},  # typo: unknown fields are errors, not silently ignored
        {"entrypoint": "no-colon"},
        {"engine": "deepspeed", "deepspeed": {"zeroStage": 0, "offload": "cpu"}},
    ],
)
def test_config_rejects_invalid_values(bad: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        TrainerConfig.model_validate(bad)


def test_config_never_carries_credentials() -> None:
    schema = json.dumps(TrainerConfig.model_json_schema(by_alias=True)).lower()
    assert "secret" not in schema and "accesskey" not in schema and "password" not in schema


def test_load_config_reports_field_paths(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"training": {"batchSize": -1}}))
    with pytest.raises(ConfigError, match=r"training\.batchSize"):
        load_config(path)
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(path)


def test_config_module_imports_without_torch() -> None:
    code = "import sys, loom.workloads.trainer.config; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONSAFEPATH": "1"},
    )
    assert out.stdout.strip() == "False"


def test_bad_config_exits_with_the_permanent_code_and_a_clear_message(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"engine": "deepspeed", "deepspeed": {"zeroStage": 9}}))
    env = {**os.environ, "PYTHONSAFEPATH": "1", "LOOM_TERMINATION_LOG": str(tmp_path / "termination")}
    done = subprocess.run(
        [sys.executable, "-m", "loom.workloads.trainer", "--config", str(path)], capture_output=True, text=True, env=env
    )
    assert done.returncode == EXIT_PERMANENT
    assert "deepspeed.zeroStage" in done.stderr and "permanent" in done.stderr
    message = json.loads((tmp_path / "termination").read_text())
    assert message["exitCode"] == EXIT_PERMANENT and "deepspeed.zeroStage" in message["message"]


def test_an_entrypoint_that_cannot_be_imported_exits_with_the_permanent_code_naming_the_module(tmp_path: Path) -> None:
    """A typo in the task's module is a user error, not a crash to retry: the trainer's permanent exit code and a
    termination message that names the module (the operator then fails the job at once: unit and kwok tiers). Its
    proof through torchrun on the node agent is e2e test_trainingjob_training, in make test-all."""
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"entrypoint": "loom.workloads.trainer.examples.no_such_module:task"}))
    env = {**os.environ, "PYTHONSAFEPATH": "1", "LOOM_TERMINATION_LOG": str(tmp_path / "termination")}
    done = subprocess.run(
        [sys.executable, "-m", "loom.workloads.trainer", "--config", str(path)], capture_output=True, text=True, env=env
    )
    assert done.returncode == EXIT_PERMANENT, done.stderr[-2000:]
    message = json.loads((tmp_path / "termination").read_text())
    assert message["exitCode"] == EXIT_PERMANENT and "no_such_module" in message["message"], message


def test_manifest_merges_every_rank_and_refuses_gaps() -> None:
    reports = [
        RankReport(
            rank=0,
            session="s",
            files=[
                FileEntry(path=".metadata", size=3, sha256=SHA),
                FileEntry(path="__0_0.distcp", size=10, sha256=SHA),
            ],
        ),
        RankReport(rank=1, session="s", files=[FileEntry(path="__1_0.distcp", size=12, sha256=SHA)]),
    ]
    manifest = merge_reports(reports, world_size=2, step=7, engine="fsdp", now=1.0)
    assert [f.path for f in manifest.files] == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert manifest.total_bytes() == 25
    with pytest.raises(ValueError, match=r"ranks \[1\]"):
        merge_reports(reports[:1], world_size=2, step=7, engine="fsdp", now=1.0)
    duplicate = RankReport(rank=1, session="s", files=[FileEntry(path="__0_0.distcp", size=1, sha256=SHA)])
    with pytest.raises(ValueError, match="two ranks"):
        merge_reports([reports[0], duplicate], world_size=2, step=7, engine="fsdp", now=1.0)


def test_only_checkpoints_with_a_manifest_count_as_complete() -> None:
    keys = [
        "runs/a/step-000000004/__0_0.distcp",
        "runs/a/step-000000004/manifest.json",
        "runs/a/step-000000008/__0_0.distcp",
        "runs/a/step-000000008/manifest.json",
        "runs/a/step-000000012/__0_0.distcp",  # torn: shards but no manifest
        "runs/a/final/manifest.json",
        "runs/ab/step-000000016/manifest.json",
    ]
    assert complete_steps(keys, "runs/a") == [4, 8]
    assert step_of(checkpoint_dir_name(123)) == 123 and step_of("final") is None


@pytest.mark.parametrize(
    ("steps", "keep", "doomed"),
    [([4, 8, 12], 2, [4]), ([4, 8], 2, []), ([12, 4, 8, 16], 1, [4, 8, 12]), ([4, 8], None, [])],
)
def test_retention_deletes_only_older_complete_checkpoints(
    steps: list[int], keep: int | None, doomed: list[int]
) -> None:
    assert steps_to_delete(steps, keep) == doomed


def test_chargpt_round_trips_text_and_exported_weights(tmp_path: Path) -> None:
    import torch

    from loom.workloads.trainer.examples import chargpt

    assert chargpt.decode(chargpt.encode("Tom!\nAunt Polly")) == "Tom!\nAunt Polly"
    model = chargpt.GPT(chargpt.GPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=16))
    torch.save(model.state_dict(), tmp_path / chargpt.WEIGHTS_FILE)
    (tmp_path / chargpt.CONFIG_FILE).write_text(json.dumps(chargpt.task.export_config(model)))
    loaded = chargpt.load_for_inference(tmp_path)
    idx = torch.tensor([chargpt.encode("Tom")])
    assert torch.equal(loaded(idx), model.eval()(idx))
    text = chargpt.generate(loaded, "Tom", max_new_tokens=5, temperature=0)
    assert len(text) == 5


def test_staging_copies_into_reused_buffers_independent_of_training() -> None:
    import torch

    from loom.workloads.trainer.checkpoint.staging import ReusableCPUStager

    weights = torch.arange(6, dtype=torch.float32)
    stager = ReusableCPUStager()
    first = stager.stage({"model": {"w": weights}, "step": 3})
    weights.add_(100)  # the optimizer keeps training while the staged copy is being written
    assert first["model"]["w"].tolist() == [0, 1, 2, 3, 4, 5] and first["step"] == 3
    second = stager.stage({"model": {"w": weights}, "step": 4})
    assert second["model"]["w"].data_ptr() == first["model"]["w"].data_ptr()  # no new allocation
    assert second["model"]["w"].tolist() == [100, 101, 102, 103, 104, 105]
    # A different structure (optimizer state appeared) gets fresh buffers instead of failing.
    third = stager.stage({"model": {"w": weights}, "optim": {"m": torch.ones(2)}, "step": 5})
    assert third["optim"]["m"].tolist() == [1, 1] and third["model"]["w"][0] == 100


def test_the_operators_mlflow_run_wins_over_the_one_a_checkpoint_names() -> None:
    from loom.workloads.trainer.tracking import choose_run_id

    # A job re-created under an earlier job's checkpoint URI resumes that checkpoint, but logs into its own run.
    assert choose_run_id("run-of-this-job", "run-of-an-earlier-job") == "run-of-this-job"
    # Without an operator (no run given), a resumed run continues the run its checkpoint names.
    assert choose_run_id(None, "run-from-checkpoint") == "run-from-checkpoint"
    assert choose_run_id(None, None) is None
