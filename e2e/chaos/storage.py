"""Storage faults against the real trainer (torchrun, 2 CPU ranks) and real S3 / MLflow servers, no cluster:

- `kill_during_upload`: a rank SIGKILLed at a random offset after a checkpoint started (its upload and, on rank 0,
  its commit in flight), repeatedly in one run (torchrun restarts the gang each time). Each restart must resume from
  a complete checkpoint, the one being written or the one before (never more than one interval lost), and continue
  the exact loss curve (a torn checkpoint would not).
- `s3_outage`: S3 unreachable for a while (a proxy in front of it resets every connection) right after a checkpoint
  started: training keeps stepping, the upload is retried and rank 0's progress document says so (what the
  operator turns into CheckpointStorage=False UploadRetrying), a checkpoint lands after S3 returns and clears
  it, no restart.
- `mlflow_outage`: the MLflow server unreachable for longer than the client's retries: training keeps stepping and
  the metrics logged meanwhile reach MLflow once it returns.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from loom.devstack.servers import MLflowEndpoint, S3Endpoint, mlflow_server, s3_server
from loom.e2e.trainer_harness import TrainerRun, make_config, torchrun_argv, trainer_env

from .faultproxy import fault_proxy
from .registry import Figures, Run, scenario


def _rank_pid(parent: int, rank: int) -> int | None:
    for child in psutil.Process(parent).children(recursive=True):
        try:
            if f"RANK={rank}" in Path(f"/proc/{child.pid}/environ").read_text().split("\0"):
                return child.pid
        except (OSError, psutil.Error):
            continue
    return None


def run_live(config: dict[str, Any], workdir: Path, env: dict[str, str], on_event: Callable[[dict[str, Any],
             subprocess.Popen[str]], None], max_restarts: int = 0, timeout_s: float = 600) -> TrainerRun:
    """torchrun with 2 ranks; `on_event` sees every structured event as it is printed (on the reader thread)."""
    path = workdir / f"config-{time.monotonic_ns()}.json"
    path.write_text(json.dumps(config))
    process = subprocess.Popen(torchrun_argv(path, nproc=2, max_restarts=max_restarts), env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            start = line.find('{"event"')
            if start >= 0:
                try:
                    event = json.loads(line[start:])
                except json.JSONDecodeError:
                    continue
                on_event(event, process)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        process.wait(timeout=timeout_s)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
        reader.join(timeout=30)
    run = TrainerRun(process.returncode, "".join(lines))
    (workdir / f"torchrun-{time.monotonic_ns()}.log").write_text(run.output)
    return run


def segments(run: TrainerRun) -> list[TrainerRun]:
    """The output split at each gang (re)start: one TrainerRun per attempt."""
    parts = run.output.split('{"event": "start"')
    return [TrainerRun(0, '{"event": "start"' + part) for part in parts[1:]]


# ---- a rank killed while its checkpoint uploads ------------------------------------------------------------------

def kill_during_upload(s3: S3Endpoint, bucket: str, workdir: Path, kills: int, seed: int | None = None,
                       every: int = 10, max_offset_s: float = 0.6) -> Figures:
    rng = random.Random(seed)
    config = make_config(workdir, f"s3://{bucket}/killed", training={"maxSteps": every * (2 * kills + 3)},
                         checkpoint={"everySteps": every, "keepLast": 3})
    planned: list[dict[str, Any]] = []
    armed = threading.Event()

    def on_event(event: dict[str, Any], process: subprocess.Popen[str]) -> None:
        if event["event"] == "start":
            armed.set()  # one kill per gang attempt: the restarted gang must first resume and checkpoint again
        elif event["event"] == "checkpoint" and not event.get("final") and armed.is_set() and len(planned) < kills:
            armed.clear()
            kill = {"checkpoint": event["step"], "rank": rng.choice([0, 1]), "offset_s": rng.uniform(0, max_offset_s)}
            planned.append(kill)

            def fire() -> None:
                pid = _rank_pid(process.pid, kill["rank"])
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    kill["killed"] = True

            threading.Timer(kill["offset_s"], fire).start()

    # Each kill costs a gang restart (new processes, torch imported again): about 30 s on a loaded machine.
    run = run_live(config, workdir, trainer_env(s3), on_event, max_restarts=kills, timeout_s=max(600, 60 * kills))
    problems: list[str] = [] if run.returncode == 0 else [f"torchrun exited {run.returncode}: {run.output[-3000:]}"]
    attempts = segments(run)
    killed = [k for k in planned if k.get("killed")]
    resumed_from: list[int] = []
    lost: list[int] = []
    for index, kill in enumerate(killed):
        if index + 1 >= len(attempts):
            problems.append(f"no restart after kill {kill}")
            break
        before, after = attempts[index], attempts[index + 1]
        resume = after.of("resume")
        step = resume[0]["step"] if resume else 0
        resumed_from.append(step)
        committed_before = {e["step"] for attempt in attempts[: index + 1] for e in attempt.of("committed")}
        reached = max(before.losses(), default=0)
        lost.append(reached - step)
        if step not in committed_before | {0}:
            problems.append(f"kill {kill}: resumed from {step}, never committed before the kill")
        if step < kill["checkpoint"] - every:
            problems.append(f"kill {kill}: resumed from {step}, more than one interval before {kill['checkpoint']}")
        # A torn or mixed checkpoint would not continue the curve: the same steps give the same losses.
        previous = before.losses()
        for s, loss in after.losses().items():
            if s in previous and abs(previous[s] - loss) > 1e-4:
                problems.append(f"kill {kill}: step {s} loss {loss} after resume, {previous[s]} before")
                break
    final = run.of("committed")
    if run.returncode == 0 and (not final or final[-1]["step"] != config["training"]["maxSteps"]):
        problems.append(f"no final checkpoint: {final[-1:]}")
    return {
        "kills": len(killed),
        "killed_rank0": sum(1 for k in killed if k["rank"] == 0),
        "resumed_from_checkpoint_being_written": sum(1 for k, r in zip(killed, resumed_from, strict=False)
                                                     if r == k["checkpoint"]),
        "resumed_from_previous_checkpoint": sum(1 for k, r in zip(killed, resumed_from, strict=False)
                                                if r == k["checkpoint"] - every),
        "max_steps_lost": max(lost, default=0),
        "checkpoint_interval": every,
        "problems": problems,
    }


# ---- S3 unreachable for a while ----------------------------------------------------------------------------------

def _host_port(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/")[0])


def s3_outage(s3: S3Endpoint, bucket: str, workdir: Path, down_s: float, every: int = 10, max_steps: int = 80
              ) -> Figures:
    """Down right after the first checkpoint starts, for `down_s`; the run goes on to `max_steps`."""
    with fault_proxy(_host_port(s3.url)) as proxy:
        config = make_config(workdir, f"s3://{bucket}/outage", training={"maxSteps": max_steps},
                             checkpoint={"everySteps": every, "keepLast": 2, "endpoint": proxy.url})
        env = {**trainer_env(s3), "AWS_ENDPOINT_URL_S3": proxy.url}
        state: dict[str, Any] = {}
        steps_while_down: list[int] = []
        progress_file = Path(config["progress"]["file"])
        # What the operator would read from rank 0 while S3 is down, and right after the next commit.
        retries_reported: list[dict[str, Any]] = []

        def reported_retry() -> dict[str, Any] | None:
            try:
                retry = json.loads(progress_file.read_text()).get("checkpointRetry")
            except (OSError, ValueError):
                return None
            return retry if isinstance(retry, dict) else None

        def on_event(event: dict[str, Any], process: subprocess.Popen[str]) -> None:
            kind = event["event"]
            if kind == "checkpoint" and "down_at" not in state:
                proxy.set_down(True)
                state["down_at"], state["down_step"] = time.monotonic(), event["step"]
                threading.Timer(down_s, lambda: (proxy.set_down(False), state.update(up_at=time.monotonic()))).start()
            elif kind == "step" and "down_at" in state and "up_at" not in state:
                steps_while_down.append(event["step"])
                retry = reported_retry()
                if retry is not None:
                    retries_reported.append(retry)
            elif kind == "committed" and "up_at" in state and "first_commit_after" not in state:
                state["first_commit_after"] = event["step"]
                state["commit_delay_s"] = round(time.monotonic() - state["up_at"], 2)
                state["retry_after_commit"] = reported_retry()

        run = run_live(config, workdir, env, on_event, timeout_s=300)
    problems = [] if run.returncode == 0 else [f"torchrun exited {run.returncode}: {run.output[-3000:]}"]
    if len(run.of("start")) != 1:
        problems.append(f"the gang restarted {len(run.of('start')) - 1} times")
    if "first_commit_after" not in state:
        problems.append("no checkpoint committed after S3 returned")
    if not steps_while_down:
        problems.append("training did not step while S3 was down")
    if not retries_reported:
        problems.append("the trainer never reported the checkpoint upload being retried while S3 was down")
    elif any(r.get("step") != state.get("down_step") or not r.get("lastError") for r in retries_reported):
        problems.append(f"retries reported for the wrong step or without an error: {retries_reported[-1]}")
    if "first_commit_after" in state and state.get("retry_after_commit") is not None:
        problems.append(f"still reported as retrying after a commit: {state['retry_after_commit']}")
    retry_events = run.of("checkpointRetry")
    return {
        "down_s": down_s,
        "down_at_step": state.get("down_step"),
        "steps_while_down": len(steps_while_down),
        "connections_reset": proxy.refused,
        "first_commit_after_s3_returned": state.get("first_commit_after"),
        "commit_after_return_s": state.get("commit_delay_s"),
        "failed_checkpoints": len(re.findall(r"checkpoint step \d+ failed", run.output)),
        "failed_attempts_reported": max((r["failedAttempts"] for r in retries_reported), default=0),
        "last_error_reported": retries_reported[-1].get("lastError") if retries_reported else None,
        "retry_events": len(retry_events),
        "problems": problems,
    }


# ---- MLflow unreachable for a while ------------------------------------------------------------------------------

def mlflow_outage(s3: S3Endpoint, mlflow: MLflowEndpoint, bucket: str, workdir: Path, down_s: float,
                  max_steps: int = 200) -> Figures:
    """Down from step 10 for `down_s` (longer than the client's retries, which are shortened here)."""
    from mlflow.tracking import MlflowClient

    experiment = f"chaos-{bucket}"
    with fault_proxy(_host_port(mlflow.url)) as proxy:
        config = make_config(workdir, f"s3://{bucket}/tracked", training={"maxSteps": max_steps},
                             checkpoint={"everySteps": 50, "keepLast": 1},
                             tracking={"mlflow": {"trackingUri": proxy.url, "experiment": experiment,
                                                  "logModel": False}})
        # A short retry budget: an outage longer than it is what this is about, and it keeps the scenario quick.
        env = {**trainer_env(s3), "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "0",
               "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}
        state: dict[str, Any] = {}
        steps_while_down: list[int] = []

        def on_event(event: dict[str, Any], process: subprocess.Popen[str]) -> None:
            if event["event"] != "step":
                return
            if event["step"] >= 10 and "down_at" not in state:
                proxy.set_down(True)
                state["down_at"] = time.monotonic()
                threading.Timer(down_s, lambda: (proxy.set_down(False), state.update(up=True))).start()
            elif "down_at" in state and "up" not in state:
                steps_while_down.append(event["step"])

        run = run_live(config, workdir, env, on_event, timeout_s=300)
    problems = [] if run.returncode == 0 else [f"torchrun exited {run.returncode}: {run.output[-3000:]}"]
    if not steps_while_down:
        problems.append("training did not step while MLflow was down")
    client = MlflowClient(tracking_uri=mlflow.url)
    found = client.get_experiment_by_name(experiment)
    logged: set[int] = set()
    if found is not None:
        for tracked in client.search_runs([found.experiment_id]):
            logged |= {m.step for m in client.get_metric_history(tracked.info.run_id, "loss")}
    missing = sorted(set(range(1, max_steps + 1)) - logged)
    if missing:
        problems.append(f"loss of {len(missing)} steps never reached MLflow: {missing[:10]}...")
    return {"down_s": down_s, "steps_while_down": len(steps_while_down), "connections_reset": proxy.refused,
            "steps_logged": len(logged), "problems": problems}


# ---- the report's versions (their own S3 and MLflow servers) -----------------------------------------------------

def _bucket(s3: S3Endpoint, name: str) -> str:
    bucket = f"{name}-{time.monotonic_ns() % 10**8}"
    s3.client().create_bucket(Bucket=bucket)
    return bucket


@scenario("rank-killed-during-upload", "a rank SIGKILLed at random offsets while its checkpoint uploads (trainer)")
def rank_killed_during_upload(run: Run) -> Figures:
    with s3_server(run.workdir / "s3") as s3:
        return kill_during_upload(s3, _bucket(s3, "killed"), run.workdir, kills=2 if run.scale == "test" else 20)


@scenario("s3-outage", "S3 unreachable for a while during training (trainer)")
def s3_down(run: Run) -> Figures:
    with s3_server(run.workdir / "s3") as s3:
        return s3_outage(s3, _bucket(s3, "outage"), run.workdir, down_s=5 if run.scale == "test" else 20)


@scenario("mlflow-outage", "MLflow unreachable for a while during training (trainer)")
def mlflow_down(run: Run) -> Figures:
    with s3_server(run.workdir / "s3") as s3, mlflow_server(run.workdir / "mlflow", s3=s3) as mlflow:
        return mlflow_outage(s3, mlflow, _bucket(s3, "tracked"), run.workdir, down_s=5 if run.scale == "test" else 20)
