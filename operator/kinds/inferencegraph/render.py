"""InferenceGraph -> the router's RouterConfig, ConfigMap, Deployment and Service (pure: no I/O, unit-tested).

Layout of the children of InferenceGraph `<graph>`:

    Service     <graph>                 ClusterIP, port 80 -> the router's http port: http://<graph>.<ns>.svc
    Deployment  <graph>-router          the router pods (python -m loom.workloads.router)
    ConfigMap   <graph>-router-config   its RouterConfig (loom.workloads.router.config, the contract)

The router is rolled on its own: the config's hash is a pod-template annotation, so a change of the graph (or of
a referenced service's model name) rolls only the router, with maxUnavailable 0 so no request is dropped; the
InferenceServices it calls are never touched.

What admission (the CRD's CEL rules) cannot check is checked here and comes back as a `GraphProblem`, which the
status reports as a condition: steps naming InferenceServices that do not exist (yet), cycles and the other
structural problems of `graph_issues`, CEL conditions that do not compile and a graph name longer than the router
serves as a model name (`graph_issues_of`, which the
admission webhook applies too, so such a graph is refused before it is stored). A graph with a problem renders
nothing new; the router already running (if any) keeps serving the last good graph.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, cast

from pydantic import ValidationError
from pydantic.alias_generators import to_camel

from loom.workloads.router.conditions import condition_problems
from loom.workloads.router.config import (
    GraphIssue,
    NodeConfig,
    RouterConfig,
    StepConfig,
    UpstreamConfig,
    graph_issues,
)
from loom.workloads.router.retrieval_config import VectorStoreConfig

from ...core.kit import Manifest, child_metadata, labels, match_labels, restricted_security_context, selector
from ...core.model import first_error
from ..inferenceservice.render import (
    CONFIG_HASH_ANNOTATION,
    SERVER_DRAIN_SECONDS,
    SERVICE_PORT,
    config_hash,
    service_url,
)
from .api import INFERENCE_GRAPH, GraphStep, InferenceGraphSpec
from .retrieval import StoreProblem, ViewRef, placeholder_store, referenced_views, resolve_store

KIND_LABEL = "inferencegraph"
COMPONENT = "router"
ROUTER_PORT = 8080
CONFIG_DIR = "/etc/loom"
CONFIG_FILE = "router.json"
# Seconds a terminating router keeps serving while endpoint removal propagates to every proxy (the preStop sleep).
DRAIN_SECONDS = 5
# After SIGTERM the router still answers (not ready, closing keep-alive) this long, then stops accepting
# (loom.workloads.common.lifecycle): the model server's window, for the same reason (kept-alive clients).
ROUTER_DRAIN_SECONDS = SERVER_DRAIN_SECONDS
# After the requests in flight: time to close the upstream pools and exit.
EXIT_SECONDS = 2
# The overall budget of one graph request; a per-step timeout above it raises it (a step may take that long).
DEFAULT_DEADLINE_MS = 60_000

# Where a problem with the graph's own name is (its GraphIssue's field; admission's field path as it is).
NAME_FIELD = "metadata.name"

ProblemReason = Literal[
    "InvalidGraph", "ServiceNotFound", "ServiceNameConflict", "FeatureViewNotFound", "FeatureViewNotReady"
]


@dataclass(frozen=True)
class ServiceRef:
    """A referenced InferenceService as the graph needs it: where it answers and whether it is Ready."""

    name: str
    url: str
    model_name: str
    ready: bool
    reason: str | None  # its Ready condition's reason


@dataclass(frozen=True)
class GraphProblem:
    """Why the graph cannot be rendered now. InvalidGraph: the spec must change. ServiceNotFound: waiting for
    InferenceServices to be created (the graph is re-reconciled when one appears)."""

    reason: ProblemReason
    message: str


def service_name(name: str) -> str:
    return name


def service_conflict(owner: Manifest, existing: Manifest | None) -> GraphProblem | None:
    """The graph's Service name (the graph's own name) taken by another object's Service, e.g. an InferenceService
    of the same name in the namespace: the graph then leaves that Service alone and reports ServiceNameConflict
    instead of fighting over it (both are applied under one field manager, so each apply would take it back)."""
    if existing is None:
        return None
    uid = owner["metadata"]["uid"]
    refs = (existing.get("metadata") or {}).get("ownerReferences") or []
    controller = next((r for r in refs if r.get("controller")), None)
    if controller is None or controller.get("uid") == uid:
        return None  # ours, or nobody's (left behind): ours to apply
    name = service_name(owner["metadata"]["name"])
    return GraphProblem(
        "ServiceNameConflict",
        f"Service {name} belongs to {controller.get('kind')} {controller.get('name')}: an InferenceGraph and an "
        "InferenceService of one name in one namespace would share it; rename the InferenceGraph",
    )


def deployment_name(name: str) -> str:
    return f"{name}-router"


def config_map_name(name: str) -> str:
    return f"{deployment_name(name)}-config"


def graph_url(owner: Manifest) -> str:
    meta = owner["metadata"]
    return f"http://{service_name(meta['name'])}.{meta['namespace']}.svc"


def router_selector(owner: Manifest) -> dict[str, str]:
    return match_labels(owner, COMPONENT)


def selector_string(owner: Manifest) -> str:
    return selector(router_selector(owner))


# ------------------------------------------------------------------------------------------- references


def referenced_services(spec: InferenceGraphSpec) -> list[str]:
    """Every InferenceService a step names, sorted, once each."""
    return sorted({s.service_name for node in spec.nodes.values() for s in node.steps if s.service_name})


def hard_services(spec: InferenceGraphSpec) -> set[str]:
    """InferenceServices a Hard step names: the graph is Ready only when all of these are."""
    return {s.service_name for n in spec.nodes.values() for s in n.steps if s.service_name and s.dependency == "Hard"}


def _ready_condition(body: Manifest) -> Manifest:
    for cond in (body.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return dict(cond)
    return {}


def observe_service(body: Manifest) -> ServiceRef:
    """An InferenceService as read from the API server. Its URL is the Service the InferenceService controller
    renders (deterministic, so it is known before the service's first status); the model name is the one its
    server serves: spec.model.name, else the InferenceService's name."""
    meta = body["metadata"]
    model = (body.get("spec") or {}).get("model") or {}
    ready = _ready_condition(body)
    return ServiceRef(
        name=meta["name"],
        url=f"{service_url({'metadata': meta})}:{SERVICE_PORT}",
        model_name=str(model.get("name") or meta["name"]),
        ready=ready.get("status") == "True",
        reason=ready.get("reason"),
    )


# ------------------------------------------------------------------------------------------- router config


def router_replicas(spec: InferenceGraphSpec) -> int:
    """The router's replicas: spec.router.replicas, which the autoscaler writes through the InferenceGraph's scale
    subresource when router.autoscaling is set, kept within its min/maxReplicas (the spec may have moved them)."""
    replicas, autoscaling = spec.router.replicas, spec.router.autoscaling
    if autoscaling is None:
        return replicas
    return max(autoscaling.min_replicas, min(autoscaling.max_replicas, replicas))


def deadline_ms(spec: InferenceGraphSpec) -> int:
    """The budget of one graph request: the default, or the per-step timeout where that is longer."""
    return max(DEFAULT_DEADLINE_MS, spec.router.timeout_ms)


def _step(step: GraphStep) -> StepConfig:
    # Every field of the API's step is the router's field of the same name (tests/unit/test_contracts.py).
    return StepConfig.model_validate(step.model_dump())


def _step_issues(name: str, index: int, exc: ValidationError) -> list[GraphIssue]:
    """The router's step model refusing one step: each error at the step field it names (wire name)."""
    issues = []
    for error in exc.errors():
        field = to_camel(str(error["loc"][0])) if error["loc"] else None
        issues.append(GraphIssue(str(error["msg"]), name, index, field, f"node {name!r} step {index}"))
    return issues


def _name_issues(name: str | None) -> list[GraphIssue]:
    """The graph's name names its router's Service and is the model name the router serves (graphName), which
    allows more; Kubernetes allows object names of 253 characters with dots (INFERENCE_GRAPH.name_rule)."""
    rule = INFERENCE_GRAPH.name_rule
    if name is None or rule.fits(name):
        return []
    return [GraphIssue(f"must be {rule.requirement}", field=NAME_FIELD, where=NAME_FIELD)]


def _checked_nodes(spec: InferenceGraphSpec, name: str | None) -> tuple[dict[str, NodeConfig], list[GraphIssue]]:
    """The router's nodes, each StepConfig built once, and every problem that makes the graph InvalidGraph (the
    nodes are only meaningful when there is none). `graph_issues_of` and `router_config` both come here, so what
    is judged is exactly what the router would be given. The graph's name is judged when given."""
    named = _name_issues(name)
    issues: list[GraphIssue] = []
    steps: dict[str, list[StepConfig]] = {}
    for node_name, node in spec.nodes.items():
        steps[node_name] = []
        for index, step in enumerate(node.steps):
            try:
                steps[node_name].append(_step(step))
            except ValidationError as exc:
                issues.extend(_step_issues(node_name, index, exc))
    if issues:
        return {}, named + issues
    try:
        nodes = {key: NodeConfig(router_type=node.router_type, steps=steps[key]) for key, node in spec.nodes.items()}
    except ValidationError as exc:  # a node's step count (the CRD's schema bounds it the same way)
        return {}, [*named, GraphIssue(first_error(exc, prefix=""))]
    placeholders = {
        ref: UpstreamConfig(url=f"http://{ref}:{SERVICE_PORT}", model_name=ref) for ref in referenced_services(spec)
    }
    stores = {view: placeholder_store(view) for view in referenced_views(spec)}
    # Unvalidated, so that every problem is listed (the graph's name was judged above).
    candidate = RouterConfig.model_construct(graph_name="graph", nodes=nodes, services=placeholders, stores=stores)
    structural: list[GraphIssue] = graph_issues(candidate)
    return nodes, named + structural + [
        GraphIssue(
            f"does not compile: {p.message}",
            p.node,
            p.step,
            "condition",
            f"node {p.node!r} step {p.step} ({p.step_name}): condition {p.expression!r}",
        )
        for p in condition_problems(candidate)
    ]


def graph_issues_of(spec: InferenceGraphSpec, name: str | None = None) -> list[GraphIssue]:
    """Every problem that makes the graph InvalidGraph, each with its place: its name (when given) as the model
    name the router serves, and the router's own checks (its step model, `graph_issues`, the CEL compiler) on the
    config the router would get. What the controller reports as GraphValid=False and what the admission webhook
    refuses (operator/admission/graph.py) is this one list. Whether the named InferenceServices exist is not
    judged here (placeholders stand in for all of them)."""
    return _checked_nodes(spec, name)[1]


def _upstream(ref: ServiceRef) -> UpstreamConfig:
    return UpstreamConfig(url=ref.url, model_name=ref.model_name)


def _stores(
    spec: InferenceGraphSpec, services: Mapping[str, ServiceRef], views: Mapping[str, ViewRef]
) -> tuple[dict[str, VectorStoreConfig], GraphProblem | None]:
    """The retrieve steps' stores, or the first problem (one the spec must fix before one that waits)."""
    embedders = {name: (ref.url, ref.model_name) for name, ref in services.items()}
    stores: dict[str, VectorStoreConfig] = {}
    problems = []
    for node in spec.nodes.values():
        for step in node.steps:
            if step.retrieve is None:
                continue
            resolved = resolve_store(step.retrieve, views.get(step.retrieve.feature_view), embedders)
            if isinstance(resolved, StoreProblem):
                problems.append(resolved)
            else:
                stores[step.retrieve.feature_view] = resolved
    if problems:
        first = min(problems, key=lambda p: p.reason != "InvalidGraph")
        return {}, GraphProblem(cast(ProblemReason, first.reason), first.message)
    return stores, None


def router_config(
    owner: Manifest,
    spec: InferenceGraphSpec,
    services: Mapping[str, ServiceRef],
    views: Mapping[str, ViewRef] | None = None,
) -> tuple[RouterConfig | None, GraphProblem | None]:
    """The router's config, or why there is none. Structural and CEL problems are reported before missing
    InferenceServices (fixing the spec is the user's next step either way; a missing service may just be late),
    and those before the retrieve steps' FeatureViews (`views`, by name)."""
    nodes, issues = _checked_nodes(spec, owner["metadata"]["name"])
    if issues:
        return None, GraphProblem("InvalidGraph", "; ".join(str(issue) for issue in issues))
    wanted = referenced_services(spec)
    missing = [name for name in wanted if name not in services]
    if missing:
        return None, GraphProblem("ServiceNotFound", f"InferenceService(s) not found: {', '.join(missing)}")
    stores, problem = _stores(spec, services, views or {})
    if problem is not None:
        return None, problem
    upstreams = {name: _upstream(services[name]) for name in wanted}
    try:
        config = RouterConfig(
            graph_name=owner["metadata"]["name"],
            nodes=nodes,
            services=upstreams,
            stores=stores,
            step_timeout_ms=spec.router.timeout_ms,
            deadline_ms=deadline_ms(spec),
            port=ROUTER_PORT,
        )
    except ValidationError as exc:  # whatever else the router's model refuses: reported, never raised
        return None, GraphProblem("InvalidGraph", first_error(exc, prefix=""))
    return config, None


# ------------------------------------------------------------------------------------------- children


def render_config_map(owner: Manifest, config: RouterConfig) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": child_metadata(owner, config_map_name(owner["metadata"]["name"]), COMPONENT),
        "data": {CONFIG_FILE: config.to_json()},
    }


