"""The TrainingJob and InferenceService files in examples/, applied as a new user would, on the local stack.

Each file is applied unchanged (`kubectl apply -n <ns> -f examples/<file>`) next to what `loom dev up` provides
for the examples (loom.devstack.backing: S3 as minio.storage.svc, MLflow as mlflow.mlops.svc, the Secret
s3-credentials) and the operator installed from the Helm chart, which runs in the cluster and so resolves those
names like any pod. The namespace is a fresh one (what `-n` does for a user; the Secret is created there as the
README says), so parallel sessions and a person's own `default` are never touched.

CPU examples run to the outcome a user waits for: a TrainingJob Succeeded with its checkpoint in S3 and its run
in MLflow; an InferenceService Ready and answering a request through its Service. Examples that need GPUs
(`gpusPerWorker`, `gpus`) are accepted by the API server (server-side dry run: schema and CEL rules), but cannot
run here: the local stack's GPUs are on kwok nodes, which carry kwok's taint, and the examples name real GPU
nodes' labels (and Volcano for the gang); the e2e tests of the GPU paths (test_trainingjob_kwok.py,
test_inferenceservice_gpu.py) add kwok's toleration instead. The GPU autoscaling example is also run, on the stack's
simulated GPU node (below).

The operator is installed by the README's local-stack `helm install` (readme_install.local_install_command: the
stack's Prometheus as prometheus.url, the endpoint defaults), only the release, its namespace and the watched
namespace renamed. So the autoscaling examples are held to what a user gets: the queue-depth example, idle after
its first request, goes to zero once the stack's Prometheus has shown an empty queue for its idleSeconds (with no
metric it holds one replica forever); the GPU example, applied unchanged, scales up on GPU utilisation
(`test_gpu_autoscaling_example_scales_up_on_its_metric`: the README's commands, on the stack's simulated GPU node and
dcgm-exporter stand-in, loom.devstack.simgpu, whose utilisation the README's `loom dev gpu-utilization` sets).

Other example kinds join by adding their glob to EXAMPLES and an outcome to `test_example_runs`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from loom.devstack import backing, simgpu
from loom.devstack.agent.proxies import service_address
from loom.devstack.cluster import Cluster
from loom.devstack.cluster.handle import wait_until
from loom.devstack.cluster.paths import AGENT_STATE_DIR
from loom.e2e.autoscaling import ready_pods
from loom.e2e.helm_operator import InClusterOperator, operator_in_cluster, wait_default_service_account
from loom.e2e.pytest_operator import apply_crds
from loom.e2e.readme_install import LOCAL_SECTION, commands, local_install_command, page_section

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1200)]

EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples"
# Run as written by their own e2e module, which sets up what they need first: the feature-enriched service needs its
# FeatureView registered and materialized (test_featureview_enrichment.py applies both example files unchanged); the
# adapters example needs its base model and peft adapters in S3 (test_inferenceservice_adapters.py puts them where it
# says, applies it unchanged, then adds and removes adapters in the running replica).
ELSEWHERE = {"inferenceservice-feature-enriched.yaml", "inferenceservice-llama-vllm-adapters.yaml"}
EXAMPLES = sorted(
    p
    for p in [*EXAMPLES_DIR.glob("trainingjob-*.yaml"), *EXAMPLES_DIR.glob("inferenceservice-*.yaml")]
    if p.name not in ELSEWHERE
)
API_KEY = f"key-{uuid.uuid4().hex}"


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def needs_gpu(doc: dict[str, Any]) -> bool:
    spec = doc.get("spec") or {}
    return bool((spec.get("workers") or {}).get("gpusPerWorker") or spec.get("gpus"))


def runs_elsewhere(doc: dict[str, Any]) -> bool:
    """A TrainingJob on point-in-time features runs, unchanged, in test_trainingjob_features.py (with its
    FeatureView); here it is only checked to be accepted as written."""
    return bool((doc.get("spec") or {}).get("trainingData"))


def example_defining(kind: str, name: str) -> Path:
    """The example file that holds `kind/name` (an InferenceService example may serve a TrainingJob example)."""
    for path in EXAMPLES:
        if any(d["kind"] == kind and d["metadata"]["name"] == name for d in documents(path)):
            return path
    raise AssertionError(f"no file in examples/ defines {kind} {name}")


def example_registering(model_uri: str) -> Path | None:
    """The TrainingJob example whose registration moves the alias `models:/<model>@<alias>` names (None: not an
    alias, or a registered model no example trains)."""
    if not model_uri.startswith("models:/") or "@" not in model_uri:
        return None
    model, alias = model_uri.removeprefix("models:/").split("@", 1)
    for path in EXAMPLES:
        for doc in documents(path):
            register = (doc.get("spec") or {}).get("register") or {}
            if doc["kind"] == "TrainingJob" and (register.get("model"), register.get("alias")) == (model, alias):
                return path
    return None


def mlflow_call(services: backing.BackingServices, method: str, path: str, **kwargs: Any) -> httpx.Response:
    return httpx.request(method, f"{services.mlflow_url}/api/2.0/mlflow/{path}", timeout=30, trust_env=False, **kwargs)


def get(cluster: Cluster, namespace: str, kind: str, name: str) -> dict[str, Any]:
    result = cluster.kubectl("get", kind, name, "-n", namespace, "-o", "json", check=False)
    return dict(json.loads(result.stdout)) if result.returncode == 0 else {}


def conditions(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in (obj.get("status") or {}).get("conditions", [])}


def api_key_secrets() -> set[str]:
    """The API-key Secrets the InferenceService examples name (their comments tell a user to create each)."""
    return {
        ref["name"]
        for path in EXAMPLES
        for doc in documents(path)
        if (ref := ((doc.get("spec") or {}).get("auth") or {}).get("apiKeysSecretRef"))
    }


@pytest.fixture(scope="module")
def services(cluster: Cluster) -> backing.BackingServices:
    """What `loom dev up` provides for the examples (idempotent: a stack started by `loom dev up` has it)."""
    return backing.ensure(cluster, progress=lambda line: print(f"[examples] {line}"))


@pytest.fixture(scope="module")
def examples_namespace(
    cluster: Cluster, services: backing.BackingServices, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, InClusterOperator]]:
    ns = f"ex{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", ns)
    wait_default_service_account(cluster, ns)
    # What the examples' comments and the README tell a user to create in a namespace other than default.
    cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump(backing.credentials_secret(ns)))
    for secret in api_key_secrets():
        cluster.kubectl("create", "secret", "generic", secret, "-n", ns, f"--from-literal=keys={API_KEY}")
    # The CRDs as in this checkout first, so the chart's copy of them installs over what a session applied before.
    apply_crds(cluster)
    try:
        workdir = tmp_path_factory.mktemp("examples-helm")
        with operator_in_cluster(cluster, [ns], workdir=workdir, command=local_install_command()) as operator:
            yield ns, operator
            cluster.kubectl("delete", "loom", "--all", "-n", ns, "--timeout=90s", check=False)
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def apply(cluster: Cluster, namespace: str, path: Path, services: backing.BackingServices) -> None:
    """`kubectl apply -f` the file. A TrainingJob resumes from the newest checkpoint under its URI, also one an
    earlier run of the same example left there (then it would resume another job's finished run): as on a
    fresh `loom dev up`, a TrainingJob new to this namespace starts with nothing under its checkpoint URI."""
    for doc in documents(path):
        uri = ((doc.get("spec") or {}).get("checkpoint") or {}).get("uri", "")
        if doc["kind"] == "TrainingJob" and uri and not get(cluster, namespace, "trainingjob", doc["metadata"]["name"]):
            bucket, prefix = uri.removeprefix("s3://").split("/", 1)
            s3 = services.s3_client()
            for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
                for item in page.get("Contents", []):
                    s3.delete_object(Bucket=bucket, Key=item["Key"])
            # Likewise its registered model: versions an earlier run registered name exports deleted just now.
            register = doc["spec"].get("register") or {}
            if register:
                mlflow_call(services, "DELETE", "registered-models/delete", json={"name": register["model"]})
    cluster.kubectl("apply", "-n", namespace, "-f", str(path))


def wait_for(cluster: Cluster, ns: str, kind: str, name: str, done: Any, operator: InClusterOperator) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        obj = get(cluster, ns, kind, name)
        return obj if obj and done(obj) else None

    try:
        return dict(wait_until(check, timeout=900, what=f"{kind} {name}", interval=2))
    except TimeoutError as error:
        status = json.dumps(get(cluster, ns, kind, name).get("status"), indent=1)
        pods = cluster.kubectl("get", "pods", "-n", ns, "-o", "wide", check=False).stdout
        raise AssertionError(f"{error}\nstatus: {status}\n{pods}\n{operator.log_tail()}") from None


def check_training_job(
    cluster: Cluster, ns: str, doc: dict[str, Any], services: backing.BackingServices, operator: InClusterOperator
) -> None:
    name, spec = doc["metadata"]["name"], doc["spec"]
    job = wait_for(
        cluster,
        ns,
        "trainingjob",
        name,
        lambda o: (o.get("status") or {}).get("phase") in ("Succeeded", "Failed"),
        operator,
    )
    status = job["status"]
    assert status["phase"] == "Succeeded", json.dumps(status, indent=1)
    # The checkpoint the status names is in the store the example names, under its prefix.
    latest = status["checkpoint"]["latest"]
    prefix = spec["checkpoint"]["uri"]
    assert latest.startswith(prefix + "/"), (latest, prefix)
    bucket, key = latest.removeprefix("s3://").split("/", 1)
    listed = services.s3_client().list_objects_v2(Bucket=bucket, Prefix=key)
    assert listed.get("KeyCount", 0) > 0, f"nothing in S3 under {latest}"
    # And the run is in MLflow, finished, with the loss curve.
    run_id = status["mlflow"]["runId"]
    response = httpx.get(
        f"{services.mlflow_url}/api/2.0/mlflow/runs/get", params={"run_id": run_id}, timeout=30, trust_env=False
    )
    assert response.status_code == 200, response.text
    run = response.json()["run"]
    assert run["info"]["status"] == "FINISHED"
    assert any(m["key"] == "loss" for m in run["data"].get("metrics", [])), run["data"]
    if spec.get("finetune"):
        # A fine-tune exports its LoRA adapter in peft's format, the folder vLLM loads.
        bucket, key = f"{prefix}/final".removeprefix("s3://").split("/", 1)
        listed = services.s3_client().list_objects_v2(Bucket=bucket, Prefix=key + "/")
        names = {item["Key"].rsplit("/", 1)[-1] for item in listed.get("Contents", [])}
        assert {"adapter_config.json", "adapter_model.safetensors"} <= names, names
    register = spec.get("register")
    if register:
        # Registered: one version of the model, the job's run, its alias moved to it.
        registered = wait_for(cluster, ns, "trainingjob", name,
                              lambda o: (o.get("status") or {}).get("registeredModel", {}).get("version"), operator)
        version = registered["status"]["registeredModel"]["version"]
        if register.get("alias"):
            found = mlflow_call(services, "GET", "registered-models/alias",
                                params={"name": register["model"], "alias": register["alias"]})
        else:  # registered with no alias (the LoRA fine-tune): the version the status names
            found = mlflow_call(services, "GET", "model-versions/get",
                                params={"name": register["model"], "version": version})
        assert found.status_code == 200, found.text
        assert found.json()["model_version"]["version"] == version
        assert found.json()["model_version"]["run_id"] == run_id
        assert found.json()["model_version"]["source"] == f"{prefix}/final"


def check_inference_service(
    cluster: Cluster, ns: str, doc: dict[str, Any], operator: InClusterOperator, version: str | None = None
) -> None:
    """Ready and answering; `version`: the model version it must serve (and answer with)."""
    name, spec = doc["metadata"]["name"], doc["spec"]

    def ready(obj: dict[str, Any]) -> bool:
        conds = conditions(obj)
        up = conds.get("Ready", {}).get("status") == "True" and obj["status"].get("phase") == "Ready"
        return bool(up and (version is None or obj["status"].get("modelVersion") == version))

    obj = wait_for(cluster, ns, "inferenceservice", name, ready, operator)
    if version is not None and spec["model"].get("mlflow"):
        assert obj["status"]["alias"]["version"] == version, obj["status"]["alias"]
    if spec.get("routing"):
        # Its endpoint picker takes the Service once the picker is Ready: the requests below go through it.
        wait_for(cluster, ns, "service", name, lambda svc: svc["spec"]["selector"].get(
            "app.kubernetes.io/component") == "picker", operator)
    headers = {}
    if (spec.get("auth") or {}).get("apiKeysSecretRef"):
        headers["Authorization"] = f"Bearer {API_KEY}"
    response = httpx.post(
        f"http://{service_address(name, ns, AGENT_STATE_DIR)}:80/v2/models/{name}/generate",
        json={"text_input": "The ", "parameters": {"max_tokens": 16, "temperature": 0}},
        headers=headers,
        timeout=60,
        trust_env=False,
    )
    assert response.status_code == 200, response.text
    assert isinstance(response.json()["text_output"], str) and response.json()["text_output"]
    if version is not None:
        assert response.json()["model_version"] == version
    if spec.get("runtime") == "vllm":
        check_openai_stream(f"http://{service_address(name, ns, AGENT_STATE_DIR)}:80/v1", name)


def check_openai_stream(base_url: str, model: str) -> None:
    """What the vllm example's comment shows: the official `openai` client streams a chat completion (SSE through
    the Service to Loom's front and the vLLM engine), with usage at the end."""
    import openai

    llm = openai.OpenAI(base_url=base_url, api_key=API_KEY, max_retries=0, timeout=120)
    chunks = list(llm.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Tom painted"}], max_tokens=8, stream=True,
        stream_options={"include_usage": True},
    ))  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert text and usage is not None and 0 < usage.completion_tokens <= 8, chunks


