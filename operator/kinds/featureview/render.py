"""FeatureView rendering (pure): the Feast project's FeaturesConfig and every child the Feast pods need.

A Feast project is shared by every FeatureView naming it in a namespace, so some children belong to the project
and some to one view:

- per project (named `<project>-features`): the ConfigMap holding `features.json` (every valid view of the project
  and the store they share), the feature server Deployment and its Service. They carry an ownerReference to every
  member view (none of them the controller), so they live exactly as long as the project has a view.
- per view: an apply Job per (view, store) content hash, the materialize CronJob, and a Job per value of the
  `loom.dev/materialize-now` annotation, built from the CronJob's template.

The store and the server's replicas come from the project's oldest view; a view declaring another store is left
out of the project (condition StoreConflict) rather than silently moving the registry of the others.

Shared folder: the default file registry and sqlite online store sit on a hostPath folder,
`<store.volume.hostPath>/<namespace>/<project>`, mounted by the Jobs and the server, because those are separate
pods that must see one file and an emptyDir is per pod (and no PVC provisioner is assumed). That works on one
node only; an s3:// registry with the redis online store works on many.

Deletion without a finalizer: the project ConfigMap's annotation `loom.dev/registered-views` lists the views the
registry may hold. A pass of any view of the project compares it with the FeatureViews that still exist and runs
a delete Job for each missing one before it forgets the name, so deletions made while the operator was down
converge on the next pass. (When a project's last view is deleted the project's children go with it and its
folder keeps the stale registry; a new view of that project replaces what it redeclares.)
"""

from __future__ import annotations

import json

from ...core.kit import Manifest, labels, owner_reference, restricted_security_context, s3_env
from .config import (
    DATA_DIR,
    HTTP_PORT,
    METRICS_PORT,
    REDIS_ENV,
    Member,
    ProjectPlan,
    apply_hash,
    apply_job_name,
    cronjob_name,
    delete_job_name,
    embedding_key_env,
    feast_view_name,
    host_folder,
    manual_job_name,
    project_object_name,
    project_prefix,
    short_hash,
)

KIND = "FeatureView"
KIND_LABEL = "featureview"
PROJECT_LABEL = "loom.dev/feast-project"
COMMAND_LABEL = "loom.dev/feast-command"
VIEW_LABEL = f"loom.dev/{KIND_LABEL}"
MATERIALIZE_NOW = "loom.dev/materialize-now"
REGISTERED_VIEWS = "loom.dev/registered-views"
CONFIG_HASH_ANNOTATION = "loom.dev/config-hash"
CONTENT_HASH_ANNOTATION = "loom.dev/content-hash"

CONFIG_DIR = "/etc/loom/features"
CONFIG_FILE = "features.json"
CONFIG_PATH = f"{CONFIG_DIR}/{CONFIG_FILE}"
SCRATCH_DIR = "/tmp/loom-feast"  # Feast's repo_path: per pod, so two projects' pods never share it
SERVICE_PORT = 80
CONTAINER = "feast"
# Exit codes of the workload that no retry can fix (config.py: InvalidConfig, InvalidSource, NotFound).
PERMANENT_EXIT_CODES = (2, 3, 4)
JOB_BACKOFF_LIMIT = 3
JOB_DEADLINE_S = 1800


# ------------------------------------------------------------------------------------------- objects


def _project_metadata(
    namespace: str, plan: ProjectPlan, name: str, component: str, annotations: dict[str, str] | None = None
) -> Manifest:
    """Metadata of a project child: owned by every member view (none the controller), so it lives as long as
    any of them and is garbage-collected with the last."""
    refs = []
    for member in plan.members or (plan.primary,):
        owner = _owner(namespace, member)
        refs.append({**owner_reference(owner), "controller": False})
    meta: Manifest = {
        "name": name,
        "namespace": namespace,
        "labels": project_labels(plan.project, component),
        "ownerReferences": refs,
    }
    if annotations:
        meta["annotations"] = annotations
    return meta


def project_labels(project: str, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": KIND_LABEL,
        "app.kubernetes.io/instance": project_prefix(project),
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/part-of": "loom",
        "app.kubernetes.io/managed-by": "loom-operator",
        PROJECT_LABEL: project_prefix(project),
    }


