"""GIE's own conformance suite (`conformance/` of sigs.k8s.io/gateway-api-inference-extension v1.1.0, its "Gateway"
profile) run against the local stack, with Loom's picker in the place of GIE's reference endpoint picker.

`python -m loom.devstack.gie_conformance [--gateway-class NAME] [--create-gateway-class CONTROLLER]` does:
1. Builds the suite's test binary (`go test -c ./conformance`) from a writable copy of GIE's module, at the versions
   its go.mod names, with one change: the suite's base manifests (conformance/resources/base.yaml, embedded in the
   binary) run Loom's picker in the two endpoint-picker Deployments instead of GIE's `epp` image (loom_picker_base).
   Cached under the stack's cache, keyed by that manifest: a second run only runs.
2. Installs what the suite reads from the cluster: Gateway API's standard CRDs at the version GIE's go.mod requires
   (the suite refuses any other: "the installed CRDs version is different from the suite version") and GIE's
   InferencePool CRD (devstack/cluster/gie.py).
3. Runs it (`-test.v`) and reads its output into an Outcome: how far its setup got, each test's result, and each
   failed assertion's own words.

What it does not do is provide a gateway. The suite's setup waits for the GatewayClass to be Accepted by its
controller, then for its two Gateways to be Accepted, Programmed and given an address; every test sends HTTP through
them to the backends. `--create-gateway-class` only creates the class, naming the controller that should accept it;
nothing here marks it Accepted. On the local stack no gateway controller runs and kwok's pods run no container, so
the run stops in the suite's setup (docs/tasks/routing.md, "Conformance", has the recorded outcome).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from loom.devstack.cluster import StackConfig, current, down, gie, up
from loom.devstack.cluster.gie import GIE_MODULE, GIE_VERSION
from loom.devstack.cluster.gomod import go_binary, module_dir
from loom.devstack.cluster.handle import Cluster
from loom.devstack.cluster.lifecycle import join_session, leave_session
from loom.devstack.cluster.paths import cache_root
from loom.devstack.images import image
from loom.workloads.picker.config import ENV_VAR, PickerConfig

Progress = Callable[[str], None]

# The Gateway API module GIE v1.1.0's go.mod requires; the suite checks the installed CRDs' bundle-version against it.
GATEWAY_API_MODULE = "sigs.k8s.io/gateway-api"
GATEWAY_API_VERSION = "v1.4.0"
GATEWAY_API_CRD_NAMES = tuple(
    f"{plural}.gateway.networking.k8s.io"
    for plural in ("gatewayclasses", "gateways", "httproutes", "grpcroutes", "referencegrants", "backendtlspolicies")
)
BASE_MANIFEST = "conformance/resources/base.yaml"
# The suite's endpoint pickers: GIE's `epp` listens for ext_proc on 9002 (the port each pool's endpointPickerRef
# names) and answers gRPC health ("inference-extension") on 9003; Loom's picker answers both on its one gRPC port.
EXT_PROC_PORT = 9002
HEALTH_SERVICE = "inference-extension"
DEFAULT_GATEWAY_CLASS = "gateway-conformance"  # the suite's -gateway-class default


# ---- pure: the base manifests with Loom's picker ----


def _picker_container(pool: dict[str, Any], server_image: str) -> dict[str, Any]:
    """Loom's picker for `pool` (an InferencePool manifest), as the operator runs it (`python -m
    loom.workloads.picker` of the server image, its config as JSON in LOOM_PICKER_CONFIG), on the pool's
    endpoint-picker port, with GIE's gRPC probes."""
    meta, spec = pool["metadata"], pool["spec"]
    ports = spec["targetPorts"]
    if len(ports) != 1:
        raise ValueError(f"InferencePool {meta['name']}: Loom's picker routes to one target port, not {ports}")
    config = PickerConfig(
        namespace=meta["namespace"],
        service=meta["name"],
        pod_selector=spec["selector"]["matchLabels"],
        target_port=ports[0]["number"],
        ext_proc_port=spec["endpointPickerRef"]["port"]["number"],
    )
    def probe() -> dict[str, Any]:  # one object each: a shared one would be dumped as a YAML alias
        return {"grpc": {"port": config.ext_proc_port, "service": HEALTH_SERVICE}, "initialDelaySeconds": 5,
                "periodSeconds": 10}

    return {
        "name": "epp",
        "image": server_image,
        "command": ["python", "-m", "loom.workloads.picker"],
        "env": [{"name": ENV_VAR, "value": config.to_json()}],
        "ports": [{"name": "grpc", "containerPort": config.ext_proc_port},
                  {"name": "http", "containerPort": config.port},
                  {"name": "admin", "containerPort": config.admin_port}],
        "livenessProbe": probe(),
        "readinessProbe": probe(),
    }


def loom_picker_base(base_yaml: str, server_image: str) -> str:
    """The suite's base manifests with each InferencePool's endpoint-picker Deployment running Loom's picker instead
    of GIE's `epp` (its only container replaced; the Deployment, its labels, the Services and RBAC kept). The picker's
    Deployment is found as the suite wires it: the pool's endpointPickerRef names a Service whose selector matches
    the Deployment's pod labels."""
    docs = [d for d in yaml.safe_load_all(base_yaml) if d]
    services = {(d["metadata"]["namespace"], d["metadata"]["name"]): d for d in docs if d["kind"] == "Service"}
    replaced = 0
    for pool in (d for d in docs if d["kind"] == "InferencePool"):
        namespace = pool["metadata"]["namespace"]
        service = services[(namespace, pool["spec"]["endpointPickerRef"]["name"])]
        selector = service["spec"]["selector"]
        for deployment in (d for d in docs if d["kind"] == "Deployment" and d["metadata"]["namespace"] == namespace):
            pod = deployment["spec"]["template"]
            if selector.items() <= pod["metadata"]["labels"].items():
                pod["spec"]["containers"] = [_picker_container(pool, server_image)]
                pod["spec"].pop("volumes", None)  # the epp's plugins file; the picker's config is in its env
                replaced += 1
    if replaced == 0:
        raise ValueError("no endpoint-picker Deployment found in the suite's base manifests")
    return yaml.safe_dump_all(docs, sort_keys=False)


# ---- pure: what the suite's `go test -v` output says ----

_RESULT = re.compile(r"^\s*--- (PASS|FAIL|SKIP): (\S+) \(")
_SETUP = re.compile(r"Test Setup: (.+)$")
# testify's layout: "\t<Label>:<padding>\t<value>", a value's further lines "\t<padding>\t<line>".
_ASSERTION = re.compile(r"^\s*\t(Error|Messages):\s*\t(.*)$")
_CONTINUED = re.compile(r"^\s*\t +\t(.*)$")
_LABELLED = re.compile(r"^\s*\t[A-Z][A-Za-z ]*:\s*\t")


@dataclass
class Outcome:
    results: dict[str, str] = field(default_factory=dict)  # test (TestConformance/<ShortName>) -> PASS|FAIL|SKIP
    setup: list[str] = field(default_factory=list)  # the "Test Setup:" steps it reached, in order
    errors: list[str] = field(default_factory=list)  # each failed assertion: its Error and Messages lines

    def tests(self, result: str) -> list[str]:
        """The suite's own tests (subtests of TestConformance) with this result."""
        return [name for name, r in self.results.items() if r == result and "/" in name]

    def summary(self) -> dict[str, Any]:
        return {
            "setup_reached": self.setup,
            "suite": self.results.get("TestConformance", "NOT RUN"),
            "tests_passed": self.tests("PASS"),
            "tests_failed": self.tests("FAIL"),
            "tests_skipped": self.tests("SKIP"),
            "errors": self.errors,
        }


def parse_output(lines: Iterable[str]) -> Outcome:
    """Read `go test -v` output of the suite. A failed assertion's Error and Messages (testify's layout, each value
    possibly on several lines) are joined as one error."""
    outcome = Outcome()
    current: list[str] = []
    in_assertion = False  # the last labelled line was Error or Messages (not Error Trace, Test)
    for line in lines:
        line = line.rstrip("\n")
        if match := _RESULT.match(line):
            outcome.results[match[2]] = match[1]
        elif match := _SETUP.search(line):
            outcome.setup.append(match[1].strip())
        if match := _ASSERTION.match(line):
            if match[1] == "Error" and current:
                outcome.errors.append(" | ".join(current))
                current = []
            current.append(f"{match[1]}: {match[2].strip()}")
            in_assertion = True
        elif (match := _CONTINUED.match(line)) and in_assertion:
            current[-1] = f"{current[-1]} {match[1].strip()}"
        elif _LABELLED.match(line) or not line.startswith((" ", "\t")):
            in_assertion = False
    if current:
        outcome.errors.append(" | ".join(current))
    return outcome


# ---- the edges: build, install, run ----


def suite_dir(base_yaml: str) -> Path:
    digest = hashlib.sha256(f"{GIE_VERSION}\0{platform.machine()}\0{base_yaml}".encode()).hexdigest()[:16]
    return cache_root() / f"gie-conformance-{GIE_VERSION}-{digest}"


def build_suite(progress: Progress = print) -> Path:
    """The suite's test binary with Loom's picker in its base manifests (cached)."""
    source = module_dir(GIE_MODULE, GIE_VERSION)
    base = loom_picker_base((source / BASE_MANIFEST).read_text(), image("server"))
    final = suite_dir(base)
    binary = final / "gie-conformance.test"
    if binary.is_file():
        return binary
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".gie-conformance-", dir=final.parent) as staging:
        tree = Path(staging) / "src"
        shutil.copytree(source, tree)  # the module cache is read-only; the embedded manifest must change
        for path in (tree, *tree.rglob("*")):
            path.chmod(path.stat().st_mode | 0o200)
        (tree / BASE_MANIFEST).write_text(base)
        progress(f"gie-conformance: go test -c ./conformance of {GIE_MODULE} {GIE_VERSION} (cold builds take a while)")
        env = {"CGO_ENABLED": "0", "GOFLAGS": "-mod=readonly -buildvcs=false"}  # as the stack's builds (build.py)
        started = time.monotonic()
        subprocess.run([go_binary(), "test", "-c", "-trimpath", "-o", str(Path(staging) / binary.name),
                        "./conformance"], cwd=tree, env={**os.environ, **env}, check=True)
        shutil.rmtree(final, ignore_errors=True)
        final.mkdir()
        (Path(staging) / binary.name).rename(binary)
        (final / "base.yaml").write_text(base)  # what the binary embeds, for reading
        progress(f"gie-conformance: built in {time.monotonic() - started:.0f}s -> {binary}")
    return binary


def install_crds(cluster: Cluster, progress: Progress = print) -> None:
    """Gateway API's standard CRDs at GATEWAY_API_VERSION and GIE's InferencePool CRD; idempotent."""
    gie.install_crds(cluster, progress)
    folder = module_dir(GATEWAY_API_MODULE, GATEWAY_API_VERSION) / "config" / "crd" / "standard"
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=loom-devstack", "-f", str(folder))
    cluster.wait_crds_established(GATEWAY_API_CRD_NAMES, timeout_s=60)
    progress(f"gie-conformance: Gateway API {GATEWAY_API_VERSION} standard CRDs installed")


def gateway_class(name: str, controller: str) -> dict[str, Any]:
    return {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "GatewayClass", "metadata": {"name": name},
            "spec": {"controllerName": controller}}


def run_suite(binary: Path, cluster: Cluster, gateway_class_name: str, log: Path, timeout_s: int) -> Outcome:
    """Run the suite; its output goes to `log` and stdout, and is parsed when it ends."""
    argv = [str(binary), "-test.v", f"-test.timeout={timeout_s}s", f"-kubeconfig={cluster.kubeconfig}",
            f"-gateway-class={gateway_class_name}", f"-report-output={log.with_suffix('.report.yaml')}"]
    lines: list[str] = []
    with log.open("w") as out, subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                                cwd=binary.parent) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            lines.append(line)
            if "observedGeneration to be updated" not in line:  # once a second while it waits: log only
                sys.stdout.write(line)
    return parse_output(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gateway-class", default=DEFAULT_GATEWAY_CLASS)
    parser.add_argument("--create-gateway-class", metavar="CONTROLLER",
                        help="create the GatewayClass (if absent) naming this controller, and delete it afterwards; "
                             "only a running controller of that name can accept it")
    parser.add_argument("--log", type=Path, default=Path(tempfile.gettempdir()) / "gie-conformance.log")
    parser.add_argument("--timeout", type=int, default=3600, help="the suite's -test.timeout, seconds")
    args = parser.parse_args(argv)

    binary = build_suite()
    join_session()
    cluster = current() or up(StackConfig.from_env(), started_by="gie-conformance")
    created = False
    try:
        install_crds(cluster)
        if args.create_gateway_class:
            manifest = json.dumps(gateway_class(args.gateway_class, args.create_gateway_class))
            created = "created" in cluster.kubectl("create", "-f", "-", stdin=manifest, check=False).stdout
        outcome = run_suite(binary, cluster, args.gateway_class, args.log, args.timeout)
    finally:
        if created:
            cluster.kubectl("delete", "gatewayclass", args.gateway_class, "--ignore-not-found")
        if leave_session():
            down()
    print(json.dumps(outcome.summary(), indent=2))
    print(f"full output: {args.log}")
    return 0 if outcome.results.get("TestConformance") == "PASS" else 1


if __name__ == "__main__":
    raise SystemExit(main())