def events_of(cluster: Cluster, ns: str, name: str, reason: str) -> list[str]:
    out = cluster.kubectl(
        "get", "events", "-n", ns, "--field-selector", f"involvedObject.name={name},reason={reason}", "-o", "json"
    ).stdout
    return [str(e["message"]) for e in json.loads(out)["items"]]


def check_idles_to_zero_on_its_metric(
    cluster: Cluster, ns: str, doc: dict[str, Any], operator: InClusterOperator
) -> None:
    """Scale to zero is a decision on the metric: idle time counts only while the queue depth is read (a missing
    metric holds the replicas), so reaching zero proves the operator reads the stack's Prometheus."""
    name = doc["metadata"]["name"]
    idle = doc["spec"]["autoscaling"]["idleSeconds"]

    def read(obj: dict[str, Any]) -> bool:
        auto = (obj.get("status") or {}).get("autoscaling") or {}
        return conditions(obj).get("MetricsAvailable", {}).get("status") == "True" and auto.get("metricValue") == 0

    seen = wait_for(cluster, ns, "inferenceservice", name, read, operator)
    assert seen["status"]["autoscaling"]["metric"] == "queue-depth"
    at_zero = wait_for(
        cluster, ns, "inferenceservice", name,
        lambda o: ((o.get("status") or {}).get("autoscaling") or {}).get("lastScaleReason") == "ScaledToZero",
        operator,
    )  # fmt: skip
    assert at_zero["spec"]["replicas"] == 0
    zeroed = events_of(cluster, ns, name, "ScaledToZero")
    assert any(m.startswith("replicas 1 -> 0") and f"{idle:g}s" in m for m in zeroed), zeroed