def _owner(namespace: str, member: Member) -> Manifest:
    return {
        "apiVersion": "loom.dev/v1alpha1",
        "kind": KIND,
        "metadata": {"name": member.name, "namespace": namespace, "uid": member.uid},
    }


def config_json(plan: ProjectPlan) -> str:
    return plan.config.to_json()


def render_config_map(namespace: str, plan: ProjectPlan, registered: list[str]) -> Manifest:
    """`features.json` for the commands and `feature_store.yaml` for the official Feast CLI/SDK (secrets as
    ${VAR}); the annotation lists the views the registry may hold (the deletion sweep reads it)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _project_metadata(
            namespace,
            plan,
            project_object_name(plan.project),
            "config",
            {REGISTERED_VIEWS: json.dumps(sorted(set(registered)))},
        ),
        "data": {
            CONFIG_FILE: config_json(plan),
            "feature_store.yaml": json.dumps(plan.config.feature_store_yaml(), indent=2),
        },
    }


def registered_views(config_map: Manifest | None) -> list[str]:
    """The Kubernetes names of the views the project's registry may hold (see the module docstring)."""
    if config_map is None:
        return []
    raw = ((config_map.get("metadata") or {}).get("annotations") or {}).get(REGISTERED_VIEWS, "[]")
    try:
        names = json.loads(raw)
    except ValueError:
        return []
    return sorted(str(n) for n in names) if isinstance(names, list) else []


def _env(plan: ProjectPlan) -> list[Manifest]:
    env = s3_env(plan.credentials, None)
    env += [{"name": k, "value": v} for k, v in sorted(plan.config.s3_endpoints().items())]
    if any(v.source.endpoint for v in plan.config.feature_views) or plan.config.registry.endpoint:
        # S3-compatible stores ignore the region, but the S3 clients need one and cannot discover it there.
        env.append({"name": "AWS_DEFAULT_REGION", "value": "us-east-1"})
    secret = plan.primary.spec.store.online.connection_secret_ref
    if plan.config.online_store.type == "redis" and secret is not None:
        env.append({"name": REDIS_ENV, "valueFrom": {"secretKeyRef": {"name": secret.name, "key": secret.key}}})
    for member in plan.members:  # an embedding service's API key, one variable per embedded view
        vector = member.spec.vector
        key = vector.embedding.api_key_secret_ref if vector is not None and vector.embedding is not None else None
        if key is not None:
            env.append(
                {
                    "name": embedding_key_env(member.name),
                    "valueFrom": {"secretKeyRef": {"name": key.name, "key": key.key}},
                }
            )
    # Feast's progress bars and Python's buffering make pod logs unreadable otherwise.
    env += [{"name": "PYTHONUNBUFFERED", "value": "1"}, {"name": "OMP_NUM_THREADS", "value": "1"}]
    return env


def _volumes(namespace: str, plan: ProjectPlan) -> tuple[list[Manifest], list[Manifest]]:
    volumes: list[Manifest] = [
        {"name": "config", "configMap": {"name": project_object_name(plan.project)}},
        {"name": "scratch", "emptyDir": {}},
        {
            "name": "data",
            "hostPath": {"path": host_folder(namespace, plan.primary.spec), "type": "DirectoryOrCreate"},
        },
    ]
    mounts: list[Manifest] = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "scratch", "mountPath": SCRATCH_DIR},
        {"name": "data", "mountPath": DATA_DIR},
    ]
    return volumes, mounts


def _pod_spec(namespace: str, plan: ProjectPlan, container: Manifest, restart: str) -> Manifest:
    volumes, mounts = _volumes(namespace, plan)
    container = {
        **container,
        "env": _env(plan),
        "volumeMounts": mounts,
        "securityContext": restricted_security_context(),
        # The workload writes its result (or Feast's error) there; status reads it back.
        "terminationMessagePolicy": "File",
    }
    return {
        "restartPolicy": restart,
        "containers": [container],
        "volumes": volumes,
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
    }


def _command(verb: str, *args: str) -> list[str]:
    return ["python", "-m", "loom.workloads.features", verb, "--config", CONFIG_PATH, *args]


