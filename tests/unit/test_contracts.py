"""One source of truth per workload contract: where the operator's API and a workload's config model expose the
same field, they agree on its type, enum, limits and default.

The walk is generic: both pydantic models are turned into the structural schemas the CRDs are generated from,
flattened to camelCase field paths, and every field that exists on both sides (same path, or a move declared in
`moved`) is compared. A field the workload restricts (type, enum, bounds, pattern) must carry the same restriction
in the API, or admission would accept an object the workload refuses inside a pod; a default on both sides must
be the same value, or the same object would mean two things. The API may restrict more (lengths for CEL cost
budgets, an upper bound on keepLast): that only refuses earlier. Where both sides bound a field from above and the
API's bound is lower on purpose, the contract declares it in `capped` (the API's maximum must then stay below).

Every operator API model that renders a workload config has its contract here: TrainingJob -> trainer, the
InferenceService -> model server, LLM server (engine options, limits, adapter list), endpoint picker, FeatureView ->
Feast view, InferenceGraph -> router (its steps, nodes, router), and the operator's settings -> scale-to-zero
activator.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from loom.e2e.example_specs import resolved
from loom.operator.api import Adapter, GraphNode, GraphRouter, GraphStep, Routing, VllmSpec
from loom.operator.api.crd import model_schema
from loom.operator.kinds.featureview.api import FeatureViewSpec
from loom.operator.kinds.inferenceservice.api import InferenceServiceSpec
from loom.operator.kinds.trainingjob.api import TrainingJobSpec
from loom.operator.kinds.trainingjob.config import trainer_config
from loom.operator.settings import OperatorSettings
from loom.workloads.activator.config import ActivatorConfig
from loom.workloads.features.config import FeatureViewConfig
from loom.workloads.llm.adapters import AdapterSource
from loom.workloads.llm.config import EngineOptions, LlmLimits
from loom.workloads.picker.config import PickerConfig
from loom.workloads.router.config import NodeConfig, RouterConfig, StepConfig
from loom.workloads.server import handlers
from loom.workloads.server.config import BUILTIN_HANDLERS, ServerConfig
from loom.workloads.server.model import Model
from loom.workloads.trainer.config import TrainerConfig

Schema = dict[str, Any]
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
EXAMPLE_JOBS = [
    (path.name, doc)
    for path in sorted(EXAMPLES.glob("*.yaml"))
    for doc in yaml.safe_load_all(path.read_text())
    if isinstance(doc, dict) and doc.get("kind") == "TrainingJob"
]

# What restricts a value: a workload restriction must be repeated, equal, by the API.
RESTRICTIONS = ("type", "enum", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "pattern")


@dataclass(frozen=True)
class Contract:
    api: type[BaseModel]
    workload: type[BaseModel]
    # API path -> workload path, for fields the operator renders under another name or shape.
    moved: dict[str, str] = field(default_factory=dict)
    # Paths on both sides whose value the operator translates, so nothing is compared; each says why.
    translated: dict[str, str] = field(default_factory=dict)
    # API paths whose maximum is below the workload's on purpose (the API refuses earlier); each says why.
    capped: dict[str, str] = field(default_factory=dict)
    # Fields that must be among the compared ones, so a rename cannot make the walk silently compare nothing.
    expected: frozenset[str] = frozenset()


TRAINING = Contract(
    api=TrainingJobSpec,
    workload=TrainerConfig,
    moved={"maxSteps": "training.maxSteps", "entrypoint.module": "entrypoint"},
    expected=frozenset(
        {
            "engine",
            "maxSteps",
            "entrypoint.module",
            "deepspeed.zeroStage",
            "deepspeed.offload",
            "deepspeed.bf16",
            "fsdp.sharding",
            "fsdp.mixedPrecision",
            "fsdp.activationCheckpointing",
            "checkpoint.uri",
            "checkpoint.everySteps",
            "checkpoint.everyMinutes",
            "checkpoint.async",
            "checkpoint.keepLast",
            "checkpoint.resume",
            "tracking.mlflow.experiment",
        }
    ),
)
SERVING = Contract(
    api=InferenceServiceSpec,
    workload=ServerConfig,
    translated={
        "handler": "the operator resolves 'auto' to a built-in handler from the model source "
        "(render/inferenceservice_model.resolve_handler); the server never sees 'auto'",
        "features.featureView": "the operator resolves the FeatureView (a Kubernetes name) to its Feast view name "
        "(render/inferenceservice_features.resolve_features)",
    },
    expected=frozenset(
        {
            "batching.maxBatchSize",
            "batching.maxLatencyMs",
            "batching.maxQueue",
            "auth.rateLimit.requestsPerSecond",
            "auth.rateLimit.burst",
            "features.entityKeys",
        }
    ),
)
# One FeatureView is one view of its project's FeaturesConfig (render/featureview_config.view_config); the
# dtype enums are compared in tests/unit/test_featureview_render.py (the workload checks them in a validator).
FEATURES = Contract(
    api=FeatureViewSpec,
    workload=FeatureViewConfig,
    expected=frozenset(
        {"online", "description", "owner", "tags", "source.path", "source.timestampField", "source.endpoint"}
    ),
)
# InferenceGraph -> the router's RouterConfig (render/inferencegraph: a GraphStep becomes the StepConfig of the same
# fields, a GraphNode a NodeConfig, spec.router.timeoutMs the default step timeout).
GRAPH_STEPS = Contract(
    api=GraphStep,
    workload=StepConfig,
    expected=frozenset(
        {"name", "serviceName", "nodeName", "data", "condition", "weight", "dependency", "protocol",
         "retrieve.featureView", "retrieve.topK", "retrieve.minScore", "retrieve.promptTemplate",
         "retrieve.promptBudgetChars", "retrieve.onOverflow", "retrieve.onFailure", "retrieve.timeoutMs"}
    ),
)
GRAPH_NODES = Contract(api=GraphNode, workload=NodeConfig, expected=frozenset({"routerType", "steps"}))
GRAPH_ROUTER = Contract(
    api=GraphRouter,
    workload=RouterConfig,
    moved={"timeoutMs": "stepTimeoutMs"},
    capped={"timeoutMs": "the API allows a step 10 minutes; the router takes up to an hour (an earlier refusal)"},
    expected=frozenset({"timeoutMs"}),
)
# InferenceService runtime vllm -> the LLM server's LlmServerConfig: spec.vllm's engine options and limits
# (VllmSpec.engine_options, llm/vllm.llm_config) and spec.adapters as the adapter list (llm/adapters.py).
LLM_ENGINE = Contract(
    api=VllmSpec,
    workload=EngineOptions,
    moved={"maxLoadedAdapters": "maxLoras", "maxAdapterRank": "maxLoraRank"},
    capped={"tensorParallelSize": "a replica asks for at most 16 GPUs (spec.gpus), the engine could split over 64"},
    expected=frozenset(
        {
            "maxModelLen",
            "gpuMemoryUtilization",
            "kvCacheMemoryBytes",
            "dtype",
            "tensorParallelSize",
            "enablePrefixCaching",
            "maxNumSeqs",
            "chatTemplate",
            "enforceEager",
            "maxLoadedAdapters",
            "maxAdapterRank",
            "extraArgs",
        }
    ),
)
LLM_LIMITS = Contract(
    api=VllmSpec,
    workload=LlmLimits,
    moved={"requestTimeoutSeconds": "requestTimeoutS", "maxTokens": "maxTokensLimit"},
    capped={"requestTimeoutSeconds": "the API allows a request an hour; the front takes up to a day (an earlier "
            "refusal)"},
    expected=frozenset({"requestsPerMinute", "tokensPerMinute", "requestTimeoutSeconds", "maxTokens"}),
)
LLM_ADAPTERS = Contract(
    api=Adapter,
    workload=AdapterSource,
    # An mlflow adapter's models:/ URI is its source's uri (kind mlflow).
    moved={"mlflow": "uri"},
    expected=frozenset({"name", "uri", "mlflow", "version", "trackingUri"}),
)
# InferenceService spec.routing -> the endpoint picker's PickerConfig (traffic/picker.picker_config).
PICKER = Contract(
    api=Routing,
    workload=PickerConfig,
    moved={"sessionAffinity.header": "sessionHeader"},
    expected=frozenset({"policy", "sessionAffinity.header", "maxWaitingRequests", "maxKvCacheUsage",
                        "flowControl.maxInflightPerReplica", "flowControl.maxQueued",
                        "flowControl.maxQueueWaitSeconds", "flowControl.priorityHeader",
                        "flowControl.defaultPriority", "flowControl.tenantHeader"}),
)
# InferenceService scale to zero -> the activator's ActivatorConfig, whose limits come from the operator's settings
# (traffic/io: activator_config(owner, timeout_seconds=..., max_held=...)).
ACTIVATOR = Contract(
    api=OperatorSettings,
    workload=ActivatorConfig,
    moved={"activator_timeout_s": "timeoutSeconds", "activator_max_held": "maxHeld"},
    expected=frozenset({"activator_timeout_s", "activator_max_held"}),
)
CONTRACTS = {
    "TrainingJob-TrainerConfig": TRAINING,
    "InferenceService-ServerConfig": SERVING,
    "FeatureView-FeatureViewConfig": FEATURES,
    "GraphStep-StepConfig": GRAPH_STEPS,
    "GraphNode-NodeConfig": GRAPH_NODES,
    "GraphRouter-RouterConfig": GRAPH_ROUTER,
    "VllmSpec-EngineOptions": LLM_ENGINE,
    "VllmSpec-LlmLimits": LLM_LIMITS,
    "Adapter-AdapterSource": LLM_ADAPTERS,
    "Routing-PickerConfig": PICKER,
    "OperatorSettings-ActivatorConfig": ACTIVATOR,
}


def leaves(schema: Schema, path: str = "") -> dict[str, Schema]:
    """Every field of a structural schema by its camelCase path; objects with properties are walked into."""
    if "properties" not in schema:
        return {path: schema}
    found: dict[str, Schema] = {}
    for name, sub in schema["properties"].items():
        found.update(leaves(sub, f"{path}.{name}" if path else name))
    return found


def disagreements(api: Schema, workload: Schema) -> list[str]:
    problems = []
    for key in RESTRICTIONS:
        if key not in workload:
            continue
        mine, theirs = api.get(key), workload[key]
        if key == "enum" and mine is not None:
            mine, theirs = sorted(mine), sorted(theirs)
        if mine != theirs:
            problems.append(f"{key}: API {api.get(key, '<unset>')!r} != workload {workload[key]!r}")
    if "default" in api and "default" in workload and api["default"] != workload["default"]:
        problems.append(f"default: API {api['default']!r} != workload {workload['default']!r}")
    return problems


def capped_disagreements(api: Schema, workload: Schema) -> list[str]:
    """As `disagreements`, but the API's maximum must be below the workload's instead of equal to it."""
    mine, theirs = api.get("maximum"), workload.get("maximum")
    problems = disagreements(
        {key: value for key, value in api.items() if key != "maximum"},
        {key: value for key, value in workload.items() if key != "maximum"},
    )
    if mine is None or theirs is None or mine >= theirs:
        problems.append(f"maximum: API {api.get('maximum', '<unset>')!r} is not below workload "
                        f"{workload.get('maximum', '<unset>')!r} (declared capped)")
    return problems


def compare(contract: Contract) -> tuple[set[str], list[str]]:
    """(API paths compared, problems found)."""
    api = leaves(model_schema(contract.api))
    workload = leaves(model_schema(contract.workload))
    pairs = {path: path for path in api.keys() & workload.keys()} | contract.moved
    problems = [
        f"declared {path} -> {target} is missing"
        for path, target in contract.moved.items()
        if path not in api or target not in workload
    ]
    problems += [
        f"translated {path} is not on both sides"
        for path in contract.translated
        if path not in api or path not in workload
    ]
    problems += [f"capped {path} is not compared" for path in contract.capped if path not in pairs]
    # A name that is a field on one side and an object on the other is a reshaping nobody declared.
    for path in sorted(api.keys() ^ workload.keys()):
        other = workload if path in api else api
        if any(o.startswith(f"{path}.") for o in other) and path not in contract.moved.values() | contract.moved.keys():
            problems.append(f"{path}: a field on one side, an object on the other (declare it in `moved`)")
    compared = set()
    for path, target in sorted(pairs.items()):
        if path in contract.translated or path not in api or target not in workload:
            continue
        compared.add(path)
        judge = capped_disagreements if path in contract.capped else disagreements
        problems += [
            f"{contract.api.__name__} {path} <-> {contract.workload.__name__} {target}: {problem}"
            for problem in judge(api[path], workload[target])
        ]
    return compared, problems


@pytest.mark.parametrize("name", CONTRACTS)
def test_every_limit_enum_and_default_on_both_sides_agrees(name: str) -> None:
    contract = CONTRACTS[name]
    compared, problems = compare(contract)
    assert not problems, "the API and the workload disagree:\n" + "\n".join(problems)
    assert contract.expected <= compared, f"not compared any more: {sorted(contract.expected - compared)}"


def test_the_walk_sees_a_change_on_one_side() -> None:
    """The comparison itself: a workload limit the API lacks, a differing default and a differing enum."""
    api = {"properties": {"size": {"type": "integer", "default": 8, "minimum": 1}, "mode": {"enum": ["a", "b"]}}}
    workload = {
        "properties": {
            "size": {"type": "integer", "default": 5, "minimum": 1, "maximum": 10},
            "mode": {"enum": ["a", "c"]},
        }
    }
    problems = [p for path in ("size", "mode") for p in disagreements(leaves(api)[path], leaves(workload)[path])]
    assert problems == [
        "maximum: API '<unset>' != workload 10",
        "default: API 8 != workload 5",
        "enum: API ['a', 'b'] != workload ['a', 'c']",
    ]


def test_a_capped_maximum_must_stay_below_the_workloads() -> None:
    """A declared cap: a lower API maximum agrees, an equal or higher one (or none) does not."""
    workload = {"type": "integer", "minimum": 1, "maximum": 100}
    assert capped_disagreements({"type": "integer", "minimum": 1, "maximum": 10}, workload) == []
    assert capped_disagreements({"type": "integer", "minimum": 1, "maximum": 100}, workload) == [
        "maximum: API 100 is not below workload 100 (declared capped)"
    ]
    assert capped_disagreements({"type": "integer", "minimum": 0}, workload) == [
        "minimum: API 0 != workload 1",
        "maximum: API '<unset>' is not below workload 100 (declared capped)",
    ]


def test_builtin_handler_names_are_one_list_and_each_resolves_to_a_model() -> None:
    assert handlers.BUILTINS.keys() == set(BUILTIN_HANDLERS)
    for name in BUILTIN_HANDLERS:
        assert issubclass(handlers.load_handler_class(name), Model)
    description = InferenceServiceSpec.model_fields["handler"].description or ""
    assert all(name in description for name in BUILTIN_HANDLERS)


def test_there_are_example_training_jobs() -> None:
    assert {"deepspeed", "fsdp"} <= {doc["spec"]["engine"] for _, doc in EXAMPLE_JOBS}


@pytest.mark.parametrize(("name", "doc"), EXAMPLE_JOBS, ids=[name for name, _ in EXAMPLE_JOBS])
def test_example_training_jobs_render_their_values_unchanged(name: str, doc: dict[str, Any]) -> None:
    spec = resolved(TrainingJobSpec.model_validate(doc["spec"]))
    config = trainer_config(spec)
    assert TrainerConfig.model_validate_json(config.to_json()) == config  # what the pod reads back
    assert config.engine == spec.engine
    if spec.fsdp is not None:
        assert config.fsdp.sharding == spec.fsdp.sharding
    if spec.checkpoint is not None:
        assert config.checkpoint is not None
        assert config.checkpoint.every_minutes == spec.checkpoint.every_minutes
    if spec.tracking is not None and spec.tracking.mlflow is not None:
        assert config.tracking.mlflow is not None
        assert config.tracking.mlflow.experiment == spec.tracking.mlflow.experiment
