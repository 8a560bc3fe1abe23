"""model.uri: oci://... (issue 48), the pure parts: the grammar admission checks, the ref a resolved image gives (by
digest, whatever the spec named), and the pod that mounts it (an image volume, no fetch step) for both runtimes.
The registry lookup and a real kubelet mounting the image: e2e/tests/test_model_oci_real_node.py."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from loom.operator.api.cel import admitted
from loom.operator.kinds.inferenceservice.api import InferenceServiceSpec
from loom.operator.kinds.inferenceservice.llm.vllm import LLM_CONFIG_FILE
from loom.operator.kinds.inferenceservice.render import MODEL_IMAGE_DIR, render_deployment
from loom.operator.kinds.inferenceservice.source.api import ModelSource
from loom.operator.kinds.inferenceservice.source.model import ModelRef, ResolveError, resolve_model
from loom.workloads.common.oci.reference import ImageReference, parse_reference
from loom.workloads.server.config import ServerConfig

DIGEST = "sha256:" + "0123456789abcdef" * 4
OTHER = "sha256:" + "f" * 64
REGISTRY = "registry.example.com:5000"


def spec(uri: str, **extra: Any) -> InferenceServiceSpec:
    return InferenceServiceSpec.model_validate({"model": {"uri": uri}, "handler": "chargpt", **extra})


def resolved(uri: str) -> ImageReference:
    return parse_reference(uri).pinned(DIGEST)


@pytest.mark.parametrize("uri", [
    f"oci://{REGISTRY}/ml/chargpt@{DIGEST}",
    f"oci://{REGISTRY}/ml/chargpt:v3",
    f"oci://localhost/chargpt:v3@{DIGEST}",
    "s3://models/chargpt/v1",
])  # fmt: skip
def test_admission_accepts_model_images_and_s3_prefixes(uri: str) -> None:
    assert ModelSource.model_validate({"uri": uri}).uri == uri


@pytest.mark.parametrize("uri", [
    "oci://chargpt:v3",  # no registry host
    f"oci://{REGISTRY}/ML/Chargpt:v3",  # repositories are lower case
    f"oci://{REGISTRY}/ml/chargpt@sha256:abc",  # not a digest
    "https://models/chargpt",
])  # fmt: skip
def test_admission_refuses_what_is_no_image_reference(uri: str) -> None:
    with pytest.raises(ValidationError, match="uri"):
        ModelSource.model_validate({"uri": uri})


def test_a_tag_is_served_by_the_digest_the_registry_resolved_it_to() -> None:
    uri = f"oci://{REGISTRY}/ml/chargpt:v3"
    ref = resolve_model(spec(uri).model, "chargpt", image=resolved(uri))
    assert ref == ModelRef(storage_uri=f"oci://{REGISTRY}/ml/chargpt@{DIGEST}", storage_kind="oci",
                           handler="chargpt", version="v3")  # fmt: skip
    # The tag moved: another digest is another model (a rollout), though the spec did not change.
    moved = resolve_model(spec(uri).model, "chargpt", image=parse_reference(uri).pinned(OTHER))
    assert moved != ref and moved.version == "v3"
    by_digest = resolve_model(spec(f"oci://{REGISTRY}/ml/chargpt@{DIGEST}").model, "chargpt", image=resolved(uri))
    assert by_digest.version == "0123456789ab" and by_digest.storage_uri == ref.storage_uri
    named = resolve_model(spec(uri, model={"uri": uri, "version": "gold"}).model, "chargpt", image=resolved(uri))
    assert named.version == "gold"


def test_an_image_not_looked_up_or_another_digest_is_not_served() -> None:
    uri = f"oci://{REGISTRY}/ml/chargpt@{DIGEST}"
    with pytest.raises(ResolveError) as pending:
        resolve_model(spec(uri).model, "chargpt")
    assert pending.value.reason == "ImageNotResolved" and pending.value.transient
    with pytest.raises(ResolveError) as mismatch:
        resolve_model(spec(uri).model, "chargpt", image=parse_reference(uri).pinned(OTHER))
    assert mismatch.value.reason == "ImageDigestMismatch" and not mismatch.value.transient
    with pytest.raises(ResolveError, match="cannot be guessed for an oci uri"):
        resolve_model(spec(uri).model, "auto", image=resolved(uri))


def owner() -> dict[str, Any]:
    return {"apiVersion": "loom.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "gpt", "namespace": "ml", "uid": "u", "generation": 1}}  # fmt: skip


def pod_of(service: InferenceServiceSpec, **kw: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    ref = resolve_model(service.model, service.serving_handler, runtime=service.runtime,
                        image=resolved(str(service.model.uri)))  # fmt: skip
    config_map, deployment = render_deployment(owner(), service, "stable", ref, 2, "loom/server:t", **kw)
    return config_map, deployment["spec"]["template"]["spec"]


def test_the_pod_mounts_the_image_read_only_and_fetches_nothing() -> None:
    config_map, pod = pod_of(spec(f"oci://{REGISTRY}/ml/chargpt:v3"))
    assert "initContainers" not in pod  # no download at start
    volume = next(v for v in pod["volumes"] if "image" in v)
    assert volume["image"] == {"reference": f"{REGISTRY}/ml/chargpt@{DIGEST}", "pullPolicy": "IfNotPresent"}
    [server] = pod["containers"]
    mount = next(m for m in server["volumeMounts"] if m["name"] == volume["name"])
    assert mount == {"name": volume["name"], "mountPath": MODEL_IMAGE_DIR, "readOnly": True}
    config = ServerConfig.model_validate_json(config_map["data"]["server.json"])
    # The server loads the mounted folder as a local one (workloads/server/fetch.model_folder).
    assert (config.resolved_storage_kind, config.storage_uri, config.model_version) == ("local", MODEL_IMAGE_DIR, "v3")


def test_runtime_vllm_loads_the_mounted_image_and_keeps_adapters_in_the_writable_cache() -> None:
    service = spec(f"oci://{REGISTRY}/llama@{DIGEST}", runtime="vllm", handler="auto")
    config_map, pod = pod_of(service, vllm_image="loom/vllm:t")
    assert "initContainers" not in pod and any("image" in v for v in pod["volumes"])
    llm = json.loads(config_map["data"][LLM_CONFIG_FILE])
    assert llm["modelDir"] == MODEL_IMAGE_DIR


def test_an_s3_model_still_has_its_fetch_step_and_no_image_volume() -> None:
    service = InferenceServiceSpec.model_validate({"model": {"uri": "s3://m/gpt/v1"}, "handler": "chargpt"})
    ref = resolve_model(service.model, service.handler)
    _, deployment = render_deployment(owner(), service, "stable", ref, 1, "loom/server:t")
    pod = deployment["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["initContainers"]] == ["fetch-model"]
    assert not any("image" in v for v in pod["volumes"])


def test_a_private_registrys_secret_goes_to_the_pods_and_needs_a_digest() -> None:
    uri = f"oci://{REGISTRY}/ml/chargpt@{DIGEST}"
    private = spec(uri, model={"uri": uri, "pullSecretName": "registry-creds"})
    _, pod = pod_of(private)
    assert pod["imagePullSecrets"] == [{"name": "registry-creds"}]
    assert "imagePullSecrets" not in pod_of(spec(uri))[1]
    # Another Secret is another ref: the pods are rolled to it.
    assert resolve_model(private.model, "chargpt", image=resolved(uri)) != resolve_model(
        spec(uri).model, "chargpt", image=resolved(uri)
    )


@pytest.mark.parametrize("uri", [f"oci://{REGISTRY}/ml/chargpt:v3", "s3://models/chargpt/v1"])
def test_a_pull_secret_without_a_pinned_image_is_refused_at_admission(uri: str) -> None:
    # The CRD's CEL rules, evaluated as the API server does at admission (loom.operator.api.cel).
    with pytest.raises(ValidationError, match="pullSecretName is for an oci:// uri pinned by digest"):
        admitted(ModelSource, {"uri": uri, "pullSecretName": "registry-creds"})
    admitted(ModelSource, {"uri": f"oci://{REGISTRY}/ml/chargpt@{DIGEST}", "pullSecretName": "registry-creds"})
