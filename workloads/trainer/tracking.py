"""What the trainer tells the outside world: a progress file for the operator, Prometheus metrics, MLflow
(params, metrics, checkpoint locations, final model) and the container's termination message."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer
from tenacity import Retrying, retry_if_result, stop_after_delay

from .config import MLflowSpec, ProgressSpec

log = logging.getLogger("loom.trainer")


def write_json_atomically(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as handle:
        json.dump(payload, handle)
    os.replace(temporary, path)


def write_termination_message(exit_code: int, message: str, checkpoint: dict[str, Any] | None = None,
                              final: dict[str, Any] | None = None) -> None:
    """Kubernetes puts this file into the pod status. torchrun exits 1 whatever its workers returned, so the
    JSON {"exitCode", "message"} is how the operator learns that an error is permanent; on success it also
    names the newest committed checkpoint and the last step and loss ({"step", "loss"}), which the last progress
    poll may have missed (a job of a few seconds may never be polled while it runs)."""
    termination_log = os.environ.get("LOOM_TERMINATION_LOG", "/dev/termination-log")
    doc: dict[str, Any] = {"exitCode": exit_code, "message": message[-3000:]}
    if checkpoint:
        doc["checkpoint"] = checkpoint
    if final:
        doc["final"] = final
    with contextlib.suppress(OSError):
        Path(termination_log).write_text(json.dumps(doc))


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def serve_progress(port: int, registry: CollectorRegistry, snapshot: Any) -> ThreadingWSGIServer:
    """Rank 0's endpoint for the operator and Prometheus: GET /progress (JSON), anything else metrics."""
    metrics = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: Any) -> Any:
        if environ.get("PATH_INFO") == "/progress":
            body = json.dumps(snapshot()).encode()
            start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        return metrics(environ, start_response)

    server = make_server("0.0.0.0", port, app, ThreadingWSGIServer, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="loom-progress-http", daemon=True).start()
    return server


