"""InferenceGraph: InferenceServices wired as Sequence / Switch / Ensemble / Splitter nodes (KServe-like)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from loom.workloads.router.config import Dependency, Protocol, RouterType, SplitterWeight, StepData
from loom.workloads.router.retrieval_config import (
    DEFAULT_PROMPT_TEMPLATE,
    FilterOperator,
    MinScore,
    OnOverflow,
    OnRetrievalFailure,
    PromptBudget,
    RetrievalTimeout,
    TopK,
)

from ...autoscale.spec import Autoscaling, AutoscalingStatus
from ...core.kind import AGE, PHASE, Kind, NameRule, PrinterColumn
from ...core.model import ApiModel, DnsName, StatusBase, cel, validations

GraphPhase = Literal["Pending", "Ready", "Degraded", "Failed"]


class MetadataFilter(ApiModel):
    """Keep a document only if its feature `field` is (In) or is not (NotIn) one of `values`, compared as text."""

    field: str = Field(
        description="A feature of the FeatureView (not its text or vector).",
        max_length=63, pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,62}$",
    )
    operator: FilterOperator = Field("In", description="In: the value is one of values; NotIn: it is none of them.")
    values: list[Annotated[str, Field(max_length=256)]] = Field(
        min_length=1, max_length=32, description="Values compared as text."
    )


class Retrieve(ApiModel):
    """Retrieval-augmented generation on a chat step: the caller's question (the last user message) is embedded,
    the nearest documents of a vector FeatureView are put into the prompt template, and the step's service (an LLM)
    answers from that prompt. The answer names the documents used: header loom-rag-sources (JSON: id, score) and,
    when not streamed, the completion's field loom_sources."""

    model_config = validations(
        cel(
            "self.promptTemplate.contains('{question}') && self.promptTemplate.contains('{context}')",
            "promptTemplate must contain {question} and {context}",
            field_path=".promptTemplate",
        ),
    )

    feature_view: DnsName = Field(description="The vector FeatureView (same namespace) whose documents are searched.")
    embedding_service: DnsName | None = Field(
        None,
        description="The embedding InferenceService (OpenAI /v1/embeddings) that embeds the question. By default "
        "the one the FeatureView embeds its documents with; naming another one is refused (two models' vectors "
        "do not compare).",
    )
    top_k: TopK = 4
    min_score: MinScore | None = Field(
        None,
        description="Documents scoring below are left out (score: 1 - distance for cosine, i.e. the cosine "
        "similarity; 1 / (1 + distance) for the other metrics). Unset: the topK nearest whatever their score.",
    )
    filters: list[MetadataFilter] = Field(
        default_factory=list, max_length=8,
        description="Every filter must hold. Applied to the documents the store returns (it is asked for 4 x topK "
        "when filters are set).",
    )
    prompt_template: str = Field(
        DEFAULT_PROMPT_TEMPLATE,
        min_length=1, max_length=8192,
        description="The user message sent to the LLM: {question} is the caller's last user message, {context} the "
        "documents. Only these two placeholders are replaced (no other braces are interpreted).",
    )
    prompt_budget_chars: PromptBudget = 8000
    on_overflow: OnOverflow = Field(
        "TruncateDocuments",
        description="Documents that do not fit promptBudgetChars: TruncateDocuments drops the lowest ranked and cuts "
        "the last one kept; Refuse answers 400 (context_too_long). A question that alone does not fit is always a "
        "400 (question_too_long) naming the budget.",
    )
    on_failure: OnRetrievalFailure = Field(
        "Fail",
        description="The embedding service or the store cannot answer: Fail answers 502 (retrieval_failed) or 504 "
        "(retrieval_timeout) naming the step; AnswerWithoutContext asks the LLM without documents and says why in "
        "the header loom-rag-degraded.",
    )
    timeout_ms: RetrievalTimeout = 5000


class GraphStep(ApiModel):
    """One step of a node: call an InferenceService or another node of the graph."""

    model_config = validations(
        cel("has(self.serviceName) != has(self.nodeName)", "set exactly one of serviceName or nodeName"),
        cel(
            "!has(self.protocol) || has(self.serviceName)",
            "protocol applies to serviceName steps (a nodeName step speaks its node's protocol)",
            field_path=".protocol",
        ),
        cel(
            "!has(self.retrieve) || (has(self.protocol) && self.protocol == 'openai-chat')",
            "retrieve applies to steps with protocol openai-chat (it writes the chat prompt)",
            field_path=".retrieve",
        ),
    )

    name: str | None = Field(None, description="Step name (the key of its result in an Ensemble).", max_length=63)
    service_name: DnsName | None = Field(None, description="InferenceService in the same namespace.")
    node_name: str | None = Field(None, description="Another node of this graph.", max_length=63)
    data: StepData = Field(
        "$request", description="Input of this step: the original request or the previous step's response."
    )
    condition: str | None = Field(
        None, description="Switch: CEL expression over the request, e.g. request.inputs[0].data[0] > 0.5.",
        max_length=1024,
    )
    weight: SplitterWeight | None = Field(None, description="Splitter: percent of traffic.")
    dependency: Dependency = Field("Soft", description="Hard: a failure of this step fails the graph.")
    protocol: Protocol | None = Field(
        None,
        description="How the step calls its service: oip-v2 (the default: infer / generate / generate_stream) or "
        "openai-chat "
        "(POST /v1/chat/completions of a runtime vllm service). A graph whose steps are openai-chat is itself an "
        "OpenAI chat endpoint (POST /v1/chat/completions); one graph speaks one protocol (serviceName steps only).",
    )
    retrieve: Retrieve | None = Field(
        None, description="Retrieval-augmented generation: put the nearest documents of a FeatureView into the prompt."
    )


