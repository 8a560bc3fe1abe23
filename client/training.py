"""A TrainingJob seen by the person who runs it: progress, a live bar, worker logs, MLflow metrics, the result."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from loom.operator.api import KINDS, TrainingJob

from .mlflow_rest import MlflowReader, Point, RegisteredVersion, tracking_uri_of
from .waiting import Target

if TYPE_CHECKING:
    from .client import Client

TRAINING_JOB = next(k for k in KINDS if k.model is TrainingJob)
# The labels the operator puts on worker pods (loom.dev/<kind> = name, as on every child; the worker's index).
JOB_LABEL = "loom.dev/trainingjob"
INDEX_LABEL = "loom.dev/worker-index"
FINISHED = ("Succeeded", "Failed")


@dataclass(frozen=True)
class TrainingProgress:
    """Where a TrainingJob stands, from its status."""

    phase: str
    step: int = 0
    total_steps: int | None = None
    loss: float | None = None
    # Samples per second, as the trainer reports it.
    throughput: float | None = None
    eta: str | None = None
    restarts: int = 0

    @property
    def fraction(self) -> float | None:
        return None if not self.total_steps else min(1.0, self.step / self.total_steps)

    @property
    def finished(self) -> bool:
        return self.phase in FINISHED

    @classmethod
    def of(cls, job: TrainingJob) -> TrainingProgress:
        status = job.status
        if status is None:
            return cls(phase="Pending", total_steps=job.spec.max_steps)
        progress = status.progress
        return cls(
            phase=status.phase or "Pending",
            step=(progress.step if progress and progress.step is not None else 0),
            total_steps=(progress.total_steps if progress and progress.total_steps else job.spec.max_steps),
            loss=progress.loss if progress else None,
            throughput=progress.samples_per_second if progress else None,
            eta=progress.eta if progress else None,
            restarts=status.restarts,
        )

    def line(self) -> str:
        total = self.total_steps if self.total_steps is not None else "?"
        loss = f"{self.loss:.4f}" if self.loss is not None else "-"
        speed = f"{self.throughput:,.1f}/s" if self.throughput is not None else "-"
        return (f"{self.phase} step {self.step}/{total} loss {loss} throughput {speed} ETA {self.eta or '-'} "
                f"restarts {self.restarts}")


@dataclass(frozen=True)
class TrainingResult:
    """What a finished TrainingJob produced."""

    phase: str
    # The run's last value of each metric (MLflow), or the status' loss when the job has no MLflow run.
    metrics: dict[str, float]
    # The newest complete checkpoint (status.checkpoint.latest).
    checkpoint_uri: str | None
    checkpoint_step: int | None
    # The exported model (weights + config) the trainer writes on success: <checkpoint.uri>/final.
    model_uri: str | None
    mlflow_run_id: str | None = None
    mlflow_run_url: str | None = None
    # The same model as an MLflow artifact (runs:/<run>/model), when the run has one.
    mlflow_model_uri: str | None = None
    # Model registry versions created from this run, when something registered it.
    registered_versions: list[RegisteredVersion] = field(default_factory=list)


class Training:
    """Helpers for one TrainingJob (Client.training(name))."""

    def __init__(self, client: Client, name: str, namespace: str) -> None:
        self.client = client
        self.name = name
        self.namespace = namespace

    def job(self) -> TrainingJob:
        return self.client.get(TrainingJob, self.name, self.namespace)

    def progress(self) -> TrainingProgress:
        return TrainingProgress.of(self.job())

    def follow(self, timeout: float | None = None) -> Iterator[TrainingProgress]:
        """Progress now and at every change, until the job finishes (or `timeout` seconds pass)."""
        for manifest in self.client.watch_manifests(TRAINING_JOB, self.name, self.namespace, timeout):
            progress = TrainingProgress.of(TrainingJob.model_validate(manifest))
            yield progress
            if progress.finished:
                return

    def wait(self, timeout: float = 3600, *, show: bool = False) -> TrainingJob:
        """Until the job has Succeeded; WaitFailed with its own message if it failed. `show` draws the live bar."""
        if show:
            from .progressbar import ProgressBar

            with ProgressBar(self.name) as bar:
                manifest = self.client.wait_for_manifest(
                    TRAINING_JOB, self.name, Target(condition=None, phase="Succeeded"),
                    namespace=self.namespace, timeout=timeout,
                    on_change=lambda m: bar.update(TrainingProgress.of(TrainingJob.model_validate(m))),
                )
            return TrainingJob.model_validate(manifest)
        return self.client.wait_for(TrainingJob, self.name, phase="Succeeded", timeout=timeout,
                                    namespace=self.namespace)

    def show(self, timeout: float | None = None) -> TrainingProgress:
        """Draw a live progress bar (terminal or notebook) until the job finishes; returns the last progress."""
        from .progressbar import ProgressBar

        last = self.progress()
        with ProgressBar(self.name) as bar:
            for progress in self.follow(timeout):
                bar.update(progress)
                last = progress
        return last

    # ------------------------------------------------------------------------------------------- logs

    def worker_pods(self) -> dict[int, str]:
        """Worker index -> the newest pod of that worker (a restarted gang has newer pods)."""
        listed = self.client.connection.call(
            "GET", f"/api/v1/namespaces/{self.namespace}/pods", query=[("labelSelector", f"{JOB_LABEL}={self.name}")]
        ).get("items", [])
        newest: dict[int, dict[str, Any]] = {}
        for pod in listed:
            index = (pod["metadata"].get("labels") or {}).get(INDEX_LABEL)
            if index is None or not str(index).isdigit():
                continue
            current = newest.get(int(index))
            stamp = pod["metadata"].get("creationTimestamp", "")
            if current is None or stamp > current["metadata"].get("creationTimestamp", ""):
                newest[int(index)] = pod
        return {i: p["metadata"]["name"] for i, p in sorted(newest.items())}

    def logs(self, worker: int = 0, *, follow: bool = False, tail: int | None = None) -> Iterator[str]:
        """Lines of one worker's log (worker 0 is rank 0: progress events and errors); `follow` streams new lines
        until the worker's container ends."""
        pods = self.worker_pods()
        if worker not in pods:
            have = ", ".join(map(str, pods)) or "none yet"
            raise LookupError(f"TrainingJob {self.name} has no worker {worker} pod (workers: {have})")
        path = f"/api/v1/namespaces/{self.namespace}/pods/{pods[worker]}/log"
        query: list[tuple[str, Any]] = [("tailLines", str(tail))] if tail is not None else []
        if follow:
            for line in self.client.connection.stream_lines(path, [*query, ("follow", "true")]):
                yield line.decode(errors="replace")
            return
        yield from self.client.connection.text(path, query).splitlines()

    # ------------------------------------------------------------------------------------------- MLflow

    def _tracking(self, job: TrainingJob) -> tuple[str, str] | None:
        """(tracking URI, run id) of the job's MLflow run, None when it has none (yet)."""
        status = job.status
        if status is None or status.mlflow is None or not status.mlflow.run_id:
            return None
        mlflow = job.spec.tracking.mlflow if job.spec.tracking else None
        uri = (mlflow.tracking_uri if mlflow else None) or (
            tracking_uri_of(status.mlflow.url) if status.mlflow.url else None
        )
        return (uri, status.mlflow.run_id) if uri else None

    def _with_mlflow(self, job: TrainingJob, read: Callable[[MlflowReader, str], Any]) -> Any:
        found = self._tracking(job)
        if found is None:
            raise LookupError(f"TrainingJob {self.name} has no MLflow run (spec.tracking.mlflow, status.mlflow)")
        uri, run_id = found
        with self.client.access.open(uri) as reachable:
            return read(MlflowReader(reachable), run_id)

    def metrics(self, keys: list[str] | None = None) -> dict[str, list[Point]]:
        """Each metric's history (by step) from the job's MLflow run; all metrics when `keys` is None."""

        def read(reader: MlflowReader, run_id: str) -> dict[str, list[Point]]:
            wanted = keys if keys is not None else sorted(reader.latest_metrics(run_id))
            return {key: reader.history(run_id, key) for key in wanted}

        result: dict[str, list[Point]] = self._with_mlflow(self.job(), read)
        return result

    def result(self) -> TrainingResult:
        """What the job produced: final metrics, checkpoint and exported model URIs, the MLflow run and any
        registered model versions. Works while it runs too (then the model URI is None)."""
        job = self.job()
        status = job.status
        phase = (status.phase if status else None) or "Pending"
        checkpoint = status.checkpoint if status else None
        model_uri = None
        if phase == "Succeeded" and job.spec.checkpoint is not None:
            model_uri = job.spec.checkpoint.uri.rstrip("/") + "/final"
        metrics: dict[str, float] = {}
        run_id = run_url = mlflow_model = None
        versions: list[RegisteredVersion] = []
        if self._tracking(job) is not None:
            def read(
                reader: MlflowReader, run: str
            ) -> tuple[dict[str, float], list[RegisteredVersion], dict[str, str]]:
                return reader.latest_metrics(run), reader.registered_versions(run), reader.tags(run)

            metrics, versions, tags = self._with_mlflow(job, read)
            # The trainer tags the run with where it exported the model (output.uri may differ from the default).
            model_uri = tags.get("loom.model.uri", model_uri) if phase == "Succeeded" else None
            assert status is not None and status.mlflow is not None
            run_id, run_url = status.mlflow.run_id, status.mlflow.url
            mlflow_model = f"runs:/{run_id}/model" if phase == "Succeeded" else None
        elif status and status.progress and status.progress.loss is not None:
            metrics = {"loss": status.progress.loss}
        return TrainingResult(
            phase=phase,
            metrics=metrics,
            checkpoint_uri=checkpoint.latest if checkpoint else None,
            checkpoint_step=checkpoint.step if checkpoint else None,
            model_uri=model_uri,
            mlflow_run_id=run_id,
            mlflow_run_url=run_url,
            mlflow_model_uri=mlflow_model,
            registered_versions=versions,
        )
