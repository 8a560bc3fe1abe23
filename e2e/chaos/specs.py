"""Fuzzed custom resources: hypothesis strategies driven by the CRD schemas generated from the pydantic models.

`valid_specs(kind)` draws specs that satisfy the structural schema (types, enums, ranges, lengths, patterns) and,
after a small per-kind repair, the CEL rules too; `cases(kind, n)` turns them into admission cases, most of them
mutated to be invalid in one place (a wrong type, a value out of range, an unknown field, a required field
dropped, ...). Each case says whether the mutation breaks the schema itself, so a test can insist that the API
server refuses it and names the field.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import random
import string
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from loom.operator.api.crd import crd_filename, crd_for
from loom.operator.api.kinds import KINDS, Kind

CRDS = Path(__file__).resolve().parents[2] / "crds"
Schema = dict[str, Any]
FieldPath = tuple[str | int, ...]

# Generated collections and strings stay small: admission cost grows with size, and the interesting bugs are in
# the shapes, not the lengths (the mutations test the length limits separately).
MAX_ITEMS = 3
MAX_TEXT = 24
_TEXT = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), max_size=MAX_TEXT)
_KEY = st.text(alphabet=string.ascii_lowercase + string.digits + "-_.", min_size=1, max_size=12)
_SCALAR: st.SearchStrategy[Any] = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**31), 2**31), st.floats(allow_nan=False, allow_infinity=False), _TEXT
)


def kind_named(name: str) -> Kind:
    return next(k for k in KINDS if k.kind == name)


def spec_schema(kind: Kind) -> Schema:
    """The openAPIV3Schema of `spec` exactly as the API server has it: the CRD in crds/ (generated from the models,
    checked against them by tests/unit/test_crds.py), so a model change not yet generated cannot skew the fuzz."""
    path = CRDS / crd_filename(kind)
    crd = yaml.safe_load(path.read_text()) if path.is_file() else crd_for(kind)
    return dict(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"])


@functools.cache
def cel_messages(kind_name: str) -> tuple[str, ...]:
    """The messages of every CEL rule (x-kubernetes-validations) in a kind's spec schema."""
    found: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            found.extend(str(rule["message"]) for rule in node.get("x-kubernetes-validations", []) if "message" in rule)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(spec_schema(kind_named(kind_name)))
    return tuple(found)


def from_schema(schema: Schema) -> st.SearchStrategy[Any]:
    """Values valid against one structural-schema node (CEL rules aside)."""
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if schema.get("x-kubernetes-int-or-string"):
        # A quantity carries the API server's own pattern (no "%"); a count-or-percentage carries none.
        strings = r"\A[1-9][0-9]{0,3}(m|Mi|Gi)?\Z" if "pattern" in schema else r"\A[1-9][0-9]{0,3}(m|Mi|Gi|%)?\Z"
        return st.one_of(st.integers(0, 64), st.from_regex(strings))
    if "anyOf" in schema and "type" not in schema:
        rest = {k: v for k, v in schema.items() if k != "anyOf"}
        return st.one_of([from_schema({**rest, **option}) for option in schema["anyOf"]])
    kind = schema.get("type")
    if kind == "object":
        return _object(schema)
    if kind == "array":
        items = from_schema(schema.get("items", {}))
        low = schema.get("minItems", 0)
        return st.lists(items, min_size=low, max_size=max(low, min(schema.get("maxItems", MAX_ITEMS), MAX_ITEMS)))
    if kind == "string":
        return _string(schema)
    if kind == "integer":
        low = schema.get("minimum", -(2**20))
        high = schema.get("maximum", low + 2**20)
        if schema.get("exclusiveMinimum"):
            low += 1
        if schema.get("exclusiveMaximum"):
            high -= 1
        return st.integers(low, high)
    if kind == "number":
        low = schema.get("minimum", -1e6)
        high = schema.get("maximum", low + 1e6)
        return st.floats(
            low,
            high,
            exclude_min=bool(schema.get("exclusiveMinimum")),
            exclude_max=bool(schema.get("exclusiveMaximum")),
            allow_nan=False,
        )
    if kind == "boolean":
        return st.booleans()
    return _SCALAR


