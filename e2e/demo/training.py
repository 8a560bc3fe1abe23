"""Part 3: examples/trainingjob-fsdp-chargpt.yaml trains on 2 FSDP workers; the demo SIGKILLs one worker's trainer
mid-run (as a crash or an OOM kill would) and the job resumes from its newest S3 checkpoint. The progress bar is
the TrainingJob's status (step/total, loss, throughput, ETA, restarts), read every second."""

from __future__ import annotations

import contextlib
import json
import signal
import time
from typing import Any

import psutil

from loom.devstack.cluster.paths import AGENT_STATE_DIR

from .mlflow_run import kill_mark, resumes, run_tags
from .stage import Demo, Outcome, example
from .ui import TrainingView

FILE = "trainingjob-fsdp-chargpt.yaml"
KILL_AT_CHECKPOINT = 60  # the step of the checkpoint that must exist before a worker is killed
TIMEOUT_S = 1200


def clear_checkpoints(demo: Demo, uri: str) -> None:
    """A new TrainingJob resumes from the newest checkpoint under its URI, also one a previous demo left: start
    from nothing there, as on a fresh `loom dev up`."""
    assert demo.services is not None
    bucket, prefix = uri.removeprefix("s3://").split("/", 1)
    s3 = demo.services.s3_client()
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        for item in page.get("Contents", []):
            s3.delete_object(Bucket=bucket, Key=item["Key"])


def kill_worker(demo: Demo, pod_name: str) -> bool:
    """SIGKILL the trainer processes of one worker pod (the node agent runs them as local processes)."""
    pod = demo.get("pod", pod_name)
    if not pod:
        return False
    pid_file = AGENT_STATE_DIR / "pods" / pod["metadata"]["uid"] / "c" / "trainer" / "pid"
    try:
        main = psutil.Process(int(pid_file.read_text()))
        victims = [main, *main.children(recursive=True)]
    except (OSError, ValueError, psutil.Error):
        return False
    for proc in victims:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(signal.SIGKILL)
    return True


def last_logged_step(log: str) -> int | None:
    """The step of the trainer's last `{"event": "step", ...}` line: rank 0's structured stdout (the trainer's
    duties.emit), which it prints as each logged step ends; None when the log has none."""
    last = None
    for line in log.splitlines():
        if '"step"' not in line:
            continue
        with contextlib.suppress(ValueError):
            event = json.loads(line[line.index("{") :])
            if isinstance(event, dict) and event.get("event") == "step" and isinstance(event.get("step"), int):
                last = event["step"]
    return last


def death_step(logged_before: int | None, logged_after: int | None, checkpoint: int, status_step: int) -> int:
    """The step the killed worker died at: the trainer's last logged step, read from rank 0's log just after the
    kill (rank 0 cannot finish a step without the killed rank: FSDP's collectives wait on it) and just before it
    (the later of the two: after the kill the pod may be gone, or already a new attempt's). Never below the newest
    checkpoint reported, which the trainer had passed. The status's step is the last resort only: it is a progress
    poll old (up to a training poll behind the trainer; the demo of #52 said "killed at step 81" with the step-90
    checkpoint already written)."""
    logged = [step for step in (logged_before, logged_after) if step is not None]
    return max(max(logged) if logged else status_step, checkpoint)


def rank0_log(demo: Demo, job: str) -> str:
    result = demo.kubectl("logs", f"{job}-worker-0", "-n", demo.namespace, "-c", "trainer", check=False)
    return str(result.stdout or "") if result.returncode == 0 else ""


def view(status: dict[str, Any]) -> TrainingView:
    progress = status.get("progress") or {}
    return TrainingView(
        phase=status.get("phase") or "Pending",
        step=progress.get("step") or 0,
        total=progress.get("totalSteps") or 0,
        loss=progress.get("loss"),
        throughput=progress.get("samplesPerSecond"),
        eta=progress.get("eta"),
        restarts=status.get("restarts") or 0,
    )


def run(demo: Demo) -> Outcome:
    (doc,) = example(FILE)
    name, spec = doc["metadata"]["name"], doc["spec"]
    clear_checkpoints(demo, spec["checkpoint"]["uri"])
    demo.apply_file(FILE)
    demo.ui.info(
        f"kubectl apply -f examples/{FILE}: {spec['workers']['replicas']} {spec['engine'].upper()} workers, "
        f"{spec['maxSteps']} steps, checkpoint every {spec['checkpoint']['everySteps']} to {spec['checkpoint']['uri']}"
    )
    killed_at: float | None = None
    kill_step = 0
    recovered_s: float | None = None
    restarted = False
    started = time.monotonic()
    status: dict[str, Any] = {}
    with demo.ui.training(name) as bar:
        while time.monotonic() - started < TIMEOUT_S:
            status = demo.get("trainingjob", name).get("status") or {}
            current = view(status)
            bar.update(current)
            if current.phase in ("Succeeded", "Failed"):
                break
            checkpoint = (status.get("checkpoint") or {}).get("step") or 0
            if killed_at is None and checkpoint >= KILL_AT_CHECKPOINT:
                before = last_logged_step(rank0_log(demo, name))
                if kill_worker(demo, f"{name}-worker-1"):
                    killed_at = time.monotonic()
                    time.sleep(2)  # rank 0 ends the step it is in, if it can, then waits on the dead rank
                    after = last_logged_step(rank0_log(demo, name))
                    kill_step = death_step(before, after, checkpoint, current.step)
                    bar.note(
                        f"[kill] SIGKILL to the trainer of {name}-worker-1 at step {kill_step} (the trainer's last "
                        f"logged step; status said {current.step}, newest checkpoint reported: step {checkpoint})"
                    )
            elif killed_at is not None and current.restarts > 0:
                restarted = True
            if (
                restarted
                and killed_at is not None
                and recovered_s is None
                and current.phase == "Running"
                and current.step > kill_step
            ):
                recovered_s = time.monotonic() - killed_at
                bar.note(
                    f"[resumed] restart {current.restarts}: training again past step {kill_step} "
                    f"{recovered_s:.0f}s after the kill"
                )
            time.sleep(1)
    if status.get("phase") != "Succeeded":
        raise RuntimeError(f"TrainingJob {name} ended {status.get('phase')}: {status.get('conditions')}")
    final = view(status)
    final.loss = final.loss if final.loss is not None else float("nan")
    mlflow = status.get("mlflow") or {}
    run_id = mlflow.get("runId")
    demo.facts.update(
        training=name,
        run_id=run_id,
        run_url=mlflow.get("url"),
        kill_step=kill_step,
        checkpoint=(status.get("checkpoint") or {}).get("latest"),
    )
    # The step each restart went on from, as the trainer recorded it in the run (its loom.resume.<n> tags).
    assert demo.services is not None
    tagged = resumes(run_tags(demo.services.mlflow_url, run_id)) if run_id else []
    resumed = " and ".join(f"step-{r.step}" for r in tagged) or "no recorded"
    kill_step = kill_mark(kill_step, tagged)
    demo.facts["kill_step"] = kill_step
    recovered = f"{recovered_s:.0f}s" if recovered_s is not None else "?"
    return Outcome(
        f"TrainingJob {name} Succeeded: {final.step} steps, final loss {final.loss:.3f}, {final.restarts} restart "
        f"(worker killed at step {kill_step}, resumed from the {resumed} checkpoint per the MLflow run)",
        f"loss {final.loss:.2f}, back {recovered} after the kill",
    )
