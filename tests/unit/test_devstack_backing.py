"""What `loom dev up` provides for examples/ (loom.devstack.backing) matches what the examples reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from loom.devstack import backing

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


def _walk(node: Any, key: str) -> list[Any]:
    """Every value stored under `key` anywhere in a document."""
    if isinstance(node, dict):
        return [v for k, v in node.items() if k == key] + [x for v in node.values() for x in _walk(v, key)]
    if isinstance(node, list):
        return [x for v in node for x in _walk(v, key)]
    return []


def _examples() -> list[dict[str, Any]]:
    return [doc for path in EXAMPLES for doc in yaml.safe_load_all(path.read_text()) if doc]


def _provided(kind: str) -> list[dict[str, Any]]:
    return [m for m in backing.manifests() if m["kind"] == kind]


def test_every_in_cluster_url_the_examples_name_is_a_service_it_provides() -> None:
    services = {
        (m["metadata"]["name"], m["metadata"]["namespace"], p["port"])
        for m in _provided("Service")
        for p in m["spec"]["ports"]
    }
    urls = [u for doc in _examples() for key in ("endpoint", "trackingUri") for u in _walk(doc, key)]
    in_cluster = [urlsplit(u) for u in urls if ".svc" in urlsplit(u).hostname]
    assert in_cluster, "no example names an in-cluster S3 or MLflow"
    for url in in_cluster:
        name, namespace = url.hostname.split(".")[:2]
        assert (name, namespace, url.port) in services, url.geturl()
    assert backing.S3_URL == "http://minio.storage.svc:9000"
    assert backing.MLFLOW_URL == "http://mlflow.mlops.svc:5000"


def test_the_buckets_and_secret_the_examples_use_are_provided() -> None:
    docs = _examples()
    buckets = {urlsplit(u).netloc for doc in docs for u in _walk(doc, "uri") if str(u).startswith("s3://")}
    assert buckets and buckets <= set(backing.BUCKETS)
    s3 = next(m for m in _provided("Deployment") if m["metadata"]["name"] == "minio")
    args = s3["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [args[i + 1] for i, a in enumerate(args) if a == "--bucket"] == list(backing.BUCKETS)
    secret_names = {ref["name"] for doc in docs for ref in _walk(doc, "secretRef")}
    assert backing.SECRET_NAME in secret_names
    secrets = {(m["metadata"]["namespace"], m["metadata"]["name"]) for m in _provided("Secret")}
    assert ("default", backing.SECRET_NAME) in secrets


def test_credentials_secret_holds_the_keys_the_operator_reads_by_reference() -> None:
    secret = backing.credentials_secret("team-a")
    assert secret["metadata"] == {"name": "s3-credentials", "namespace": "team-a", "labels": backing.LABEL}
    assert secret["stringData"] == {"AWS_ACCESS_KEY_ID": "loom-local", "AWS_SECRET_ACCESS_KEY": "loom-local-secret"}


def test_mlflow_accepts_the_service_name_as_host_and_keeps_its_credentials_in_the_secret() -> None:
    mlflow = next(m for m in _provided("Deployment") if m["metadata"]["name"] == "mlflow")
    container = mlflow["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    allowed = args[args.index("--allowed-hosts") + 1].split(",")
    assert {"mlflow.mlops.svc:5000", "mlflow.mlops.svc", "127.*"} <= set(allowed)
    env = {e["name"]: e for e in container["env"]}
    assert env["MLFLOW_S3_ENDPOINT_URL"]["value"] == backing.S3_URL
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["name"] == backing.SECRET_NAME
    assert "value" not in env["AWS_SECRET_ACCESS_KEY"]
    # Namespaces come before what lives in them (one `kubectl apply` of the whole list).
    kinds = [m["kind"] for m in backing.manifests()]
    assert kinds[:2] == ["Namespace", "Namespace"]


def test_the_feature_view_examples_data_is_seeded_where_they_read_it(tmp_path: Any) -> None:
    """The S3 pod uploads the repository's example data set under the keys the FeatureView examples name."""
    from loom.workloads.features.example_data import parse_end, write

    paths = [doc["spec"]["source"]["path"] for doc in _examples() if doc["kind"] == "FeatureView"]
    # And the entity dataframes the TrainingJob examples build point-in-time training sets from.
    paths += [p for doc in _examples() if doc["kind"] == "TrainingJob" for p in _walk(doc, "entityDataframe")]
    assert paths, "no FeatureView example reads from S3"
    for path in paths:
        url = urlsplit(path)
        assert (url.scheme, url.netloc) == ("s3", backing.FEATURES_BUCKET)
        assert url.path.lstrip("/") in backing.FEATURES_OBJECTS
    written = write(tmp_path, parse_end("now"))
    assert set(backing.FEATURES_OBJECTS.values()) <= set(written)