class GraphNode(ApiModel):
    model_config = validations(
        cel(
            "self.routerType != 'Splitter' || self.steps.all(s, has(s.weight))",
            "every Splitter step needs a weight",
        ),
        cel(
            "self.routerType != 'Splitter' || self.steps.map(s, has(s.weight) ? s.weight : 0).sum() == 100",
            "Splitter weights must sum to 100",
        ),
    )

    router_type: RouterType
    steps: list[GraphStep] = Field(min_length=1, max_length=32)


# Metrics the router has: its own request series (the model server's names, labelled with the graph) and a user's
# PromQL. It holds no queue and no GPU.
ROUTER_METRICS = ("concurrency", "requests-per-second", "prometheus")


class GraphRouter(ApiModel):
    model_config = validations(
        cel(
            "!has(self.autoscaling) || self.autoscaling.minReplicas >= 1",
            "the router does not scale to zero: autoscaling.minReplicas must be >= 1",
            field_path=".autoscaling.minReplicas",
        ),
        cel(
            "!has(self.autoscaling) || !has(self.autoscaling.engine) || self.autoscaling.engine == 'builtin'",
            "the router is autoscaled by engine builtin only (keda and hpa are for InferenceServices)",
            field_path=".autoscaling.engine",
        ),
        cel(
            "!has(self.autoscaling) || !has(self.autoscaling.metric) || self.autoscaling.metric in "
            + "[" + ", ".join(f"'{m}'" for m in ROUTER_METRICS) + "]",
            "the router scales on concurrency, requests-per-second or prometheus",
            field_path=".autoscaling.metric",
        ),
    )

    replicas: int = Field(
        1,
        ge=1,
        le=100,
        description="Router replicas. With autoscaling it is the autoscaler's (the scale subresource writes it, "
        "kept within min/maxReplicas): leave it out of manifests.",
    )
    timeout_ms: int = Field(30000, ge=1, le=600000, description="Per-step timeout.")
    image: str | None = None
    autoscaling: Autoscaling | None = Field(
        None,
        description="Scale the router on its own request metrics (concurrency, requests-per-second) or a PromQL "
        "query, as an InferenceService's autoscaling (engine builtin, minReplicas >= 1).",
    )


class InferenceGraphSpec(ApiModel):
    model_config = validations(
        cel("'root' in self.nodes", "nodes must contain a node named root", field_path=".nodes"),
        cel(
            "self.nodes.all(n, self.nodes[n].steps.all(s, !has(s.nodeName) || s.nodeName in self.nodes))",
            "every step's nodeName must name a node of this graph",
            field_path=".nodes",
        ),
    )

    nodes: dict[str, GraphNode] = Field(
        description="Graph nodes by name; execution starts at 'root'.", min_length=1, max_length=32
    )
    router: GraphRouter = Field(default_factory=GraphRouter)


class StepStatus(ApiModel):
    """One step of a node as the controller last saw its target."""

    name: str = Field(description="The step's name, else the service or node it calls.")
    service_name: str | None = None
    node_name: str | None = None
    dependency: Dependency = "Soft"
    ready: bool = Field(description="The InferenceService is Ready (a nodeName step: that node is ready).")
    reason: str | None = Field(None, description="Why not ready: NotFound, or the service's Ready reason.")


class NodeStatus(ApiModel):
    name: str
    router_type: RouterType
    ready: bool = Field(description="Every step's target is ready.")
    steps: list[StepStatus] = Field(default_factory=list)


class InferenceGraphStatus(StatusBase):
    phase: GraphPhase | None = None
    url: str | None = Field(None, description="Where clients call the graph: http://<graph>.<namespace>.svc.")
    replicas: int = Field(0, description="Router replicas running (scale subresource).")
    ready_replicas: int = Field(0, description="Router replicas ready.")
    selector: str | None = Field(None, description="Label selector of the router pods (scale subresource).")
    autoscaling: AutoscalingStatus | None = None
    services: str | None = Field(None, description="Referenced InferenceServices ready, e.g. 2/3.")
    nodes: list[NodeStatus] = Field(default_factory=list, description="Per node and step readiness.")


class InferenceGraph(ApiModel):
    """A router that executes a graph of InferenceServices, rolled out independently of the models."""

    api_version: Literal["loom.dev/v1alpha1"] = "loom.dev/v1alpha1"
    kind: Literal["InferenceGraph"] = "InferenceGraph"
    metadata: dict[str, object] = Field(default_factory=dict)
    spec: InferenceGraphSpec
    status: InferenceGraphStatus | None = None


# The kind as Kubernetes shows it (the CRD's names, columns and name rule; api/kinds.py lists every kind).
INFERENCE_GRAPH = Kind(
    kind="InferenceGraph",
    plural="inferencegraphs",
    singular="inferencegraph",
    short_names=("lig",),
    model=InferenceGraph,
    spec=InferenceGraphSpec,
    status=InferenceGraphStatus,
    columns=(
        PrinterColumn("URL", ".status.url"),
        PHASE,
        PrinterColumn("Ready", ".status.readyReplicas", "integer", description="Router replicas ready"),
        PrinterColumn("Services", ".status.services", description="Referenced InferenceServices ready"),
        PrinterColumn("Desired", ".status.autoscaling.desiredReplicas", "integer", description="Autoscaler wants"),
        PrinterColumn("Metric", ".status.autoscaling.metricValue", "number", priority=1),
        AGE,
    ),
    name_rule=NameRule(63, dns_label=True, why="its router's Service is <name>"),
    # The builtin autoscaler (or `kubectl scale`) writes the router's replicas here, as for an InferenceService.
    scale=True,
    scale_replicas_path=".spec.router.replicas",
)