def _object(schema: Schema) -> st.SearchStrategy[Any]:
    props: dict[str, Schema] = schema.get("properties", {})
    if props:
        required = set(schema.get("required", []))
        return st.fixed_dictionaries(
            {k: from_schema(v) for k, v in props.items() if k in required},
            optional={k: from_schema(v) for k, v in props.items() if k not in required},
        )
    low = schema.get("minProperties", 0)
    high = max(low, min(schema.get("maxProperties", MAX_ITEMS), MAX_ITEMS))
    if "additionalProperties" in schema:
        return st.dictionaries(_KEY, from_schema(schema["additionalProperties"]), min_size=low, max_size=high)
    # x-kubernetes-preserve-unknown-fields: anything JSON-shaped is kept as written.
    return st.dictionaries(_KEY, _SCALAR, min_size=low, max_size=high)


def _string(schema: Schema) -> st.SearchStrategy[str]:
    low, high = schema.get("minLength", 0), schema.get("maxLength", 10**6)
    if "pattern" in schema:
        pattern: str = schema["pattern"]  # a str pattern draws str
        return st.from_regex(pattern, fullmatch=True).filter(lambda s: low <= len(s) <= high)
    return st.text(
        alphabet=st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")),
        min_size=low,
        max_size=max(low, min(high, MAX_TEXT)),
    )


# ------------------------------------------------------------------------------------------------- CEL repairs
# The structural schema cannot express the cross-field rules; without these repairs nearly every drawn object
# would be refused by one of them and the accepted path would go untested.


def _repair_trainingjob(spec: dict[str, Any], rnd: random.Random) -> None:
    entry = spec["entrypoint"]
    if ("module" in entry) == ("command" in entry):
        entry.pop("command", None)
        entry["module"] = "loom.workloads.trainer.examples.chargpt:task"
    workers = spec.get("workers")
    if workers is not None:
        replicas = workers.setdefault("replicas", 1)
        if workers.get("minReplicas", 0) > replicas:
            workers["minReplicas"] = replicas
        if "maxReplicas" in workers and workers["maxReplicas"] < replicas:
            workers["maxReplicas"] = replicas
    for engine in ("deepspeed", "fsdp"):
        if engine in spec and spec["engine"] != engine:
            del spec[engine]
    ckpt = spec.get("checkpoint")
    if ckpt and "resume" in ckpt and not (ckpt["resume"] in ("latest", "none") or ckpt["resume"].startswith("s3://")):
        ckpt["resume"] = rnd.choice(["latest", "none", "s3://b/ckpt-1"])
    # register: where the model is exported and the registry; finetune: a checkpoint that is not a Hugging Face
    # export, one base source, and lora (qlora needs GPU workers).
    if "register" in spec and not (ckpt and (spec.get("tracking") or {}).get("mlflow")):
        del spec["register"]
    finetune = spec.get("finetune")
    if finetune is not None:
        if not ckpt:
            del spec["finetune"]
        else:
            ckpt.pop("exportFormat", None)
            finetune["method"] = "lora"
            base = finetune.setdefault("baseModel", {})
            sources = [k for k in ("uri", "mlflow", "fromTrainingJob") if k in base]
            keep = rnd.choice(sources) if sources else "uri"
            for key in sources:
                if key != keep:
                    del base[key]
            base.setdefault(keep, "s3://models/base")


def _repair_inferenceservice(spec: dict[str, Any], rnd: random.Random) -> None:
    model = spec["model"]
    sources = [k for k in ("uri", "mlflow", "fromTrainingJob") if k in model]
    keep = rnd.choice(sources) if sources else "uri"
    for key in sources:
        if key != keep:
            del model[key]
    model.setdefault(keep, "s3://models/fuzz")
    uri = str(model.get("uri", ""))
    if not (uri.startswith("oci://") and "@sha256:" in uri):  # credentials only for an image pinned by digest
        model.pop("pullSecretName", None)
    if spec.get("runtime") != "vllm":  # adapters and routing are the vllm runtime's
        spec.pop("adapters", None)
        spec.pop("routing", None)
    routing = spec.get("routing")
    if routing is not None and routing.get("prefixMatch") == "events":  # the engines' events need prefix-cache
        routing["policy"] = "prefix-cache"
        vllm = spec.get("vllm") or {}
        if "extraArgs" in vllm:  # and Loom passes the engine its --kv-events-config
            vllm["extraArgs"] = [a for a in vllm["extraArgs"] if not str(a).startswith("--kv-events-config")]
    if spec.get("autoscaling") is not None:
        _repair_autoscaling(spec["autoscaling"])
    if isinstance(spec.get("vllm"), dict) and spec["vllm"].get("disaggregation") is not None:
        _repair_disaggregation(spec)