def test_redis_for_the_redis_feature_view_example_is_provided() -> None:
    """A real redis-server behind redis.storage.svc:6379, and the Secret the Redis FeatureView example names."""
    service = next(m for m in _provided("Service") if m["metadata"]["name"] == backing.REDIS_SERVICE)
    assert (service["metadata"]["namespace"], service["spec"]["ports"][0]["port"]) == ("storage", 6379)
    redis = next(m for m in _provided("Deployment") if m["metadata"]["name"] == backing.REDIS_SERVICE)
    container = redis["spec"]["template"]["spec"]["containers"][0]
    assert container["command"][-3:] == ["redis", "--port", "6379"]
    assert container["readinessProbe"]["tcpSocket"] == {"port": 6379}
    refs = [
        doc["spec"]["store"]["online"]["connectionSecretRef"]
        for doc in _examples()
        if doc["kind"] == "FeatureView" and doc["spec"].get("store", {}).get("online", {}).get("type") == "redis"
    ]
    assert refs, "no FeatureView example uses the Redis online store"
    secret = next(m for m in _provided("Secret") if m["metadata"]["name"] == backing.REDIS_SECRET)
    for ref in refs:
        assert (ref["name"], ref["key"]) == (backing.REDIS_SECRET, backing.REDIS_SECRET_KEY)
    assert secret["stringData"] == {"connectionString": "redis.storage.svc:6379"}


def test_the_stack_runs_the_prometheus_the_autoscaling_examples_read_under_the_demos_service_name() -> None:
    """prometheus.monitoring.svc:9090 (what the README's install command gives the chart as prometheus.url) is a
    Service of the stack, backed by the built binary, scraping annotated pods in every namespace."""
    assert backing.PROMETHEUS_URL == "http://prometheus.monitoring.svc:9090"
    docs = backing.manifests(Path("/state/kubeconfig"), Path("/cache/bin/prometheus"))
    services = {(m["metadata"]["namespace"], m["metadata"]["name"]): m for m in docs if m["kind"] == "Service"}
    assert services[("monitoring", "prometheus")]["spec"]["ports"][0]["port"] == 9090
    assert ("Namespace", "monitoring") in {(m["kind"], m["metadata"]["name"]) for m in docs}
    deployment = next(m for m in docs if m["kind"] == "Deployment" and m["metadata"]["name"] == "prometheus")
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert container["command"] == ["/cache/bin/prometheus"]
    # Its own pod address only: a Go binary binds past the node agent's shim, and stacks share the machine.
    assert "--web.listen-address=$(POD_IP):9090" in container["args"]
    assert container["env"] == [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    assert container["readinessProbe"]["httpGet"] == {"path": "/-/ready", "port": 9090}
    config_map = next(m for m in docs if m["kind"] == "ConfigMap" and m["metadata"]["name"] == "prometheus-config")
    config = yaml.safe_load(config_map["data"]["prometheus.yml"])
    (job,) = config["scrape_configs"]
    (discovery,) = job["kubernetes_sd_configs"]
    assert discovery == {"role": "pod", "kubeconfig_file": "/state/kubeconfig"}  # every namespace
    assert {"name": "config", "configMap": {"name": "prometheus-config"}} in pod["spec"]["volumes"]
    # A changed configuration rolls the pod (a ConfigMap change alone would not restart it).
    other = backing.manifests(Path("/elsewhere/kubeconfig"), Path("/cache/bin/prometheus"))
    rolled = next(m for m in other if m["kind"] == "Deployment" and m["metadata"]["name"] == "prometheus")
    hash_key = "loom.dev/config-hash"
    assert rolled["spec"]["template"]["metadata"]["annotations"][hash_key] != pod["metadata"]["annotations"][hash_key]


def test_dev_env_exports_the_prometheus_url_for_a_host_run_operator(tmp_path: Path, monkeypatch: Any) -> None:
    import json

    from click.testing import CliRunner

    from loom.devstack import cli
    from loom.devstack.cluster import build

    monkeypatch.setattr(build, "is_built", lambda: True)
    monkeypatch.setenv("LOOM_AGENT_STATE_DIR", str(tmp_path))
    without = CliRunner().invoke(cli.dev, ["env"])
    assert without.exit_code == 0 and "LOOM_PROMETHEUS_URL" not in without.output  # the stack does not run it
    services = {"monitoring/prometheus": {"address": "127.20.0.7"}}
    (tmp_path / "services.json").write_text(json.dumps(services))
    assert backing.host_prometheus_url() == "http://127.20.0.7:9090"
    result = CliRunner().invoke(cli.dev, ["env"])
    assert result.exit_code == 0, result.output
    assert "export LOOM_PROMETHEUS_URL=http://127.20.0.7:9090" in result.output.splitlines()
