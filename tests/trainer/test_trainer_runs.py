"""The real launcher under torchrun (2 CPU ranks, gloo) against a real S3 server and a real MLflow server."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil
import pytest

from loom.devstack.servers import MLflowEndpoint, S3Endpoint, free_port
from loom.e2e.trainer_harness import TrainerRun, make_config, torchrun_argv, trainer_env
from loom.workloads.common.s3 import S3Location, download_tree, list_keys
from loom.workloads.trainer.checkpoint.manifest import Manifest

# Each test trains real ranks for tens of seconds: the quick tier (`make test-quick`) leaves them out.
pytestmark = pytest.mark.slow

INITIAL_LOSS = math.log(96)  # uniform guess over the example's vocabulary


def complete(s3: S3Endpoint, bucket: str, prefix: str) -> list[int]:
    keys = [k for k, _ in list_keys(s3.client(), S3Location(bucket, prefix))]
    return sorted(int(k.split("/")[-2].removeprefix("step-")) for k in keys if k.endswith("/manifest.json")
                  and "/step-" in k)


def manifest(s3: S3Endpoint, bucket: str, prefix: str, step: int) -> Manifest:
    body = s3.client().get_object(Bucket=bucket, Key=f"{prefix}/step-{step:09d}/manifest.json")["Body"].read()
    return Manifest.model_validate_json(body)


def test_fsdp_two_ranks_checkpoints_tracks_and_resumes_at_world_size_one(
    run_trainer: Callable[..., TrainerRun], s3: S3Endpoint, mlflow: MLflowEndpoint, bucket: str, tmp_path: Path
) -> None:
    config = make_config(tmp_path, f"s3://{bucket}/fsdp", tracking={
        "mlflow": {"trackingUri": mlflow.url, "experiment": "trainer-tests"}})
    first = run_trainer(config, nproc=2)

    losses = first.losses()
    assert sorted(losses) == list(range(1, 13))
    assert losses[12] < INITIAL_LOSS - 0.7, losses  # it learns
    # Checkpoints at 4, 8 and the final one at 12; keepLast=2 removed 4.
    assert [e["step"] for e in first.of("committed")] == [4, 8, 12]
    assert complete(s3, bucket, "fsdp") == [8, 12]
    saved = manifest(s3, bucket, "fsdp", 12)
    names = {f.path for f in saved.files}
    # Every rank wrote its own shard and RNG state; rank 0 the metadata and trainer state.
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "rng-00000.pt", "rng-00001.pt",
            "trainer_state.pt"} <= names
    assert saved.world_size == 2

    progress = json.loads((tmp_path / "progress.json").read_text())
    assert progress["phase"] == "Succeeded" and progress["step"] == progress["totalSteps"] == 12
    assert progress["latestCheckpoint"]["uri"] == f"s3://{bucket}/fsdp/step-000000012"
    assert progress["latestCheckpoint"]["step"] == 12
    assert progress["loss"] == pytest.approx(losses[12], abs=1e-5)

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow.url)
    experiment = client.get_experiment_by_name("trainer-tests")
    (run,) = client.search_runs([experiment.experiment_id])
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss")}
    assert sorted(history) == list(range(1, 13))
    assert history[12] == pytest.approx(losses[12], abs=1e-5)
    assert run.data.params["engine"] == "fsdp"
    assert run.data.tags["loom.checkpoint.latest"] == f"s3://{bucket}/fsdp/step-000000012"
    assert {a.path for a in client.list_artifacts(run.info.run_id, "model")} == {"model/config.json",
                                                                                 "model/model.pt"}

    # The exported model is what the model server loads.
    from loom.workloads.trainer.examples.chargpt import generate, load_for_inference

    download_tree(s3.client(), S3Location(bucket, "fsdp/final"), tmp_path / "final")
    model = load_for_inference(tmp_path / "final")
    assert len(generate(model, "Tom", max_new_tokens=8, temperature=0)) == 8

    # Same checkpoint, half the ranks: DCP reshards the FSDP state on load.
    config["training"]["maxSteps"] = 14
    second = run_trainer(config, nproc=1)
    assert second.of("resume")[0]["step"] == 12 and second.of("resume")[0]["worldSize"] == 1
    resumed = second.losses()
    assert sorted(resumed) == [13, 14]
    assert resumed[13] < INITIAL_LOSS - 0.6  # trained weights and optimizer state were restored
    # The resumed run logged into the same MLflow run (its id travels in the checkpoint).
    assert len(client.search_runs([experiment.experiment_id])) == 1


def test_torn_checkpoint_is_skipped_and_retention_keeps_exactly_keep_last(
    run_trainer: Callable[..., TrainerRun], s3: S3Endpoint, bucket: str, tmp_path: Path
) -> None:
    config = make_config(tmp_path, f"s3://{bucket}/torn", training={"maxSteps": 8},
                         checkpoint={"everySteps": 2, "keepLast": 3})
    run_trainer(config, nproc=1)
    assert complete(s3, bucket, "torn") == [4, 6, 8]

    # A checkpoint whose shards arrived but whose manifest never did (a rank died mid-upload), newer
    # than everything else: it must be ignored.
    client = s3.client()
    for key, _ in list(list_keys(client, S3Location(bucket, "torn/step-000000008"))):
        if not key.endswith("manifest.json"):
            client.copy_object(Bucket=bucket, Key=key.replace("step-000000008", "step-000000050"),
                               CopySource={"Bucket": bucket, "Key": key})

    config["training"]["maxSteps"] = 12
    resumed = run_trainer(config, nproc=1)
    assert resumed.of("resume")[0]["step"] == 8
    assert sorted(resumed.losses()) == [9, 10, 11, 12]
    assert complete(s3, bucket, "torn") == [8, 10, 12]  # exactly keepLast=3, the newest ones
    # Retention never touches what is not complete: the torn leftovers are still there.
    assert any("step-000000050" in k for k, _ in list_keys(client, S3Location(bucket, "torn")))


def _worker_with_rank(parent: psutil.Process, rank: int) -> psutil.Process | None:
    for child in parent.children(recursive=True):
        try:
            if f"RANK={rank}" in Path(f"/proc/{child.pid}/environ").read_text().split("\0"):
                return child
        except (OSError, psutil.Error):
            continue
    return None


def test_sigkill_of_one_rank_is_recovered_by_elastic_restart_from_the_last_complete_checkpoint(
    s3: S3Endpoint, bucket: str, tmp_path: Path
) -> None:
    config = make_config(tmp_path, f"s3://{bucket}/chaos", training={"maxSteps": 120},
                         checkpoint={"everySteps": 10, "keepLast": 2})
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    process = subprocess.Popen(torchrun_argv(path, nproc=2, max_restarts=1), env=trainer_env(s3),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    killed_at: dict[str, int] = {}

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            if not killed_at and '"event": "committed"' in line and json.loads(line)["step"] >= 20:
                victim = _worker_with_rank(psutil.Process(process.pid), 1)
                assert victim is not None
                killed_at["lines"] = len(lines)
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
    assert run.returncode == 0, f"see {tmp_path / 'torchrun.log'}: {run.output[-3000:]}"
    assert killed_at, "the run finished before a rank could be killed"

    before = TrainerRun(0, "".join(lines[: killed_at["lines"]]))
    starts = run.of("start")
    assert [s["restart"] for s in starts] == [0, 1]  # torchrun restarted the worker group once
    resume = run.of("resume")[0]
    committed_before_restart = [e["step"] for e in TrainerRun(0, run.output.split('"restart": 1')[0]).of("committed")]
    assert resume["step"] == max(committed_before_restart) >= 20

    after_restart = run.output.split('"restart": 1')[1]
    steps_after = [e["step"] for e in TrainerRun(0, after_restart).of("step")]
    assert steps_after[0] == resume["step"] + 1 and steps_after[-1] == 120
    # Same data position, weights, optimizer and RNG: the curve continues exactly where it was.
    pre_kill = {e["step"]: e["loss"] for e in TrainerRun(0, run.output.split('"restart": 1')[0]).of("step")}
    post = TrainerRun(0, after_restart).losses()
    overlap = [s for s in post if s in pre_kill]
    assert overlap, "no step ran both before the kill and after the restart"
    for step in overlap:
        assert post[step] == pytest.approx(pre_kill[step], abs=1e-4), step
    assert post[resume["step"] + 1] < INITIAL_LOSS - 0.7
    assert before.of("committed")
    assert complete(s3, bucket, "chaos")[-1] == 120


@pytest.mark.parametrize("zero_stage", [2])
def test_deepspeed_two_ranks_then_resume_at_world_size_one_with_zero3(
    run_trainer: Callable[..., TrainerRun], s3: S3Endpoint, bucket: str, tmp_path: Path, zero_stage: int
) -> None:
    config = make_config(tmp_path, f"s3://{bucket}/ds", engine="deepspeed",
                         deepspeed={"zeroStage": zero_stage}, training={"maxSteps": 8})
    first = run_trainer(config, nproc=2)
    losses = first.losses()
    assert sorted(losses) == list(range(1, 9)) and losses[8] < INITIAL_LOSS - 0.5
    assert complete(s3, bucket, "ds") == [4, 8]
    names = {f.path for f in manifest(s3, bucket, "ds", 8).files}
    # Full logical tensors are de-duplicated by DCP: both ranks wrote a share.
    assert {"__0_0.distcp", "__1_0.distcp"} <= names

    # World size 2 -> 1 and ZeRO-2 -> ZeRO-3: the DCP layout does not depend on either.
    config["deepspeed"] = {"zeroStage": 3}
    config["training"]["maxSteps"] = 10
    second = run_trainer(config, nproc=1)
    assert second.of("resume")[0]["step"] == 8
    resumed = second.losses()
    assert sorted(resumed) == [9, 10]
    assert resumed[9] < INITIAL_LOSS - 0.5, resumed
    assert abs(resumed[9] - losses[8]) < 0.3


def test_sigterm_writes_a_final_checkpoint_and_exits_cleanly(s3: S3Endpoint, bucket: str, tmp_path: Path) -> None:
    port = free_port()
    config = make_config(tmp_path, f"s3://{bucket}/term", training={"maxSteps": 100000},
                         checkpoint={"everySteps": 10, "keepLast": 1},
                         progress={"file": str(tmp_path / "progress.json"), "metricsPort": port})
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    termination_log = tmp_path / "termination-log"
    env = {**trainer_env(s3), "LOOM_TERMINATION_LOG": str(termination_log)}
    process = subprocess.Popen(torchrun_argv(path, nproc=2), env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    assert process.stdout is not None
    committed = 0
    for line in process.stdout:
        lines.append(line)
        if '"event": "committed"' in line:
            committed = json.loads(line)["step"]
        if committed and '"event": "step"' in line:
            # Rank 0 serves the operator's progress document and Prometheus metrics while training.
            live = httpx.get(f"http://127.0.0.1:{port}/progress", timeout=5).json()
            assert live["totalSteps"] == 100000 and live["step"] > committed and live["phase"] == "Running"
            latest = live["latestCheckpoint"]["step"]
            assert latest >= committed and latest % 10 == 0
            assert live["latestCheckpoint"]["uri"] == f"s3://{bucket}/term/step-{latest:09d}"
            metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
            assert "loom_trainer_total_steps 100000.0" in metrics and "loom_trainer_checkpoint_step " in metrics
            # What the kubelet does on pod deletion / preemption: SIGTERM to the container's main process.
            process.send_signal(signal.SIGTERM)
            break
    lines.extend(process.stdout)
    process.wait(timeout=120)
    run = TrainerRun(process.returncode, "".join(lines))
    (interrupted,) = run.of("interrupted")
    stopped_at = interrupted["step"]
    assert stopped_at > committed
    # The final checkpoint is at the step where training stopped, committed before exit.
    assert run.of("committed")[-1]["step"] == stopped_at
    assert complete(s3, bucket, "term") == [stopped_at]
    progress = json.loads((tmp_path / "progress.json").read_text())
    assert progress["phase"] == "Interrupted" and progress["latestCheckpoint"]["step"] == stopped_at
    assert not run.of("done")
    # torchrun itself exits 1 here: its elastic agent re-raises the SIGTERM once its workers stopped, whatever
    # they returned (torch.distributed.elastic.agent.server.api.SimpleElasticAgent.run). Each rank's termination
    # message is what tells the operator the stop was clean: 143, read as a disruption, never as a failure.
    assert json.loads(termination_log.read_text())["exitCode"] == 143


def test_deepspeed_zero3_offload_bf16_resume_continues_the_exact_loss_curve(
    run_trainer: Callable[..., TrainerRun], bucket: str, tmp_path: Path
) -> None:
    config = make_config(tmp_path, f"s3://{bucket}/straight", engine="deepspeed",
                         deepspeed={"zeroStage": 3, "offload": "cpu", "bf16": True}, training={"maxSteps": 8})
    straight = run_trainer(config, nproc=2).losses()

    # Same job restarted from the step-4 checkpoint of the first run (explicit URI, another prefix).
    config["checkpoint"] = {**config["checkpoint"], "uri": f"s3://{bucket}/resumed",
                            "resume": f"s3://{bucket}/straight/step-000000004"}
    resumed_run = run_trainer(config, nproc=2)
    assert resumed_run.of("resume")[0]["step"] == 4
    resumed = resumed_run.losses()
    assert sorted(resumed) == [5, 6, 7, 8]
    for step in resumed:
        assert resumed[step] == pytest.approx(straight[step], abs=2e-3), (step, resumed, straight)


def test_a_gang_restarted_after_its_final_checkpoint_names_that_checkpoint_on_exit(
    run_trainer: Callable[..., TrainerRun], s3: S3Endpoint, bucket: str, tmp_path: Path
) -> None:
    """Issue 17: a gang lost after its final checkpoint committed (here SIGKILLed on that commit) is restarted
    from that checkpoint; the new gang has nothing left to train or save, and its exit-0 message must still
    name the final checkpoint, or the job reports the last one its progress showed."""
    config = make_config(tmp_path, f"s3://{bucket}/again", training={"maxSteps": 4}, checkpoint={"everySteps": 2})
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    first = subprocess.Popen(torchrun_argv(path, nproc=1), env=trainer_env(s3), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    assert first.stdout is not None
    for line in first.stdout:
        if '"event": "committed"' in line and json.loads(line)["step"] == 4:
            for process in [*psutil.Process(first.pid).children(recursive=True), psutil.Process(first.pid)]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.kill()
            break
    first.wait(timeout=60)
    assert complete(s3, bucket, "again") == [2, 4]

    # The replacement gang runs in new pods: an empty /tmp, so no progress file from the first gang.
    config["progress"] = {"file": str(tmp_path / "second" / "progress.json")}
    termination_log = tmp_path / "termination-log"
    second = run_trainer(config, nproc=1, env={"LOOM_TERMINATION_LOG": str(termination_log)})
    assert second.of("resume")[0]["step"] == 4
    assert not second.of("step") and not second.of("committed")
    final = {"uri": f"s3://{bucket}/again/step-000000004", "step": 4}
    message = json.loads(termination_log.read_text())
    assert message["exitCode"] == 0
    assert {k: message["checkpoint"][k] for k in ("uri", "step")} == final
    progress = json.loads((tmp_path / "second" / "progress.json").read_text())
    assert progress["phase"] == "Succeeded"
    assert {k: progress["latestCheckpoint"][k] for k in ("uri", "step")} == final
