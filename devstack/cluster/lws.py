"""LeaderWorkerSet in the local stack: its controller manager from its Go module (go/lws), its CRD and webhook
configurations from its own Helm chart, and its own certificate management. Multi-pod InferenceService replicas
(spec.vllm.parallelism.podsPerReplica > 1) render as LeaderWorkerSets.

How it runs here, and why (as Kueue does, kueue.py):
- The binary (`sigs.k8s.io/lws/cmd`, built by build.py) runs on the host with the admin kubeconfig, bound to
  127.0.0.1 on free ports, no leader election, no metrics server. Its namespace is `lws-system`, LWS's default
  outside a pod (it reads the service account's namespace file, which a host process has not).
- Its webhooks are needed, not optional: the pod webhook gives each pod of a group its group index, worker index
  and the group's unique key (labels the controller's pod reconciler and the Services of a group select on), and
  the LeaderWorkerSet webhook applies the API's defaults. `ENABLE_WEBHOOKS=false` would leave groups unlabelled.
  Its pod webhooks select only pods labelled `leaderworkerset.sigs.k8s.io/name`, so no other pod depends on it.
- Its objects come from the chart in the module (`charts/lws`, rendered by the stack's helm with its CRDs): the CRD,
  the webhook configurations and Service, and the empty Secret its rotator fills. Left out: the Deployment (the
  binary runs on the host), RBAC (it runs as admin), the manager's ConfigMap (config.yaml here instead). The CRD's
  conversion webhook is dropped: the CRD has one version (v1), so there is nothing to convert, and LWS's rotator
  injects its CA into the webhook configurations only.
- Certificates: as Kueue's (webhook_certs.py); the API server reaches the webhook Service through the egress proxy,
  whose host-services.json maps its ClusterIP:443 to the host process's port.
"""

from __future__ import annotations

from typing import Any

from loom.devstack.cluster.host_webhook import HostWebhookController

LWS_MODULE = "sigs.k8s.io/lws"
LWS_VERSION = "v0.8.0"
KEPT_KINDS = frozenset({"Secret", "MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"})


def _adapt(doc: dict[str, Any]) -> dict[str, Any] | None:
    if doc.get("kind") == "CustomResourceDefinition":
        return {**doc, "spec": {**doc["spec"], "conversion": {"strategy": "None"}}}
    return doc if doc.get("kind") in KEPT_KINDS else None


CONTROLLER = HostWebhookController(
    name="lws",
    go_module=LWS_MODULE,
    version=LWS_VERSION,
    chart_path="charts/lws",
    namespace="lws-system",
    webhook_service="lws-webhook-service",
    cert_secret="lws-webhook-server-cert",
    crd_names=("leaderworkersets.leaderworkerset.x-k8s.io",),
    config_api_version="config.lws.x-k8s.io/v1alpha1",
    adapt=_adapt,
    helm_args=("--include-crds",),
)
fetch_chart = CONTROLLER.fetch_chart
