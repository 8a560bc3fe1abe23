"""TrainingJob spec.trainingData: the I/O around the retrieval Job (retrieval.py is the pure part).

Called on every pass until status.trainingData says the set is built: read the FeatureView, create the retrieval
Job if it does not exist yet (create-only: an operator that died after creating it finds it and waits), and read
its outcome from its pods' termination messages.
"""

from __future__ import annotations

from pydantic import ValidationError

from ....core import client as kube
from ....core import kit
from ....core.model import API_VERSION
from ....defaults import EndpointDefaults
from ....defaults import feature_view as feature_view_defaults
from ...featureview.api import FeatureViewSpec
from ...featureview.config import Member, plan_project
from ...featureview.status import job_result
from ..api import TrainingJobSpec
from ..render import JOB_LABEL
from .retrieval import (
    COMPONENT,
    DataObservation,
    data_job_name,
    observe_job,
    output_uri,
    plan_refusal,
    render_data_job,
    view_not_ready,
)


async def _project_members(namespace: str, project: str, defaults: EndpointDefaults) -> list[Member]:
    members: list[Member] = []
    for obj in await kube.list_objects(API_VERSION, "FeatureView", namespace):
        meta = obj["metadata"]
        if meta.get("deletionTimestamp"):
            continue
        try:
            spec = feature_view_defaults(FeatureViewSpec.model_validate(obj.get("spec") or {}), defaults).spec
        except ValidationError:
            continue
        if spec.project == project:
            created = meta.get("creationTimestamp") or ""
            members.append(Member(meta["name"], meta["uid"], created, spec, meta["namespace"]))
    return members


async def observe_training_data(
    job: kube.Manifest, spec: TrainingJobSpec, image: str, defaults: EndpointDefaults | None = None
) -> DataObservation | None:
    """Where the job's training set stands; None when the job has no trainingData. The views' S3 fields get the
    operator's defaults, as the FeatureView controller renders them."""
    defaults = defaults or EndpointDefaults()
    data = spec.training_data
    if data is None:
        return None
    namespace, name = job["metadata"]["namespace"], job["metadata"]["name"]
    output = output_uri(data, namespace, name)
    job_name = data_job_name(name)
    # Listed by label, not read by name: the operator's RBAC lists Jobs (it never needs `get` on them).
    selector = kit.selector({JOB_LABEL: name, "app.kubernetes.io/component": COMPONENT})
    jobs = await kube.list_objects("batch/v1", "Job", namespace, selector)
    existing = next((j for j in jobs if j["metadata"]["name"] == job_name), None)
    if existing is None:
        view = await kube.get(API_VERSION, "FeatureView", namespace, data.feature_view)
        waiting = view_not_ready(data, view, output)
        if waiting is not None or view is None:
            return waiting
        view_spec = FeatureViewSpec.model_validate(view.get("spec") or {})
        plan = plan_project(view_spec.project, await _project_members(namespace, view_spec.project, defaults))
        refused = plan_refusal(data, plan)
        if refused is not None:
            return refused
        existing = await kube.apply(render_data_job(job, spec, plan, image))
    pods = await kube.list_objects("v1", "Pod", namespace, f"batch.kubernetes.io/job-name={job_name}")
    return observe_job(job_result(existing, pods), output)
