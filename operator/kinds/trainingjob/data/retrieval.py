"""TrainingJob spec.trainingData -> the retrieval Job, the workers' data env, and what the state machine sees (pure;
io.py runs the Job, state.py holds the workers until the set is built).

The point-in-time training set is built by one Job (`python -m loom.workloads.features historical`, Feast's
historical retrieval) that the controller waits for before it creates any worker. A Job rather than an init
container on every worker: retrieval runs once for N workers and once per TrainingJob, not again on each gang
restart. The Job's name is derived from the TrainingJob's (`<job>-training-data`) and it is only ever created,
never re-applied, so an operator killed at any instant finds it on its next pass and waits for it instead of
starting a second one. Once it succeeded, status.trainingData records it and the Job is not looked at again.

The Job runs against the FeatureView's Feast project exactly as that project's own Jobs do (its ConfigMap, env
from Secrets, its volume), built by kinds/featureview/render.py; it carries no Feast-project label, so the FeatureView
controller never counts it as a registry writer (retrieval only reads the registry).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ....core.kit import Manifest, child_metadata, owner_of, s3_env
from ...featureview.config import ProjectPlan, feast_view_name, short_hash
from ...featureview.render import render_command_job_spec
from ...featureview.status import JobResult
from ..api import TrainingJobSpec
from .api import TrainingData, TrainingDataStatus

KIND = "TrainingJob"
COMPONENT = "training-data"
DATA_ENV = "LOOM_TRAINING_DATA"
DATA_ENDPOINT_ENV = "LOOM_TRAINING_DATA_ENDPOINT"
CONDITION = "TrainingDataReady"
# A Job's name becomes a label value on its pods (batch.kubernetes.io/job-name): at most 63 characters.
_MAX_JOB_NAME = 63

DataState = Literal["Waiting", "Running", "Succeeded", "Failed"]


def data_job_name(job_name: str) -> str:
    name = f"{job_name}-training-data"
    if len(name) <= _MAX_JOB_NAME:
        return name
    return f"{job_name[: _MAX_JOB_NAME - len('-training-data') - 9].rstrip('-.')}-{short_hash(job_name)}-training-data"


def output_uri(data: TrainingData, namespace: str, job_name: str) -> str:
    """Where the training set goes: `output`, else next to the entity dataframe, per namespace and job."""
    if data.output:
        return data.output
    bucket = data.entity_dataframe.removeprefix("s3://").split("/", 1)[0]
    return f"s3://{bucket}/loom-training-data/{namespace}/{job_name}.parquet"


def worker_env(spec: TrainingJobSpec, namespace: str, job_name: str) -> list[Manifest]:
    """What a worker's data loader needs to read the training set: its URI, the endpoint and, when trainingData
    names a Secret, those S3 keys (by reference; they replace checkpoint.secretRef's of the same name)."""
    data = spec.training_data
    if data is None:
        return []
    env: list[Manifest] = [{"name": DATA_ENV, "value": output_uri(data, namespace, job_name)}]
    endpoint = data.endpoint or (spec.checkpoint.endpoint if spec.checkpoint else None)
    if endpoint:
        env.append({"name": DATA_ENDPOINT_ENV, "value": endpoint})
    return env + s3_env(data.secret_ref, None)


def render_data_job(job: Manifest, spec: TrainingJobSpec, plan: ProjectPlan, image: str) -> Manifest:
    """The retrieval Job of this TrainingJob, on the project store of `plan` (which holds the view)."""
    data = spec.training_data
    if data is None:
        raise ValueError("the TrainingJob has no trainingData")
    owner = owner_of(job, KIND)
    name, namespace = owner["metadata"]["name"], owner["metadata"]["namespace"]
    args = [
        "--view",
        feast_view_name(data.feature_view),
        "--entities",
        data.entity_dataframe,
        "--output",
        output_uri(data, namespace, name),
    ]
    if data.endpoint:
        args += ["--s3-endpoint", data.endpoint]
    if data.full_feature_names:
        args.append("--full-feature-names")
    meta = child_metadata(owner, data_job_name(name), COMPONENT)
    job_spec = render_command_job_spec(namespace, plan, "historical", args, dict(meta["labels"]), image)
    if data.secret_ref is not None:
        # The entity dataframe and the output are read and written with these keys (they replace the view's).
        container = job_spec["template"]["spec"]["containers"][0]
        ours = {item["name"]: item for item in s3_env(data.secret_ref, None)}
        container["env"] = [ours.pop(e["name"], e) for e in container["env"]] + list(ours.values())
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta, "spec": job_spec}


# ------------------------------------------------------------------------------------------- observation


@dataclass(frozen=True)
class DataObservation:
    """Where the training set stands, for the state machine: Waiting (on the FeatureView), Running (the Job),
    Succeeded or Failed (the Job's outcome, with the workload's reason and Feast's message)."""

    state: DataState
    reason: str
    message: str
    status: TrainingDataStatus


def _registered(view: Manifest) -> tuple[bool, str, str]:
    for cond in (view.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Registered":
            return cond.get("status") == "True", str(cond.get("reason") or ""), str(cond.get("message") or "")
    return False, "", ""


def view_not_ready(data: TrainingData, view: Manifest | None, output: str) -> DataObservation | None:
    """Why retrieval cannot start yet (the view is missing or not registered in its project), or None."""
    pending = TrainingDataStatus(phase="Pending", output=output)
    if view is None:
        return DataObservation(
            "Waiting",
            "FeatureViewNotFound",
            f"FeatureView {data.feature_view!r} does not exist in this namespace; the workers start once it is "
            "applied and registered",
            pending,
        )
    registered, reason, message = _registered(view)
    if registered:
        return None
    detail = f" ({reason}: {message})" if reason else ""
    return DataObservation(
        "Waiting",
        "FeatureViewNotRegistered",
        f"FeatureView {data.feature_view!r} is not registered yet{detail}",
        pending,
    )


def plan_refusal(data: TrainingData, plan: ProjectPlan) -> DataObservation | None:
    """The view is registered, but its project left it out of the current config (a conflict): wait with why."""
    if any(m.name == data.feature_view for m in plan.members):
        return None
    rejection = plan.rejected.get(data.feature_view)
    why = f"{rejection.reason}: {rejection.message}" if rejection else "not in its project"
    return DataObservation(
        "Waiting",
        "FeatureViewNotRegistered",
        f"FeatureView {data.feature_view!r} cannot be used: {why}",
        TrainingDataStatus(phase="Pending"),
    )


def observe_job(result: JobResult, output: str) -> DataObservation:
    """The retrieval Job's outcome; the workload's termination message names rows, or the reason it failed."""
    status = TrainingDataStatus(phase=result.state, output=output, job=result.name)
    if result.state == "Succeeded":
        rows, empty = result.result.get("rows"), result.result.get("rowsWithoutFeatures")
        status = status.model_copy(
            update={
                "output": str(result.result.get("output") or output),
                "rows": int(rows) if isinstance(rows, int) else None,
                "rows_without_features": int(empty) if isinstance(empty, int) else None,
                "completion_time": result.completed,
            }
        )
        return DataObservation("Succeeded", "Retrieved", f"{status.rows} rows written to {status.output}", status)
    if result.state == "Failed":
        status = status.model_copy(update={"completion_time": result.completed})
        message = result.message or "the retrieval Job failed"
        return DataObservation("Failed", result.reason or "Failed", message, status)
    return DataObservation(
        "Running", "Retrieving", f"Job {result.name} is building the point-in-time training set", status
    )