def _job_spec(
    namespace: str, plan: ProjectPlan, command: list[str], pod_labels: dict[str, str], image: str
) -> Manifest:
    """A Job that fails at once on a permanent exit code (bad view, unreadable source) and retries the rest."""
    container = {"name": CONTAINER, "image": image, "command": command}
    return {
        "backoffLimit": JOB_BACKOFF_LIMIT,
        "activeDeadlineSeconds": JOB_DEADLINE_S,
        "podFailurePolicy": {
            "rules": [
                {
                    "action": "FailJob",
                    "onExitCodes": {"containerName": CONTAINER, "operator": "In", "values": list(PERMANENT_EXIT_CODES)},
                },
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]},
            ]
        },
        "template": {
            "metadata": {"labels": pod_labels},
            "spec": _pod_spec(namespace, plan, container, "Never"),
        },
    }


def render_command_job_spec(
    namespace: str, plan: ProjectPlan, verb: str, args: list[str], pod_labels: dict[str, str], image: str
) -> Manifest:
    """A Job spec running one workload command against the project's store, with the project's env and volumes
    (a TrainingJob's training-set retrieval: `historical`)."""
    return _job_spec(namespace, plan, _command(verb, *args), pod_labels, image)


def _view_owner(namespace: str, plan: ProjectPlan, name: str) -> Manifest:
    member = next((m for m in plan.members if m.name == name), None)
    if member is None:
        raise KeyError(name)
    return _owner(namespace, member)


def _view_labels(plan: ProjectPlan, owner: Manifest, command: str) -> dict[str, str]:
    return labels(owner, command, {PROJECT_LABEL: project_prefix(plan.project), COMMAND_LABEL: command})


def _view_metadata(owner: Manifest, name: str, job_labels: dict[str, str], annotations: dict[str, str]) -> Manifest:
    return {
        "name": name,
        "namespace": owner["metadata"]["namespace"],
        "labels": job_labels,
        "annotations": annotations,
        "ownerReferences": [owner_reference(owner)],
    }


def render_apply_job(namespace: str, plan: ProjectPlan, name: str, image: str) -> Manifest:
    """The apply Job of this (view, store) content: a new name per content, so each definition is applied once
    and the finished Job is the record of how it went."""
    owner = _view_owner(namespace, plan, name)
    digest = apply_hash(plan, name)
    job_labels = _view_labels(plan, owner, "apply")
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _view_metadata(owner, apply_job_name(name, digest), job_labels, {CONTENT_HASH_ANNOTATION: digest}),
        "spec": _job_spec(namespace, plan, _command("apply", "--view", feast_view_name(name)), job_labels, image),
    }


def render_materialize_job_spec(namespace: str, plan: ProjectPlan, name: str, image: str) -> tuple[Manifest, Manifest]:
    """(labels, Job spec) of one incremental materialization of the view (the CronJob's template)."""
    owner = _view_owner(namespace, plan, name)
    job_labels = _view_labels(plan, owner, "materialize")
    command = _command("materialize", "--view", feast_view_name(name))
    return job_labels, _job_spec(namespace, plan, command, job_labels, image)


CRON_MACROS = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}


def cron_expression(schedule: str) -> str:
    """The five-field form of a CronJob schedule (Kubernetes also takes these macros)."""
    return CRON_MACROS.get(schedule.strip(), schedule.strip())


def render_cronjob(namespace: str, plan: ProjectPlan, name: str, image: str) -> Manifest:
    """Incremental materialization on the view's schedule. Forbid: a run never overlaps the previous one (the
    file registry has no locking)."""
    spec = next(m.spec for m in plan.members if m.name == name)
    job_labels, job_spec = render_materialize_job_spec(namespace, plan, name, image)
    owner = _view_owner(namespace, plan, name)
    return {
        "apiVersion": "batch/v1",
        "kind": "CronJob",
        "metadata": _view_metadata(owner, cronjob_name(name), job_labels, {}),
        "spec": {
            "schedule": spec.materialization.schedule,
            "timeZone": "Etc/UTC",
            "concurrencyPolicy": "Forbid",
            "suspend": spec.materialization.suspend,
            "startingDeadlineSeconds": 600,
            "successfulJobsHistoryLimit": 3,
            "failedJobsHistoryLimit": 3,
            "jobTemplate": {"metadata": {"labels": job_labels}, "spec": job_spec},
        },
    }


