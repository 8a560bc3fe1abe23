#!/usr/bin/env python3
"""`REGISTRY=host/path make images push`: push the images images/build.sh built to a registry, with `buildah push`
(no Docker engine), tagged with the chart's appVersion; then print the `helm install` flags that pin them by
digest and write the same values to <state>/pushed-values.yaml.

Loom publishes no image (issue 32): whoever installs the chart builds the images and pushes them to a registry their
cluster pulls from. The chart has no default image, so the flags printed here are what an install needs:
`image.registry` (every Loom image is <registry>/<name>) and one digest per image.

Standard library only: it runs on a build host with the system python3, like images/build.sh.
Usage: images/push.py --registry HOST/PATH [--tls-verify=false] [operator trainer server features]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "loom"
NAMES = ("operator", "trainer", "server", "features", "vllm")
# The chart's workload images (LOOM_<KEY>_IMAGE) and the image each runs: the InferenceGraph router is the server.
WORKLOADS = {"trainer": "trainer", "server": "server", "router": "server", "features": "features", "vllm": "vllm"}
DIGEST = re.compile(r"^sha256:[a-f0-9]{64}$")


def app_version(chart: Path = CHART) -> str:
    """The chart's appVersion: the tag the images are pushed with and the chart's default tag."""
    match = re.search(r"^appVersion:\s*\"?([^\"\s]+)\"?\s*$", (chart / "Chart.yaml").read_text(), re.M)
    if match is None:
        raise ValueError(f"no appVersion in {chart / 'Chart.yaml'}")
    return match.group(1)


def check_registry(registry: str, chart: Path = CHART) -> str:
    """The registry path, checked with the chart's own rule (values.schema.json, image.registry): a host first (a
    dot, a port, or localhost), so that no image lands in a namespace of the default public registry."""
    registry = registry.strip().rstrip("/")
    pattern = json.loads((chart / "values.schema.json").read_text())["definitions"]["registry"]["pattern"]
    if not registry or not re.fullmatch(pattern, registry):
        raise ValueError(
            f"REGISTRY={registry!r}: set it to a registry host and path your cluster pulls from, e.g."
            " REGISTRY=registry.example.com/loom (a host with a dot or a port, or localhost; no scheme)"
        )
    return registry


def helm_values(registry: str, digests: dict[str, str]) -> dict[str, object]:
    """The chart values that install exactly the pushed images: the registry and each image's digest."""
    bad = {name: digest for name, digest in digests.items() if name not in NAMES or not DIGEST.match(digest)}
    if bad:
        raise ValueError(f"not an image of Loom with a sha256 digest: {bad}")
    image: dict[str, str] = {"registry": registry}
    if "operator" in digests:
        image["digest"] = digests["operator"]
    workloads = {key: {"digest": digests[name]} for key, name in WORKLOADS.items() if name in digests}
    return {"image": image, **({"workloadImages": workloads} if workloads else {})}


def helm_flags(values: dict[str, object], prefix: str = "") -> list[str]:
    """`--set key=value` for every leaf of the values, in order."""
    flags: list[str] = []
    for key, value in values.items():
        if isinstance(value, dict):
            flags += helm_flags(value, f"{prefix}{key}.")
        else:
            flags += ["--set", f"{prefix}{key}={value}"]
    return flags


def buildah(state: Path) -> list[str]:
    """buildah on the storage images/build.sh builds into (vfs: no overlay mounts needed)."""
    return ["buildah", "--root", str(state / "storage"), "--runroot", str(state / "run"), "--storage-driver", "vfs"]


def push(registry: str, names: list[str], state: Path, version: str, tls_verify: bool) -> dict[str, str]:
    """Push localhost/loom/<name>:<version> to <registry>/<name>:<version>; the manifest digest of each."""
    digests = {}
    for name in names:
        source, target = f"localhost/loom/{name}:{version}", f"{registry}/{name}:{version}"
        with tempfile.TemporaryDirectory() as scratch:
            digest_file = Path(scratch) / "digest"
            argv = [*buildah(state), "push", "--quiet", f"--tls-verify={str(tls_verify).lower()}"]
            argv += ["--digestfile", str(digest_file), source, f"docker://{target}"]
            result = subprocess.run(argv, capture_output=True, text=True, check=False)
            if result.returncode != 0:
                raise RuntimeError(
                    f"buildah push {source} to {target} failed ({result.returncode}): {result.stderr.strip()}"
                    + (f"\n(build it first: make images IMAGES={name})" if "image not known" in result.stderr else "")
                )
            digests[name] = digest_file.read_text().strip()
        print(f"images: pushed {target}@{digests[name]}", flush=True)
    return digests


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--registry", default=os.environ.get("REGISTRY", ""), help="host/path (default: $REGISTRY)")
    parser.add_argument("--tls-verify", default="true", choices=("true", "false"), help="false: plain HTTP registry")
    parser.add_argument("--state", type=Path, default=Path(os.environ.get("LOOM_IMAGES_STATE", ROOT / ".state/images")))
    parser.add_argument("names", nargs="*", default=list(NAMES), help=f"images to push (default: {' '.join(NAMES)})")
    args = parser.parse_args(argv)
    try:
        registry = check_registry(args.registry)
        unknown = sorted(set(args.names) - set(NAMES))
        if unknown:
            raise ValueError(f"no such image: {', '.join(unknown)} (Loom's images: {' '.join(NAMES)})")
        version = app_version()
        digests = push(registry, args.names, args.state, version, args.tls_verify == "true")
    except (ValueError, RuntimeError) as error:
        print(f"images: {error}", file=sys.stderr)
        return 2
    values = helm_values(registry, digests)
    values_file = args.state / "pushed-values.yaml"
    values_file.write_text(json.dumps(values, indent=2) + "\n")  # JSON is YAML: helm reads it with -f
    missing = [name for name in NAMES if name not in digests]
    print(f"images: {registry}/<name>:{version}; install them, pinned by digest, with these helm flags:")
    print("  " + " ".join(helm_flags(values)))
    print(f"images: the same values are in {values_file} (helm install ... -f {values_file})")
    if missing:
        print(f"images: not pushed this time: {' '.join(missing)} (their tag {version} is used unpinned)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
