"""spec.adapters resolved to the list the pods load (pure), and the adapter states the replicas report turned into
status (pure).

The list goes into the track's ConfigMap as ``adapters.json`` (loom.workloads.llm.adapters.AdapterList), outside
the pod template's config hash: a changed list is rewritten in place, the kubelet updates the mounted file, and the
front loads and unloads adapters without a restart. A TrainingJob's adapter is its peft export under its final
export, ``<checkpoint.uri>/final/adapter``, once the job succeeded; its version label carries the job's uid and
step, so a job that finishes again (re-created) is a new version the replicas load by themselves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from loom.workloads.llm.adapters import AdapterList, AdapterSource, AdapterState

from ....core.kit import Manifest
from ..api import InferenceServiceSpec
from ..source.model import final_export_uri
from .api import AdapterReplicaStatus, AdapterStatus

NOT_SEEN = "the replica has not read this adapter list yet"


@dataclass(frozen=True)
class ResolvedAdapters:
    sources: list[AdapterSource] = field(default_factory=list)  # what the replicas load
    pending: dict[str, str] = field(default_factory=dict)  # adapter name -> why it cannot be loaded yet

    def to_list(self) -> AdapterList:
        return AdapterList(adapters=self.sources)


def served_name(owner: Manifest, spec: InferenceServiceSpec) -> str:
    return spec.model.name or str(owner["metadata"]["name"])


def name_problem(owner: Manifest, spec: InferenceServiceSpec) -> str | None:
    """An adapter named like the base model (its default name is the object's, which admission cannot see)."""
    base = served_name(owner, spec)
    if any(a.name == base for a in spec.adapters or []):
        return f"adapter {base!r} has the base model's name: requests could not tell them apart; rename it"
    return None


def _from_job(name: str, job: dict[str, Any] | None) -> tuple[str, str] | str:
    """(uri, version) of a TrainingJob's adapter, or why there is none yet."""
    if job is None:
        return f"TrainingJob {name} does not exist in this namespace"
    status = job.get("status") or {}
    phase = status.get("phase")
    if phase == "Failed":
        return f"TrainingJob {name} failed: it has no adapter"
    if phase != "Succeeded":
        return f"TrainingJob {name} is {phase or 'Pending'}; waiting for its adapter export"
    # A fine-tuning job (spec.finetune) exports its peft adapter as its final export, <checkpoint.uri>/final
    # (operator/kinds/trainingjob/finetune/config.py).
    uri = final_export_uri(job)
    if uri is None:
        return f"TrainingJob {name} has no spec.checkpoint: it exports no adapter"
    step = (status.get("checkpoint") or {}).get("step")
    if step is None:
        step = (status.get("progress") or {}).get("step")
    uid = str((job.get("metadata") or {}).get("uid") or "")[:8]
    version = "-".join(p for p in ("final", f"step-{step}" if step is not None else "", uid) if p)
    return uri, version


def resolve_adapters(
    spec: InferenceServiceSpec, jobs: dict[str, dict[str, Any] | None], tracking_uri: str | None
) -> ResolvedAdapters:
    """The adapters the replicas load: `jobs` are the TrainingJobs the adapters name (None: not found);
    `tracking_uri` the default MLflow tracking URL (model.trackingUri, else the operator's)."""
    resolved = ResolvedAdapters()
    for adapter in spec.adapters or []:
        if adapter.uri is not None:
            resolved.sources.append(AdapterSource(name=adapter.name, uri=adapter.uri, kind="s3",
                                                  version=adapter.version))
        elif adapter.mlflow is not None:
            tracking = adapter.tracking_uri or tracking_uri
            if tracking is None:
                resolved.pending[adapter.name] = ("no MLflow tracking URL: set the adapter's trackingUri (or the "
                                                  "operator's defaults.mlflow.trackingUri)")
                continue
            resolved.sources.append(AdapterSource(name=adapter.name, uri=adapter.mlflow, kind="mlflow",
                                                  version=adapter.version, tracking_uri=tracking))
        elif adapter.from_training_job is not None:
            found = _from_job(adapter.from_training_job.name, jobs.get(adapter.from_training_job.name))
            if isinstance(found, str):
                resolved.pending[adapter.name] = found
                continue
            uri, version = found
            resolved.sources.append(AdapterSource(name=adapter.name, uri=uri, kind="s3",
                                                  version=adapter.version or version))
    return resolved


def adapter_status(
    resolved: ResolvedAdapters, reports: dict[str, dict[str, Any] | str]
) -> list[AdapterStatus]:
    """Each adapter's state from what the ready replicas report (pod name -> the front's GET /v2/adapters answer,
    or why it could not be read). A replica that still reports an older list (its file not updated yet) counts as
    Pending for the adapters it does not know in this version."""
    out: list[AdapterStatus] = []
    order = [a.name for a in resolved.sources] + list(resolved.pending)
    by_name = {a.name: a for a in resolved.sources}
    for name in order:
        if name in resolved.pending:
            out.append(AdapterStatus(name=name, state="Pending", reason=resolved.pending[name]))
            continue
        source = by_name[name]
        replicas: list[AdapterReplicaStatus] = []
        for pod, report in sorted(reports.items()):
            if isinstance(report, str):
                replicas.append(AdapterReplicaStatus(pod=pod, state="Pending", reason=report))
                continue
            entry = next((e for e in report.get("adapters") or [] if e.get("name") == name), None)
            if entry is None or entry.get("key") != source.key:
                replicas.append(AdapterReplicaStatus(pod=pod, state="Pending", reason=NOT_SEEN))
                continue
            state = entry.get("state")
            phase: AdapterState = state if state in ("Pending", "Loading", "Loaded", "Failed") else "Pending"
            replicas.append(AdapterReplicaStatus(pod=pod, state=phase, reason=entry.get("reason") or None))
        out.append(AdapterStatus(name=name, source=source.uri, version=source.version,
                                 state=_summary(replicas), reason=_first_reason(replicas), replicas=replicas))
    return out


def _summary(replicas: list[AdapterReplicaStatus]) -> AdapterState:
    states = {r.state for r in replicas}
    if not replicas:
        return "Pending"
    if "Failed" in states:
        return "Failed"
    if states == {"Loaded"}:
        return "Loaded"
    return "Loading" if "Loading" in states or "Loaded" in states else "Pending"


def _first_reason(replicas: list[AdapterReplicaStatus]) -> str | None:
    failed = next((r for r in replicas if r.state == "Failed" and r.reason), None)
    return f"{failed.pod}: {failed.reason}" if failed is not None else None


def settled(statuses: list[AdapterStatus]) -> bool:
    """Whether no ready replica is on its way to the list (loading an adapter, or not having read the new list yet):
    then the operator looks again soon. Anything else changes through events it watches (a replica turning ready, a
    TrainingJob finishing, a spec edit) or is seen at the resync (a replica that could not be read), so a service
    at zero replicas or waiting for a job costs no extra passes."""
    return not any(r.state == "Loading" or (r.state == "Pending" and r.reason == NOT_SEEN)
                   for s in statuses for r in s.replicas)
