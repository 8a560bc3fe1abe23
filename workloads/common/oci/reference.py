"""An image reference, `<registry>/<repository>[:tag][@sha256:...]` (optionally after `oci://`), parsed and
printed (pure).

The registry part must name a host (a dot, a port, or localhost), as the chart's image rule does: a bare
`team/model` would otherwise resolve to the default public registry's namespace of that name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SCHEME = "oci://"
DIGEST_PATTERN = r"sha256:[a-f0-9]{64}"
_HOST = r"(?:localhost|\[[0-9a-fA-F:]+\]|[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9-]+)+|[A-Za-z0-9-]+)"
_REGISTRY = rf"{_HOST}(?::[0-9]{{1,5}})?"
_COMPONENT = r"[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*"
_REPOSITORY = rf"{_COMPONENT}(?:/{_COMPONENT})*"
_TAG = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}"
REFERENCE = re.compile(
    rf"^(?P<registry>{_REGISTRY})/(?P<repository>{_REPOSITORY})(?::(?P<tag>{_TAG}))?(?:@(?P<digest>{DIGEST_PATTERN}))?$"
)
# The same grammar for an `oci://` URI in a CRD pattern (no named groups: JSON Schema's regex dialect).
URI_PATTERN = "^oci://" + REFERENCE.pattern[1:].replace("?P<registry>", "").replace("?P<repository>", "").replace(
    "?P<tag>", ""
).replace("?P<digest>", "")
_LOOPBACK = re.compile(r"^(?:localhost|127(?:\.[0-9]{1,3}){3}|\[::1\])(?::[0-9]+)?$")


class ReferenceError(ValueError):
    """Not an image reference this code accepts; the message says what a good one looks like."""


@dataclass(frozen=True)
class ImageReference:
    registry: str  # host[:port]
    repository: str
    tag: str | None = None
    digest: str | None = None

    def __str__(self) -> str:
        text = f"{self.registry}/{self.repository}"
        if self.tag:
            text += f":{self.tag}"
        if self.digest:
            text += f"@{self.digest}"
        return text

    @property
    def uri(self) -> str:
        return SCHEME + str(self)

    @property
    def reference(self) -> str:
        """What the registry's manifest endpoint takes: the digest when pinned, else the tag (default latest)."""
        return self.digest or self.tag or "latest"

    def pinned(self, digest: str) -> ImageReference:
        """This image by digest alone (the form a pod names: the kubelet then pulls exactly that)."""
        return ImageReference(self.registry, self.repository, None, digest)

    @property
    def base_url(self) -> str:
        return registry_base_url(self.registry)


def parse_reference(text: str) -> ImageReference:
    bare = text.strip().removeprefix(SCHEME)
    match = REFERENCE.match(bare)
    if match is None or ("." not in match["registry"] and ":" not in match["registry"]
                         and match["registry"] != "localhost"):  # fmt: skip
        raise ReferenceError(
            f"{text!r} is not an image reference: expected [oci://]<registry host>/<repository>[:tag][@sha256:<64 hex>]"
            " (the registry a host with a dot or a port, or localhost; the repository lower case)"
        )
    return ImageReference(match["registry"], match["repository"], match["tag"], match["digest"])


def registry_base_url(registry: str) -> str:
    """The registry's API root. A registry on loopback is spoken to over plain HTTP (the local stack's, and a
    port-forward's); any other over HTTPS, as container runtimes do by default."""
    scheme = "http" if _LOOPBACK.match(registry) else "https"
    return f"{scheme}://{registry}"