def _repair_disaggregation(spec: dict[str, Any]) -> None:
    """Two pools take none of what admission refuses beside them (inferenceservice/api.py, llm/api.py)."""
    for key in ("replicas", "autoscaling", "adapters"):
        spec.pop(key, None)
    for key in ("canaryPercent", "analysis"):
        (spec.get("rollout") or {}).pop(key, None)
    (spec.get("routing") or {}).pop("inferencePool", None)
    vllm = spec["vllm"]
    vllm.pop("parallelism", None)
    if "extraArgs" in vllm:
        loom_sets = ("--kv-transfer-config", "--enable-chunked-prefill", "--no-enable-chunked-prefill")
        vllm["extraArgs"] = [a for a in vllm["extraArgs"] if str(a).split("=", 1)[0] not in loom_sets]


def _repair_autoscaling(auto: dict[str, Any]) -> None:
    if auto.get("minReplicas", 1) > auto["maxReplicas"]:
        auto["minReplicas"] = auto["maxReplicas"]
    if auto.get("metric", "concurrency") == "prometheus":
        auto.setdefault("query", "sum(up)")
    else:
        auto.pop("query", None)
    if auto.get("minReplicas", 1) != 0:
        auto.pop("idleSeconds", None)


def _repair_inferencegraph(spec: dict[str, Any], rnd: random.Random) -> None:
    auto = (spec.get("router") or {}).get("autoscaling")
    if auto is not None:  # the router's own rules: never to zero, engine builtin, its own metrics
        auto["minReplicas"] = max(1, auto.get("minReplicas", 1))
        auto["engine"] = "builtin"
        if auto.get("metric", "concurrency") not in ("concurrency", "requests-per-second", "prometheus"):
            auto["metric"] = "concurrency"
        _repair_autoscaling(auto)
    nodes: dict[str, Any] = spec["nodes"]
    if "root" not in nodes:
        nodes["root"] = nodes.pop(next(iter(nodes)))
    for node in nodes.values():
        for step in node["steps"]:
            target = step.get("nodeName")
            if ("serviceName" in step) == ("nodeName" in step) or (target is not None and target not in nodes):
                step.pop("nodeName", None)
                step["serviceName"] = step.get("serviceName") or "svc"
            retrieve = step.get("retrieve")
            if retrieve is not None and "nodeName" in step:
                step.pop("retrieve")
            elif retrieve is not None:  # a chat prompt: an openai-chat step, a template with both placeholders
                step["protocol"] = "openai-chat"
                template = str(retrieve.get("promptTemplate", ""))[:8100]
                for placeholder in ("{context}", "{question}"):
                    if placeholder not in template:
                        template += placeholder
                retrieve["promptTemplate"] = template
        if node["routerType"] == "Splitter":
            weights = [100 // len(node["steps"])] * len(node["steps"])
            weights[0] += 100 - sum(weights)
            for step, weight in zip(node["steps"], weights, strict=True):
                step["weight"] = weight


def _repair_featureview(spec: dict[str, Any], rnd: random.Random) -> None:
    entities = {e["name"] for e in spec["entities"]}
    for index, feature in enumerate(spec["features"]):
        if feature["name"] in entities:
            feature["name"] = f"f_{index}"
    schedule = spec.get("materialization", {}).get("schedule")
    if schedule is not None and schedule.startswith("@every"):
        spec["materialization"]["schedule"] = "@hourly"
    online = spec.get("store", {}).get("online")
    if online and online.get("type") == "redis":
        online.setdefault("connectionSecretRef", {"name": "redis", "key": "url"})


REPAIRS: dict[str, Callable[[dict[str, Any], random.Random], None]] = {
    "TrainingJob": _repair_trainingjob,
    "InferenceService": _repair_inferenceservice,
    "InferenceGraph": _repair_inferencegraph,
    "FeatureView": _repair_featureview,
}


# ----------------------------------------------------------------------------------------------------- mutations


@dataclass(frozen=True)
class Mutation:
    name: str
    path: FieldPath  # where the object was changed (for unknown-field: the object that gained the field)
    # The structural schema alone refuses it: admission must reject it and name the field.
    schema_breaking: bool


def _nodes(doc: Any, schema: Schema, path: FieldPath = ()) -> list[tuple[FieldPath, Any, Schema]]:
    """Every (path, value, schema) of the document, the root included."""
    out = [(path, doc, schema)]
    if isinstance(doc, dict):
        props = schema.get("properties")
        for key, value in doc.items():
            sub = props.get(key) if props is not None else schema.get("additionalProperties")
            if isinstance(sub, dict):
                out += _nodes(value, sub, (*path, key))
    elif isinstance(doc, list) and isinstance(schema.get("items"), dict):
        for index, value in enumerate(doc):
            out += _nodes(value, schema["items"], (*path, index))
    return out


def _set(doc: Any, path: FieldPath, value: Any) -> None:
    for part in path[:-1]:
        doc = doc[part]
    doc[path[-1]] = value


def _wrong_type(schema: Schema) -> Any:
    kind = schema.get("type")
    wrong = {"string": 12345, "integer": "twelve", "number": "1.5x", "boolean": "yes", "object": [1], "array": {"a": 1}}
    return wrong[str(kind)]


def _out_of_range(schema: Schema, rnd: random.Random) -> Any | None:
    if "enum" in schema:
        return "not-" + str(schema["enum"][0]) + "-zz"
    kind = schema.get("type")
    if kind in ("integer", "number"):
        options = []
        if "minimum" in schema:
            options.append(schema["minimum"] - 1)
        if "maximum" in schema:
            options.append(schema["maximum"] + 1)
        return rnd.choice(options) if options else None
    if kind == "string":
        if "maxLength" in schema and schema["maxLength"] <= 4096:
            return "a" * (schema["maxLength"] + 1)
        if "pattern" in schema:
            return "Not A Valid Value!"
    if kind == "array" and "maxItems" in schema and schema["maxItems"] <= 64 and isinstance(schema.get("items"), dict):
        return [None] * (schema["maxItems"] + 1)
    return None


MUTATIONS = ("wrong-type", "out-of-range", "unknown-field", "drop-required", "null", "deep-nesting")


_TYPES = ("string", "integer", "number", "boolean", "object", "array")


def _free(schema: Schema) -> bool:
    return bool(schema.get("x-kubernetes-int-or-string") or schema.get("x-kubernetes-preserve-unknown-fields"))


def _applies(op: str, path: FieldPath, value: Any, sub: Schema) -> bool:
    if op == "wrong-type":
        return bool(path) and not _free(sub) and sub.get("type") in _TYPES
    if op == "out-of-range":
        return bool(path) and not _free(sub) and _out_of_range(sub, random.Random(0)) is not None
    if op == "unknown-field":
        return isinstance(value, dict) and "properties" in sub
    if op == "drop-required":
        return isinstance(value, dict) and any(key in value for key in sub.get("required", []))
    if op == "null":
        return bool(path)
    return bool(path) and _free(sub)  # deep-nesting: only free-form fields take arbitrary shapes


def mutate(spec: dict[str, Any], schema: Schema, rnd: random.Random) -> tuple[dict[str, Any], Mutation]:
    """One change to a valid spec (the operation first, then a place it applies to); the path is relative to
    `spec`."""
    doc = copy.deepcopy(spec)
    nodes = _nodes(doc, schema)
    for op in rnd.sample(MUTATIONS, len(MUTATIONS)):
        places = [node for node in nodes if _applies(op, *node)]
        if not places:
            continue
        path, value, sub = rnd.choice(places)
        if op == "wrong-type":
            _set(doc, path, _wrong_type(sub))
        elif op == "out-of-range":
            _set(doc, path, _out_of_range(sub, rnd))
        elif op == "unknown-field":
            value["unknownFuzzField"] = rnd.choice([1, "x", {"a": [1]}])
        elif op == "drop-required":
            del value[rnd.choice([key for key in sub["required"] if key in value])]
        elif op == "null":
            # The API server may drop a null (optional fields) or refuse it: either is fine, a crash is not.
            _set(doc, path, None)
        else:
            nested: Any = "bottom"
            for _ in range(rnd.choice([10, 60, 200])):
                nested = {"n": [nested]}
            _set(doc, path, nested)
        return doc, Mutation(op, path, op not in ("null", "deep-nesting"))
    raise AssertionError("no mutation applies")  # unreachable: unknown-field always applies to the root


def k8s_path(path: FieldPath) -> str:
    """A field path as the API server writes it in errors: spec.workers.replicas, spec.env[0].name."""
    out = "spec"
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


# --------------------------------------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    kind: str
    spec: dict[str, Any]
    mutation: Mutation | None  # None: a valid object (schema and CEL), which admission must accept

    @property
    def schema_breaking(self) -> bool:
        return self.mutation is not None and self.mutation.schema_breaking

    def label(self) -> str:
        return "valid" if self.mutation is None else self.mutation.name


class _Enough(Exception):
    """Raised inside the hypothesis-driven draw once enough cases are kept (hypothesis would keep drawing)."""


def cases(kind_name: str, count: int, *, seed: int = 0, mutations_per_spec: int = 3) -> list[Case]:
    """`count` distinct cases for one kind, drawn by hypothesis (deterministic for a seed): each drawn valid spec
    gives itself and `mutations_per_spec` mutations of it."""
    kind = kind_named(kind_name)
    schema = spec_schema(kind)
    repair = REPAIRS[kind_name]
    drawn: list[Case] = []
    seen: set[str] = set()

    def keep(case: Case) -> None:
        key = json.dumps([case.spec, case.label()], sort_keys=True, default=str)
        if key not in seen and len(drawn) < count:
            seen.add(key)
            drawn.append(case)

    @settings(
        max_examples=count * 4,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
        deadline=None,
    )
    @hypothesis_seed(seed)
    @given(spec=from_schema(schema), salt=st.integers(0, 2**32))
    def draw(spec: dict[str, Any], salt: int) -> None:
        # Mutations use a plain Random seeded by hypothesis: drawing from hypothesis after the example would make
        # its data depend on how many cases were kept.
        rnd = random.Random(salt)
        repair(spec, rnd)
        keep(Case(kind_name, spec, None))
        for _ in range(mutations_per_spec):
            mutated, mutation = mutate(spec, schema, rnd)
            keep(Case(kind_name, mutated, mutation))
        if len(drawn) >= count:
            raise _Enough

    with contextlib.suppress(_Enough):
        draw()
    return drawn


def manifest(case: Case, name: str) -> dict[str, Any]:
    return {"apiVersion": "loom.dev/v1alpha1", "kind": case.kind, "metadata": {"name": name}, "spec": case.spec}


def tame(case: Case, kwok_toleration: dict[str, str]) -> dict[str, Any]:
    """The spec made cheap to create for real on the local stack (the fuzzed fields stay): pods only on kwok nodes,
    at most two replicas, so a storm of objects never starts real processes or thousands of simulated pods."""
    spec = copy.deepcopy(case.spec)
    placement = {"nodeSelector": {"type": "kwok"}, "tolerations": [kwok_toleration]}
    if case.kind == "TrainingJob" and isinstance(spec.get("workers"), dict):
        workers = spec["workers"]
        workers.update(placement)
        if isinstance(workers.get("replicas"), int):
            workers["replicas"] = min(workers["replicas"], 2)
            for key in ("minReplicas", "maxReplicas"):
                if isinstance(workers.get(key), int):
                    workers[key] = workers["replicas"]
    elif case.kind == "TrainingJob":
        spec["workers"] = placement
    if case.kind == "InferenceService":
        spec.update(placement)
        if isinstance(spec.get("replicas"), int):
            spec["replicas"] = min(spec["replicas"], 2)
        split = (spec.get("vllm") or {}).get("disaggregation") if isinstance(spec.get("vllm"), dict) else None
        for pool in ("prefill", "decode"):  # each pool of a disaggregated service has its own replicas
            part = split.get(pool) if isinstance(split, dict) else None
            if isinstance(part, dict) and isinstance(part.get("replicas"), int):
                part["replicas"] = min(part["replicas"], 2)
        auto = spec.get("autoscaling")
        if isinstance(auto, dict) and isinstance(auto.get("maxReplicas"), int):
            auto["maxReplicas"] = min(auto["maxReplicas"], 2)
            if isinstance(auto.get("minReplicas"), int):
                auto["minReplicas"] = min(auto["minReplicas"], auto["maxReplicas"])
    for kind, key, most in (("InferenceGraph", "router", 2), ("FeatureView", "server", 1)):
        part = spec.get(key)
        if case.kind == kind and isinstance(part, dict) and isinstance(part.get("replicas"), int):
            part["replicas"] = min(part["replicas"], most)
    return spec