class Progress:
    """Progress file (rewritten atomically, read by the operator) and Prometheus gauges."""

    def __init__(self, spec: ProgressSpec, total_steps: int) -> None:
        self.path = Path(spec.file)
        self.total_steps = total_steps
        self.lock = threading.Lock()
        self.state: dict[str, Any] = {"step": 0, "totalSteps": total_steps, "phase": "Starting"}
        self.registry = CollectorRegistry()
        self.g_step = Gauge("loom_trainer_step", "Last completed training step", registry=self.registry)
        self.g_total = Gauge("loom_trainer_total_steps", "Configured number of steps", registry=self.registry)
        self.g_loss = Gauge("loom_trainer_loss", "Training loss at the last step", registry=self.registry)
        self.g_rate = Gauge("loom_trainer_samples_per_second", "Training throughput", registry=self.registry)
        self.g_ckpt = Gauge("loom_trainer_checkpoint_step", "Step of the newest committed checkpoint",
                            registry=self.registry)
        self.c_ckpt = Counter("loom_trainer_checkpoints", "Committed checkpoints", registry=self.registry)
        self.c_ckpt_failed = Counter("loom_trainer_checkpoint_upload_failures",
                                     "Failed S3 attempts of checkpoint uploads (each one retried)",
                                     registry=self.registry)
        self.h_stall = Histogram("loom_trainer_checkpoint_stall_seconds", "Training-loop stall per checkpoint",
                                 registry=self.registry, buckets=(0.001, 0.01, 0.05, 0.1, 0.5, 1, 5, 30))
        self.g_total.set(total_steps)
        self.server = serve_progress(spec.metrics_port, self.registry, self.snapshot) if spec.metrics_port else None
        self._flush()

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return dict(self.state)

    def _flush(self) -> None:
        self.state["updatedAt"] = time.time()
        write_json_atomically(self.path, self.state)

    def update(self, step: int, loss: float, samples_per_second: float, eta_s: float | None, phase: str) -> None:
        with self.lock:
            self.state.update(step=step, loss=loss, samplesPerSecond=samples_per_second, eta=eta_s, phase=phase)
            self._flush()
        self.g_step.set(step)
        self.g_loss.set(loss)
        self.g_rate.set(samples_per_second)

    def checkpoint_committed(self, uri: str, step: int) -> None:
        with self.lock:
            # S3 took a checkpoint again: whatever failed before is over.
            self.state.pop("checkpointRetry", None)
        self._latest_checkpoint(uri, step, time.time())
        self.c_ckpt.inc()

    def checkpoint_failed(self, step: int | None, error: str) -> int:
        """One S3 attempt of a checkpoint failed and is being retried (or the checkpoint gave up and the next one
        will try): shown as `checkpointRetry` until the next commit. Returns the failed attempts so far."""
        with self.lock:
            retry = dict(self.state.get("checkpointRetry") or {"failedAttempts": 0, "since": _utc(time.time())})
            retry["failedAttempts"] += 1
            retry["lastError"] = error
            if step is not None:
                retry["step"] = step
            self.state["checkpointRetry"] = retry
            self._flush()
        self.c_ckpt_failed.inc()
        return int(retry["failedAttempts"])

    def checkpoint_restored(self, uri: str, step: int, committed_at: float) -> None:
        """The checkpoint this run resumed from is the newest committed one until the next commit. A run
        that resumes from its final step commits nothing new, and still has to name it on exit."""
        self._latest_checkpoint(uri, step, committed_at)

    def _latest_checkpoint(self, uri: str, step: int, committed_at: float) -> None:
        with self.lock:
            self.state["latestCheckpoint"] = {"uri": uri, "step": step, "time": _utc(committed_at)}
            self._flush()
        self.g_ckpt.set(step)

    def latest_checkpoint(self) -> dict[str, Any] | None:
        """The newest committed checkpoint ({uri, step, time}), or None before the first one."""
        with self.lock:
            latest = self.state.get("latestCheckpoint")
            return dict(latest) if latest else None

    def stalled(self, seconds: float) -> None:
        self.h_stall.observe(seconds)

    def finish(self, phase: str, message: str | None = None, permanent: bool | None = None) -> None:
        with self.lock:
            self.state["phase"] = phase
            if message:
                self.state["message"] = message
            if permanent is not None:
                self.state["permanentFailure"] = permanent
            self._flush()


def _utc(epoch: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))


def choose_run_id(given: str | None, from_checkpoint: str | None) -> str | None:
    """The run to log into: the one the operator created for this job wins. A checkpoint's run is only a fallback
    (a trainer started without an operator): a job re-created under the same checkpoint URI must not log into,
    or fail on, an earlier job's run, which may be gone."""
    return given or from_checkpoint