def test_gpu_autoscaling_example_scales_up_on_its_metric(
    cluster: Cluster, services: backing.BackingServices, examples_namespace: tuple[str, InClusterOperator]
) -> None:
    """examples/inferenceservice-autoscale-gpu.yaml with exactly the README's local-stack commands (the chart's
    install, `kubectl apply`, `loom dev gpu-utilization`), only the namespace given: its replica lands on the stack's
    simulated GPU node; the stack's dcgm-exporter stand-in reports the utilisation set for it to the stack's
    Prometheus; 90% against the 60% target scales 1 -> 2, and status and the event name the metric."""
    ns, operator = examples_namespace
    apply_cmd, set_cmd = readme_gpu_autoscaling_commands()
    at = apply_cmd.index("-f") + 1
    path = apply_cmd[at] = str(EXAMPLES_DIR.parent / apply_cmd[at])  # the README's path is the checkout's
    (doc,) = documents(Path(path))
    name = doc["metadata"]["name"]
    assert set_cmd[set_cmd.index("-n") + 2] == name, set_cmd  # the README sets it for this example's service
    percent = float(set_cmd[-1])
    try:
        cluster.kubectl(*in_namespace(apply_cmd[1:], ns))
        one_ready = lambda o: (o.get("status") or {}).get("readyReplicas") == 1  # noqa: E731
        wait_for(cluster, ns, "inferenceservice", name, one_ready, operator)
        (pod,) = ready_pods(cluster, ns, name)
        placed = json.loads(cluster.kubectl("get", "pod", pod, "-n", ns, "-o", "json").stdout)
        assert placed["spec"]["nodeName"] == simgpu.NODE_NAME
        # Before it is set, the exporter reports the pod's GPU at 0%: the autoscaler reads it and holds at one.
        wait_for(
            cluster, ns, "inferenceservice", name,
            lambda o: ((o.get("status") or {}).get("autoscaling") or {}).get("metricValue") == 0,
            operator,
        )  # fmt: skip
        loom = Path(sys.executable).with_name("loom")
        out = subprocess.run(
            [str(loom), *in_namespace(set_cmd[1:], ns)], env=cluster.env, capture_output=True, text=True, check=False
        )
        assert out.returncode == 0, out.stderr
        assert f"{ns}/{name}" in out.stdout and pod in out.stdout, out.stdout
        up = wait_for(
            cluster, ns, "inferenceservice", name,
            lambda o: ((o.get("status") or {}).get("autoscaling") or {}).get("lastScaleReason") == "ScaledUp",
            operator,
        )  # fmt: skip
        assert up["spec"]["replicas"] == 2
        assert up["status"]["autoscaling"]["metric"] == "gpu-utilization"
        scaled = events_of(cluster, ns, name, "ScaledUp")
        assert any(m.startswith("replicas 1 -> 2") and f"metric {percent:g}" in m for m in scaled), scaled
    finally:
        cluster.kubectl("delete", "inferenceservice", name, "-n", ns, "--ignore-not-found", "--wait=true", check=False)


