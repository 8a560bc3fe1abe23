"""Kueue in the local stack: its controller manager from its Go module (go/kueue), its own API objects from its
own Helm chart, and its own certificate management.

How it runs here, and why:
- The binary (`sigs.k8s.io/kueue/cmd/kueue`, built by build.py like the control plane) runs on the host beside
  the other components, with the admin kubeconfig, bound to 127.0.0.1 on free ports (several stacks share this
  machine), no leader election, no metrics or visibility server.
- Its objects come from the chart shipped in Kueue's Go module (`charts/kueue`, rendered by the stack's helm):
  the CRDs (with their conversion webhooks), the webhook configurations and Service, and the empty Secret that
  Kueue's internal certificate management fills. Left out: its Deployment (the binary runs on the host), RBAC
  (it runs as admin), the visibility APIService (an unanswered aggregated API would break discovery for every
  client) and the webhooks of integrations other than Kueue's own API: Kueue's pod, Job, Deployment and
  StatefulSet webhooks fail closed, so with them every pod creation in the stack would depend on Kueue.
- Certificates: Kueue's rotator creates a CA and a serving certificate for `kueue-webhook-service.kueue-system.svc`
  in that Secret and injects the CA into the webhook configurations and CRDs itself; in a pod the kubelet would
  then mount the Secret where the webhook server reads it, so here `up` copies the Secret's keys into the
  certificate directory (the rotator waits for that file, as for a mounted Secret).
- The API server reaches the webhook Service through the stack's egress proxy (egress.py): the Service has no
  selector, and `host-services.json` maps its ClusterIP:443 to the host process's webhook port.
- Configured with Loom's TrainingJob and InferenceService as external frameworks
  (`integrations.externalFrameworks`): Kueue then knows Workloads owned by them as jobs' Workloads; Loom creates
  them and starts the pods on admission.
"""

from __future__ import annotations

from typing import Any

from loom.devstack.cluster.host_webhook import HostWebhookController

KUEUE_MODULE = "sigs.k8s.io/kueue"
KUEUE_VERSION = "v0.17.0"
NAMESPACE = "kueue-system"
# Loom's kinds that Kueue queues as external frameworks (Kind.version.group).
EXTERNAL_FRAMEWORKS = ("TrainingJob.v1alpha1.loom.dev", "InferenceService.v1alpha1.loom.dev")
KUEUE_GROUP = "kueue.x-k8s.io"
CRD_NAMES = (
    "admissionchecks", "clusterqueues", "cohorts", "localqueues", "multikueueclusters", "multikueueconfigs",
    "provisioningrequestconfigs", "resourceflavors", "topologies", "workloadpriorityclasses", "workloads",
)  # fmt: skip
# Kinds of the chart applied as they are (the webhook configurations and the Service are adapted first).
KEPT_KINDS = frozenset({"CustomResourceDefinition", "Secret"})


def _only_kueue_api(webhook_config: dict[str, Any]) -> dict[str, Any]:
    """A webhook configuration with only the webhooks of Kueue's own API group."""
    kept = [
        w
        for w in webhook_config.get("webhooks") or []
        if all(set(r.get("apiGroups") or [""]) <= {KUEUE_GROUP} for r in w.get("rules") or [])
    ]
    return {**webhook_config, "webhooks": kept}


def _adapt(doc: dict[str, Any]) -> dict[str, Any] | None:
    if doc.get("kind") in KEPT_KINDS:
        return doc
    if doc.get("kind") in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        return _only_kueue_api(doc)
    return None


CONTROLLER = HostWebhookController(
    name="kueue",
    go_module=KUEUE_MODULE,
    version=KUEUE_VERSION,
    chart_path="charts/kueue",
    namespace=NAMESPACE,
    webhook_service="kueue-webhook-service",
    cert_secret="kueue-webhook-server-cert",
    crd_names=tuple(f"{n}.{KUEUE_GROUP}" for n in CRD_NAMES),
    config_api_version="config.kueue.x-k8s.io/v1beta2",
    adapt=_adapt,
    extra_config={
        "namespace": NAMESPACE,
        "manageJobsWithoutQueueName": False,
        "integrations": {"frameworks": ["batch/job"], "externalFrameworks": list(EXTERNAL_FRAMEWORKS)},
        # The visibility API server would bind 0.0.0.0:8082 (one per machine); partial admission is how an elastic
        # TrainingJob's minReplicas is admitted.
        "featureGates": {"VisibilityOnDemand": False, "PartialAdmission": True},
    },
)
fetch_chart = CONTROLLER.fetch_chart