def render_manual_job(namespace: str, plan: ProjectPlan, name: str, token: str, image: str) -> Manifest:
    """The Job `loom.dev/materialize-now: <token>` asks for: the CronJob's template, one Job per token value."""
    owner = _view_owner(namespace, plan, name)
    job_labels, job_spec = render_materialize_job_spec(namespace, plan, name, image)
    annotations = {"cronjob.kubernetes.io/instantiate": "manual", MATERIALIZE_NOW: token}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _view_metadata(owner, manual_job_name(name, token), job_labels, annotations),
        "spec": job_spec,
    }


def render_delete_job(namespace: str, plan: ProjectPlan, view: str, image: str) -> Manifest:
    """Remove a deleted FeatureView from the registry (the view need not be in the config any more). Owned by
    the project's remaining views; it removes itself an hour after it finished."""
    job_labels = {**project_labels(plan.project, "delete"), COMMAND_LABEL: "delete"}
    spec = _job_spec(namespace, plan, _command("delete", "--view", feast_view_name(view)), job_labels, image)
    spec["ttlSecondsAfterFinished"] = 3600
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            **_project_metadata(namespace, plan, delete_job_name(plan.project, view), "delete"),
            "labels": job_labels,
        },
        "spec": spec,
    }


def server_selector(project: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": KIND_LABEL,
        "app.kubernetes.io/component": "feature-server",
        PROJECT_LABEL: project_prefix(project),
    }


def _probe(period: int, failures: int) -> Manifest:
    return {
        "httpGet": {"path": "/health", "port": "http"},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def server_replicas(plan: ProjectPlan, live_replicas: int | None) -> int:
    """The feature server's replicas. Not autoscaled: the most any view of the project asks for. Autoscaled (the
    oldest view in the project's config that sets server.autoscaling; the others' are ignored): what the
    autoscaler last wrote to the Deployment (`live_replicas`), kept within that view's min/maxReplicas, or
    minReplicas before the Deployment exists."""
    autoscaling = next((m.spec.server.autoscaling for m in plan.members if m.spec.server.autoscaling), None)
    if autoscaling is None:
        if not plan.members:
            return plan.primary.spec.server.replicas
        return max(m.spec.server.replicas for m in plan.members)
    wanted = autoscaling.min_replicas if live_replicas is None else live_replicas
    return max(autoscaling.min_replicas, min(autoscaling.max_replicas, wanted))


def render_deployment(namespace: str, plan: ProjectPlan, image: str, live_replicas: int | None = None) -> Manifest:
    """`feast serve` for the project. The config hash in the template rolls the pods when the store or a view
    changes; readiness is Feast's GET /health; startup allows a slow Feast import (tens of seconds).
    live_replicas: the existing Deployment's spec.replicas (kept while the server is autoscaled)."""
    container = {
        "name": CONTAINER,
        "image": image,
        "command": _command("serve"),
        "ports": [
            {"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"},
        ],
        "readinessProbe": _probe(2, 3),
        "livenessProbe": _probe(10, 3),
        "startupProbe": _probe(2, 300),
    }
    pod_labels = {**project_labels(plan.project, "feature-server"), **server_selector(plan.project)}
    pod_spec = _pod_spec(namespace, plan, container, "Always")
    replicas = server_replicas(plan, live_replicas)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _project_metadata(namespace, plan, project_object_name(plan.project), "feature-server"),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": server_selector(plan.project)},
            "revisionHistoryLimit": 3,
            "template": {
                "metadata": {
                    "labels": pod_labels,
                    "annotations": {
                        CONFIG_HASH_ANNOTATION: short_hash(config_json(plan), 16),
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(METRICS_PORT),
                    },
                },
                "spec": pod_spec,
            },
        },
    }


def render_service(namespace: str, plan: ProjectPlan) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _project_metadata(namespace, plan, project_object_name(plan.project), "feature-server"),
        "spec": {
            "type": "ClusterIP",
            "selector": server_selector(plan.project),
            "ports": [
                {"name": "http", "port": SERVICE_PORT, "targetPort": "http", "protocol": "TCP"},
                {"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"},
            ],
        },
    }