def render_service(owner: Manifest) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(owner, service_name(owner["metadata"]["name"]), COMPONENT),
        "spec": {
            "type": "ClusterIP",
            "selector": router_selector(owner),
            "ports": [{"name": "http", "port": SERVICE_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def _probe(path: str, period: int, failures: int) -> Manifest:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period, "timeoutSeconds": 2,
            "failureThreshold": failures}  # fmt: skip


def render_deployment(owner: Manifest, spec: InferenceGraphSpec, config_json: str, image: str) -> Manifest:
    name = owner["metadata"]["name"]
    config_path = f"{CONFIG_DIR}/{CONFIG_FILE}"
    # A request in flight may take the whole graph deadline: SIGTERM lets it finish within the grace period.
    request_grace = deadline_ms(spec) // 1000 + 1
    router: Manifest = {
        "name": "router",
        "image": spec.router.image or image,
        "command": [
            "python", "-m", "loom.workloads.router", "--config", config_path,
            "--drain-seconds", str(ROUTER_DRAIN_SECONDS), "--shutdown-timeout", str(request_grace),
        ],
        "ports": [{"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"}],
        "volumeMounts": [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}],
        "readinessProbe": _probe("/v2/health/ready", period=2, failures=2),
        "livenessProbe": _probe("/v2/health/live", period=10, failures=3),
        "startupProbe": _probe("/v2/health/live", period=1, failures=60),
        # Keep serving while the endpoint removal reaches every proxy; then SIGTERM drains in-flight requests.
        "lifecycle": {"preStop": {"sleep": {"seconds": DRAIN_SECONDS}}},
        "securityContext": restricted_security_context(),
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": child_metadata(owner, deployment_name(name), COMPONENT),
        "spec": {
            "replicas": router_replicas(spec),
            "selector": {"matchLabels": router_selector(owner)},
            # A new router is up and ready before an old one goes: a graph change drops no request.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "revisionHistoryLimit": 3,
            "progressDeadlineSeconds": 300,
            "template": {
                "metadata": {
                    "labels": labels(owner, COMPONENT),
                    # A new graph is a new template: only the router rolls.
                    "annotations": {CONFIG_HASH_ANNOTATION: config_hash(config_json)},
                },
                "spec": {
                    "containers": [router],
                    "volumes": [{"name": "config", "configMap": {"name": config_map_name(name)}}],
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": 1000,
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    # preStop sleep, drain window, the longest request, and time to close and exit.
                    "terminationGracePeriodSeconds": DRAIN_SECONDS + ROUTER_DRAIN_SECONDS + request_grace
                    + EXIT_SECONDS,
                },
            },
        },
    }


def render_router(owner: Manifest, spec: InferenceGraphSpec, config: RouterConfig, image: str) -> list[Manifest]:
    """ConfigMap, Deployment, Service, in the order they are applied (new pods must find their config)."""
    config_map = render_config_map(owner, config)
    deployment = render_deployment(owner, spec, config_map["data"][CONFIG_FILE], image)
    return [config_map, deployment, render_service(owner)]
