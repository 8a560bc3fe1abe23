"""A model served from an OCI image on the real node (issue 48): `model.uri: oci://<registry>/<repo>@sha256:...`.

The example chargpt model (a small one, the trainer's serving layout) is pushed to the stack's registry with the
code behind `loom model push`; an InferenceService names it by digest and runs on the real node (kubelet and
containerd 2.x), its model server from the development image (this checkout). The kubelet pulls the model image as
an image volume and mounts it read-only where the server loads it: the pod has no init container, nothing is
downloaded at start. The second replica on the node pulls nothing: its pull event says the image is already on the
machine, and the image's layers are deleted from the registry before it starts, so it could not have.

Bad input, with the replicas serving all along: a digest the registry does not hold (refused before any pod is
made: ImageNotFound), an image that is not a model (NotAModelImage), and an image whose manifest is there but whose
layer the kubelet cannot pull (the rollout stalls on the new pod's ErrImagePull, named in status, and the old
ReplicaSet keeps serving).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from loom.devstack.cluster import Cluster
from loom.devstack.cluster.handle import wait_until
from loom.devstack.cluster.realnode import config
from loom.devstack.cluster.realnode.images import DEV_IMAGE
from loom.e2e.pytest_operator import OperatorProcess, apply_crds, operator_namespace_for, operator_process
from loom.e2e.tests.test_helm_install import kubectl_json
from loom.e2e.tests.test_inferenceservice import condition, get, wait_rolled_out
from loom.e2e.tests.test_real_node import real_node as real_node  # the fixture
from loom.workloads.common.oci.image import CONFIG_MEDIA_TYPE, MANIFEST_MEDIA_TYPE, Blob
from loom.workloads.common.oci.reference import ImageReference, parse_reference
from loom.workloads.common.oci.registry import Registry
from loom.workloads.common.oci.transfer import PushResult, push_folder

# The main path is in the core tier (`make test`, about a minute); the bad-input scenarios in `make test-all`.
pytestmark = [pytest.mark.real_node, pytest.mark.slow, pytest.mark.timeout(900)]
LOAD_TIMEOUT_S = 300


def chargpt_folder(folder: Path, seed: int = 0) -> Path:
    """The example chargpt model in the trainer's serving layout (config.json + model.pt), large enough that its
    weights are a layer of their own (over 1 MiB)."""
    import torch

    from loom.workloads.server.chargpt_handler import save_for_serving
    from loom.workloads.trainer.examples import chargpt

    torch.manual_seed(seed)
    return save_for_serving(chargpt.GPT(chargpt.GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=128)), folder)


def push(cluster: Cluster, folder: Path, repository: str, tag: str) -> PushResult:
    target = parse_reference(f"{cluster.registry}/{repository}:{tag}")
    with Registry(target.registry) as registry:
        return push_folder(folder, target, registry, name="chargpt", version=tag)


def layer_digests(image: ImageReference) -> list[str]:
    with Registry(image.registry) as registry:
        index = registry.manifest(image.repository, str(image.digest)).json()
        manifest = registry.manifest(image.repository, index["manifests"][0]["digest"]).json()
    return [layer["digest"] for layer in manifest["layers"]]


def delete_blobs(image: ImageReference, digests: list[str]) -> None:
    """Remove layers from the registry (the stack's allows deletes): a pull that needs them now fails."""
    for digest in digests:
        answer = httpx.delete(f"{image.base_url}/v2/{image.repository}/blobs/{digest}", timeout=30)
        assert answer.status_code == 202, answer.text


@pytest.fixture(scope="module")
def operator(cluster: Cluster, real_node: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    """The operator as a host process; the model servers it renders run the development image (this checkout)."""
    apply_crds(cluster)
    log = tmp_path_factory.mktemp("loom-operator-oci") / "loom_operator.log"
    with operator_process(cluster, log, {"LOOM_SERVER_IMAGE": DEV_IMAGE}) as handle:
        yield handle


@pytest.fixture
def namespace(cluster: Cluster, operator: OperatorProcess) -> Iterator[str]:
    with operator_namespace_for(cluster, operator) as name:
        yield name


def service(name: str, uri: str, replicas: int) -> dict[str, Any]:
    return {
        "apiVersion": "loom.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name},
        "spec": {
            "model": {"uri": uri},
            "handler": "chargpt",
            "replicas": replicas,
            "nodeSelector": config.NODE_SELECTOR,
            "tolerations": [config.TOLERATION],
            "env": [{"name": "OMP_NUM_THREADS", "value": "1"}],
            "rollout": {"minReadySeconds": 1},
        },
    }


def apply(cluster: Cluster, namespace: str, body: dict[str, Any]) -> None:
    cluster.kubectl("apply", "--server-side", "-n", namespace, "-f", "-", stdin=yaml.safe_dump(body))


def pods(cluster: Cluster, namespace: str, name: str) -> list[dict[str, Any]]:
    items = kubectl_json(cluster, "get", "pods", "-n", namespace, "-l", f"loom.dev/inferenceservice={name}")["items"]
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def pull_events(cluster: Cluster, namespace: str, pod: str, reference: str) -> list[str]:
    """The kubelet's pull events of `pod` about the model image: (reason: message)."""
    events = kubectl_json(cluster, "get", "events", "-n", namespace, "--field-selector",
                          f"involvedObject.name={pod}")["items"]  # fmt: skip
    return [f"{e['reason']}: {e['message']}" for e in events if reference in e.get("message", "")]


def generate(pod: dict[str, Any], name: str) -> str:
    body = {
        "inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["hello"]}],
        "parameters": {"max_tokens": 4, "temperature": 0},
    }
    address = pod["status"]["podIP"]
    answer = httpx.post(f"http://{address}:8080/v2/models/{name}/infer", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return str(answer.json()["outputs"][0]["data"][0])


def wait_condition(cluster: Cluster, namespace: str, name: str, ctype: str, reason: str) -> dict[str, Any]:
    def found() -> dict[str, Any] | None:
        obj = get(cluster, namespace, "inferenceservice", name)
        return obj if obj is not None and condition(obj, ctype).get("reason") == reason else None

    try:
        return dict(wait_until(found, timeout=LOAD_TIMEOUT_S, what=f"{name}: {ctype} {reason}", interval=1))
    except TimeoutError as error:
        obj = get(cluster, namespace, "inferenceservice", name) or {}
        raise AssertionError(f"{error}\nstatus: {json.dumps(obj.get('status'), indent=1)}") from error


@pytest.mark.core
def test_a_model_image_is_mounted_by_digest_and_a_second_replica_pulls_nothing(
    cluster: Cluster, operator: OperatorProcess, namespace: str, tmp_path: Path
) -> None:
    repository = f"e2e-{uuid.uuid4().hex[:8]}/chargpt"
    pushed = push(cluster, chargpt_folder(tmp_path / "chargpt"), repository, "v1")
    assert pushed.layers == 2  # the weights alone, the config with the small files
    image = pushed.image
    reference = str(image)  # <registry>/<repository>@sha256:..., what the pod names
    apply(cluster, namespace, service("chargpt", image.uri, replicas=1))
    isvc = wait_rolled_out(cluster, operator, namespace, "chargpt")  # type: ignore[arg-type]
    assert isvc["status"]["modelImage"] == image.uri

    [first] = pods(cluster, namespace, "chargpt")
    spec = first["spec"]
    assert first["spec"]["nodeName"] == config.NODE_NAME
    assert "initContainers" not in spec  # no download at start
    [volume] = [v for v in spec["volumes"] if "image" in v]
    assert volume["image"]["reference"] == reference
    assert generate(first, "chargpt")  # the server loaded the mounted folder
    events = pull_events(cluster, namespace, first["metadata"]["name"], reference)
    assert any(e.startswith("Pulled: Successfully pulled image") for e in events), events

    # The layers leave the registry: a replica that needed to pull could not start now.
    delete_blobs(image, layer_digests(image))
    cluster.kubectl("scale", "inferenceservice", "chargpt", "-n", namespace, "--replicas=2")

    def two_ready() -> list[dict[str, Any]] | None:
        found = pods(cluster, namespace, "chargpt")
        ready = [p for p in found if any(c["type"] == "Ready" and c["status"] == "True"
                                         for c in p["status"].get("conditions") or [])]  # fmt: skip
        return found if len(ready) == 2 else None

    both = wait_until(two_ready, timeout=LOAD_TIMEOUT_S, what="the second replica Ready", interval=1)
    [second] = [p for p in both if p["metadata"]["name"] != first["metadata"]["name"]]
    assert second["spec"]["nodeName"] == config.NODE_NAME
    events = pull_events(cluster, namespace, second["metadata"]["name"], reference)
    assert events and all("already present on machine" in e for e in events), events
    assert generate(second, "chargpt") == generate(first, "chargpt")  # the same weights: greedy agrees


def test_bad_images_are_named_in_status_and_the_replicas_keep_serving(
    cluster: Cluster, operator: OperatorProcess, namespace: str, tmp_path: Path
) -> None:
    repository = f"e2e-{uuid.uuid4().hex[:8]}/chargpt"
    good = push(cluster, chargpt_folder(tmp_path / "v1"), repository, "v1").image
    apply(cluster, namespace, service("chargpt", f"oci://{cluster.registry}/{repository}:v1", replicas=2))
    isvc = wait_rolled_out(cluster, operator, namespace, "chargpt")  # type: ignore[arg-type]
    assert isvc["status"]["modelImage"] == good.uri  # the tag, resolved to its digest
    serving = sorted(p["metadata"]["name"] for p in pods(cluster, namespace, "chargpt"))

    def still_serving() -> None:
        obj = get(cluster, namespace, "inferenceservice", "chargpt") or {}
        assert condition(obj, "Ready").get("status") == "True" and obj["status"]["readyReplicas"] == 2, obj
        assert sorted(p["metadata"]["name"] for p in pods(cluster, namespace, "chargpt")) == serving
        assert obj["status"]["modelImage"] == good.uri

    # A digest the registry never received: refused before any pod is made.
    missing = f"oci://{cluster.registry}/{repository}@sha256:{'0' * 64}"
    apply(cluster, namespace, service("chargpt", missing, replicas=2))
    obj = wait_condition(cluster, namespace, "chargpt", "RolledOut", "ImageNotFound")
    assert f"{repository}@sha256:{'0' * 64} not found" in condition(obj, "RolledOut")["message"]
    still_serving()

    # An image that is not a model (an application image: an image config, no model annotation).
    app_repository = f"{repository}-app"
    with Registry(good.registry) as registry:
        config_blob = Blob(CONFIG_MEDIA_TYPE, b'{"architecture":"amd64","os":"linux","rootfs":{"type":"layers"}}')
        registry.upload_blob(app_repository, config_blob.digest, config_blob.data)
        document = {"schemaVersion": 2, "mediaType": MANIFEST_MEDIA_TYPE, "config": config_blob.descriptor(),
                    "layers": []}  # fmt: skip
        app = registry.put_manifest(app_repository, "app", MANIFEST_MEDIA_TYPE, json.dumps(document).encode())
    apply(cluster, namespace, service("chargpt", f"oci://{cluster.registry}/{app_repository}@{app}", replicas=2))
    obj = wait_condition(cluster, namespace, "chargpt", "RolledOut", "NotAModelImage")
    assert "is not a model image" in condition(obj, "RolledOut")["message"]
    still_serving()

    # A model image whose manifest resolves but whose weights the kubelet cannot pull: the new pod fails to pull,
    # status names it, the old ReplicaSet keeps serving.
    broken = push(cluster, chargpt_folder(tmp_path / "v2", seed=1), repository, "v2").image
    weights = [d for d in layer_digests(broken) if d not in layer_digests(good)]
    assert len(weights) == 1  # only the new weights' layer differs: the config layer is shared
    delete_blobs(broken, weights)
    apply(cluster, namespace, service("chargpt", broken.uri, replicas=2))

    def pull_failure() -> str | None:
        found = get(cluster, namespace, "inferenceservice", "chargpt") or {}
        message = str(condition(found, "ModelLoaded").get("message", ""))
        return message if ("ErrImagePull" in message or "ImagePullBackOff" in message) else None

    message = wait_until(pull_failure, timeout=LOAD_TIMEOUT_S, what="the new pod's pull failure in status", interval=1)
    assert str(broken) in message or broken.repository in message, message
    obj = get(cluster, namespace, "inferenceservice", "chargpt") or {}
    assert condition(obj, "Ready").get("status") == "True" and obj["status"]["readyReplicas"] >= 2, obj
    old = [p for p in pods(cluster, namespace, "chargpt") if p["metadata"]["name"] in serving]
    assert len(old) == 2 and all(generate(p, "chargpt") for p in old)