class MLflowTracker:
    """MLflow logging through the client API, batched (one request per flush, not per metric).

    Metrics and tags are sent by a background thread, so training never waits on MLflow: while the server is down
    (longer than the client's own retries) they stay queued (at most MAX_PENDING metrics, the oldest dropped and
    counted) and go out once it answers again; `end` says what could not be sent."""

    MAX_PENDING = 100_000
    FLUSH_EVERY_S = 5.0
    FINAL_FLUSH_S = 30.0  # at the end of training, how long an outage may still last without losing anything

    def __init__(self, spec: MLflowSpec, run_id: str | None, run_name: str | None = None) -> None:
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=spec.tracking_uri)
        run_id = choose_run_id(os.environ.get("MLFLOW_RUN_ID") or spec.run_id, run_id)
        if not run_id:
            experiment = self.client.get_experiment_by_name(spec.experiment)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(spec.experiment)
            run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        self.run_id: str = run_id
        self.pending: list[Any] = []
        self.tags: dict[str, str] = {}
        self.lost = 0  # metrics dropped while MLflow was unreachable and the queue full
        self.unreachable_since: float | None = None
        self.lock = threading.Lock()  # the training loop and the checkpoint thread both log
        self.send_lock = threading.Lock()  # one sender at a time: the background thread or a final flush
        self.wake = threading.Event()
        self.stopped = threading.Event()
        self.sender = threading.Thread(target=self._send_forever, name="loom-mlflow", daemon=True)
        self.sender.start()

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        existing = self.client.get_run(self.run_id).data.params
        # Params are immutable in MLflow: after a restart only log what is not there yet.
        fresh = [Param(k, str(v)[:6000]) for k, v in params.items() if k not in existing]
        for start in range(0, len(fresh), 100):
            self.client.log_batch(self.run_id, params=fresh[start : start + 100])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        timestamp = int(time.time() * 1000)
        with self.lock:
            self.pending.extend(Metric(k, float(v), timestamp, step) for k, v in metrics.items())
            if len(self.pending) > self.MAX_PENDING:
                dropped = len(self.pending) - self.MAX_PENDING
                del self.pending[:dropped]
                self.lost += dropped
            full = len(self.pending) >= 200
        if full:
            self.wake.set()

    def _send_forever(self) -> None:
        while not self.stopped.is_set():
            self.wake.wait(self.FLUSH_EVERY_S)
            self.wake.clear()
            if not self.stopped.is_set():
                self.flush()

    def flush(self) -> bool:
        """Send the queued tags and metrics; False (they stay queued) while MLflow cannot be reached."""
        with self.send_lock:
            try:
                while True:
                    with self.lock:
                        tags, self.tags = self.tags, {}
                        batch = self.pending[:1000]
                    for key, value in tags.items():
                        try:
                            self.client.set_tag(self.run_id, key, value)
                        except Exception:
                            with self.lock:
                                self.tags.setdefault(key, value)  # unless a newer value came meanwhile
                            raise
                    if not batch:
                        break
                    self.client.log_batch(self.run_id, metrics=batch)
                    with self.lock:
                        del self.pending[: len(batch)]
            except Exception as error:  # MLflow down or failing: tracking waits, training does not
                if self.unreachable_since is None:
                    self.unreachable_since = time.monotonic()
                    log.warning("MLflow unreachable; metrics stay queued and are sent once it answers: %s", error)
                return False
            if self.unreachable_since is not None:
                log.warning("MLflow reachable again after %.0f s; queued metrics sent",
                            time.monotonic() - self.unreachable_since)
                self.unreachable_since = None
            return True

    def set_tag(self, key: str, value: str) -> None:
        with self.lock:
            self.tags[key] = value
        self.wake.set()

    def log_artifacts(self, folder: Path, artifact_path: str) -> None:
        self.client.log_artifacts(self.run_id, str(folder), artifact_path)

    def end(self, status: str) -> None:
        self.stopped.set()
        self.wake.set()
        self.sender.join(timeout=60)
        sent = self.flush()
        # Training is over, but what it measured is still queued: an outage that outlasts the training gets a
        # bounded while to end, so a short one at the end loses nothing.
        deadline = time.monotonic() + self.FINAL_FLUSH_S
        if not sent:
            log.warning("MLflow unreachable at the end of training; retrying for up to %.0f s", self.FINAL_FLUSH_S)
        if not sent and time.monotonic() < deadline:

            def flush_after_a_second() -> bool:
                time.sleep(1.0)
                return self.flush()

            # Until a flush goes through or the deadline passes; the last flush's result decides.
            retrying = Retrying(
                stop=stop_after_delay(max(0.0, deadline - time.monotonic())),
                retry=retry_if_result(lambda flushed: not flushed),
                retry_error_callback=lambda state: bool(state.outcome is not None and state.outcome.result()),
            )
            sent = bool(retrying(flush_after_a_second))
        with self.lock:
            unsent, lost = len(self.pending) + len(self.tags), self.lost
        if not sent or lost:
            log.error("MLflow tracking incomplete: %d metrics dropped while it was unreachable, %d metrics/tags "
                      "never sent", lost, unsent)
        # A run the operator created is terminated by the operator; ours we close.
        if sent and not os.environ.get("MLFLOW_RUN_ID"):
            self.client.set_terminated(self.run_id, status=status)


def flatten(prefix: str, value: Any) -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(flatten(f"{prefix}.{key}" if prefix else str(key), item))
        return out
    return {prefix: value}
