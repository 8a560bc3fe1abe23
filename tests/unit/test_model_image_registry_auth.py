"""The registry client's credentials (loom.workloads.common.oci.registry): a token asked of the realm a 401 names,
with the credentials given or anonymously; basic auth; a refusal says whose credentials were refused. And what the
operator makes of each registry error (source/io.py): the condition's reason, and whether it is waited out.

The stack's registry is built without an auth module (devstack/cluster/go/registry: filesystem storage only), so the
registry here is a stand-in on httpx's MockTransport answering as distribution's token and htpasswd auth do."""

from __future__ import annotations

import base64
import json

import httpx
import pytest

from loom.operator.kinds.inferenceservice.source import io as source_io
from loom.workloads.common.oci.image import INDEX_MEDIA_TYPE, MODEL_LABEL
from loom.workloads.common.oci.reference import parse_reference
from loom.workloads.common.oci.registry import Credentials, Registry, RegistryError
from loom.workloads.common.oci.transfer import resolve

INDEX = json.dumps({"schemaVersion": 2, "mediaType": INDEX_MEDIA_TYPE, "manifests": [],
                    "annotations": {MODEL_LABEL: "chargpt"}}).encode()  # fmt: skip
GOOD = "Basic " + base64.b64encode(b"loom:secret").decode()


def token_registry(request: httpx.Request) -> httpx.Response:
    """Distribution's token auth: a 401 naming the realm, a token for good credentials, the manifest for the token."""
    if request.url.host == "auth.example.com":
        if request.headers.get("Authorization") != GOOD:
            return httpx.Response(401)
        assert request.url.params["scope"] == "repository:ml/chargpt:pull"
        return httpx.Response(200, json={"token": "t0k"})
    if request.headers.get("Authorization") != "Bearer t0k":
        challenge = 'Bearer realm="https://auth.example.com/token",service="registry.example.com"'
        return httpx.Response(401, headers={"WWW-Authenticate": challenge})
    return httpx.Response(200, content=INDEX, headers={"Content-Type": INDEX_MEDIA_TYPE})


def basic_registry(request: httpx.Request) -> httpx.Response:
    if request.headers.get("Authorization") != GOOD:
        return httpx.Response(401, headers={"WWW-Authenticate": 'Basic realm="registry"'})
    return httpx.Response(200, content=INDEX, headers={"Content-Type": INDEX_MEDIA_TYPE})


@pytest.mark.parametrize("handler", [token_registry, basic_registry])
def test_credentials_answer_the_registrys_challenge(handler: object) -> None:
    image = parse_reference("registry.example.com/ml/chargpt:v1")
    transport = httpx.MockTransport(handler)  # type: ignore[arg-type]
    with Registry(image.registry, Credentials("loom", "secret"), transport=transport) as registry:
        pinned, index = resolve(image, registry)
    assert pinned.digest is not None and index["annotations"][MODEL_LABEL] == "chargpt"


@pytest.mark.parametrize("handler", [token_registry, basic_registry])
@pytest.mark.parametrize("credentials,who", [
    (None, "refused anonymous access"), (Credentials("loom", "wrong"), "refused the credentials given"),
])  # fmt: skip
def test_a_refusal_names_whose_credentials(handler: object, credentials: Credentials | None, who: str) -> None:
    image = parse_reference("registry.example.com/ml/chargpt:v1")
    transport = httpx.MockTransport(handler)  # type: ignore[arg-type]
    with Registry(image.registry, credentials, transport=transport) as registry, pytest.raises(RegistryError) as error:
        resolve(image, registry)
    assert error.value.kind == "Unauthorized" and f"registry registry.example.com {who}" in error.value.message


@pytest.mark.parametrize("kind,reason,transient", [
    ("NotFound", "ImageNotFound", True),
    ("Unauthorized", "RegistryUnauthorized", False),
    ("NotAModel", "NotAModelImage", False),
    ("Unavailable", "RegistryUnavailable", True),
])  # fmt: skip
async def test_the_operator_names_each_registry_error(
    monkeypatch: pytest.MonkeyPatch, kind: str, reason: str, transient: bool
) -> None:
    def refuse(image: object) -> None:
        raise RegistryError(kind, f"{kind} said the registry")

    monkeypatch.setattr(source_io, "_look_up", refuse)
    uri = f"oci://registry.example.com/ml/{kind.lower()}:v1"
    image, error = await source_io.resolve_image(uri)
    assert image is None and error is not None
    assert (error.reason, error.message, error.transient) == (reason, f"{kind} said the registry", transient)


async def test_a_tags_digest_is_kept_while_the_registry_is_unreachable_not_when_it_says_not_found(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    uri = "oci://registry.example.com/ml/kept:v1"
    pinned = parse_reference(uri).pinned("sha256:" + "a" * 64)
    monkeypatch.setattr(source_io, "TAG_RECHECK_S", 0.0)  # a tag is asked again at every pass
    monkeypatch.setattr(source_io, "_look_up", lambda image: pinned)
    assert await source_io.resolve_image(uri) == (pinned, None)

    def failing(kind: str):  # type: ignore[no-untyped-def]
        def look_up(image: object) -> None:
            raise RegistryError(kind, f"{kind}: the registry")

        return look_up

    monkeypatch.setattr(source_io, "_look_up", failing("Unavailable"))
    assert await source_io.resolve_image(uri) == (pinned, None)  # the serving digest stays
    monkeypatch.setattr(source_io, "_look_up", failing("NotFound"))
    image, error = await source_io.resolve_image(uri)
    assert image is None and error is not None and error.reason == "ImageNotFound"


async def test_an_image_behind_a_pull_secret_is_not_looked_up_by_the_operator(monkeypatch: pytest.MonkeyPatch) -> None:
    """The operator never reads the Secret: it takes the digest the uri pins, and the kubelet's pull is the check."""
    from loom.operator.defaults import EndpointDefaults
    from loom.operator.kinds.inferenceservice.api import InferenceServiceSpec

    def must_not_ask(image: object) -> None:
        raise AssertionError("the registry was asked")

    monkeypatch.setattr(source_io, "_look_up", must_not_ask)
    uri = "oci://registry.example.com/ml/private@sha256:" + "b" * 64
    spec = InferenceServiceSpec.model_validate(
        {"model": {"uri": uri, "pullSecretName": "registry-creds"}, "handler": "chargpt"}
    )
    ref, error = await source_io.resolve(spec, "ml", EndpointDefaults())
    assert error is None and ref is not None
    assert (ref.storage_uri, ref.pull_secret_name) == (uri, "registry-creds")