def readme_gpu_autoscaling_commands() -> tuple[list[str], list[str]]:
    """The README local-stack section's `kubectl apply` of the GPU autoscaling example and its
    `loom dev gpu-utilization` (argv, the program name first)."""
    argvs = commands(page_section(LOCAL_SECTION))
    applies = [a for a in argvs if a[:2] == ["kubectl", "apply"] and "inferenceservice-autoscale-gpu.yaml" in a[-1]]
    sets = [a for a in argvs if a[0].endswith("loom") and a[1:3] == ["dev", "gpu-utilization"]]
    assert len(applies) == 1 and len(sets) == 1, argvs
    return applies[0], sets[0]


def in_namespace(argv: list[str], ns: str) -> list[str]:
    """The README's command for namespace `ns` (its `-n default` replaced, or `-n ns` added)."""
    if "-n" in argv:
        i = argv.index("-n")
        return [*argv[: i + 1], ns, *argv[i + 2 :]]
    return [*argv, "-n", ns]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(
    cluster: Cluster,
    services: backing.BackingServices,
    examples_namespace: tuple[str, InClusterOperator],
    path: Path,
) -> None:
    ns, operator = examples_namespace
    docs = documents(path)
    assert docs, f"{path.name} is empty"
    if any(needs_gpu(doc) or runs_elsewhere(doc) for doc in docs):
        # Accepted as written (schema, CEL); see the module docstring for why it cannot run here.
        out = cluster.kubectl("apply", "--dry-run=server", "-n", ns, "-f", str(path), "-o", "name").stdout
        assert out.split() == [f"{d['kind'].lower()}.loom.dev/{d['metadata']['name']}" for d in docs]
        return
    trainers: dict[str, Path] = {}  # InferenceService -> the TrainingJob example whose registration it serves
    for doc in docs:
        source = ((doc.get("spec") or {}).get("model") or {}).get("fromTrainingJob")
        if doc["kind"] == "InferenceService" and source:
            # Serving a TrainingJob example's result: that example is applied too, as its comment says.
            apply(cluster, ns, example_defining("TrainingJob", source["name"]), services)
        base = (((doc.get("spec") or {}).get("finetune") or {}).get("baseModel") or {}).get("fromTrainingJob")
        if doc["kind"] == "TrainingJob" and base:
            # Fine-tuning a TrainingJob example's model: that example is applied too, as its comment says.
            apply(cluster, ns, example_defining("TrainingJob", base["name"]), services)
        registering = example_registering(((doc.get("spec") or {}).get("model") or {}).get("mlflow") or "")
        if doc["kind"] == "InferenceService" and registering is not None:
            # Following the alias a TrainingJob example's registration moves: that example is applied too.
            apply(cluster, ns, registering, services)
            trainers[doc["metadata"]["name"]] = registering
    apply(cluster, ns, path, services)
    for doc in docs:
        if doc["kind"] == "TrainingJob":
            check_training_job(cluster, ns, doc, services, operator)
        elif doc["kind"] == "InferenceService":
            version = None
            if doc["metadata"]["name"] in trainers:
                (job,) = documents(trainers[doc["metadata"]["name"]])
                check_training_job(cluster, ns, job, services, operator)
                trained = get(cluster, ns, "trainingjob", job["metadata"]["name"])
                version = trained["status"]["registeredModel"]["version"]
            check_inference_service(cluster, ns, doc, operator, version)
            if (doc["spec"].get("autoscaling") or {}).get("minReplicas") == 0:
                check_idles_to_zero_on_its_metric(cluster, ns, doc, operator)
        else:
            raise AssertionError(f"{path.name}: no expected outcome for {doc['kind']} here")
