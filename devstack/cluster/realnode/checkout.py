"""Loom's workloads on the real node without an image build per change: a MutatingAdmissionPolicy (CEL, in the API
server: no webhook to run) gives every pod that runs the development image the checkout's environment, read-only at
the same paths, and a PATH that finds its `.venv` first. The operator renders pods as for any cluster; with its
workload images set to the development image (`workloadImages.<name>.repository`), the trainer's `torchrun` and the
server's `python -m ...` then run this checkout's code in a pod of their own, under the operator's security context
(uid 1000, which is why the development image's /root is traversable: a pyenv Python lives below it).

Pure: lifecycle.py applies the manifests.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

POLICY = "loom-dev-checkout"
# The image's own PATH, after the checkout's environment.
IMAGE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def _cel(value: str) -> str:
    """A CEL string literal (JSON's escaping is valid CEL for these paths)."""
    return json.dumps(value)


def _mutation(folders: list[Path], venv_bin: Path) -> str:
    """The ApplyConfiguration expression: volumes for the pod, mounts and environment for each of its containers
    (server-side apply merges them by name and path with what the pod already has)."""
    volumes = ", ".join(
        f"Object.spec.volumes{{name: {_cel(f'loom-env-{i}')}, hostPath: Object.spec.volumes.hostPath{{"
        f'path: {_cel(str(folder))}, type: "Directory"}}}}'
        for i, folder in enumerate(folders)
    )

    def container(kind: str) -> str:
        mounts = ", ".join(
            f"Object.spec.{kind}.volumeMounts{{name: {_cel(f'loom-env-{i}')}, mountPath: {_cel(str(folder))},"
            " readOnly: true}"
            for i, folder in enumerate(folders)
        )
        env = (
            f'Object.spec.{kind}.env{{name: "PATH", value: {_cel(f"{venv_bin}:{IMAGE_PATH}")}}}, '
            f'Object.spec.{kind}.env{{name: "PYTHONSAFEPATH", value: "1"}}'
        )
        return f"Object.spec.{kind}{{name: c.name, volumeMounts: [{mounts}], env: [{env}]}}"

    return (
        "Object{spec: Object.spec{"
        f"volumes: [{volumes}], "
        f"containers: object.spec.containers.map(c, {container('containers')}), "
        "?initContainers: has(object.spec.initContainers) ? "
        f"optional.of(object.spec.initContainers.map(c, {container('initContainers')})) : optional.none()"
        "}}"
    )


def checkout_policy(image: str, folders: list[Path], venv_bin: Path) -> list[dict[str, Any]]:
    """The policy and its binding: pods created with a container of `image` get `folders` mounted read-only at the
    same paths and `venv_bin` first on their PATH."""
    policy = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingAdmissionPolicy",
        "metadata": {"name": POLICY},
        "spec": {
            "matchConstraints": {
                "resourceRules": [
                    {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"]}
                ]
            },
            "matchConditions": [
                {
                    "name": "runs-the-development-image",
                    "expression": f"object.spec.containers.exists(c, c.image == {_cel(image)})",
                }
            ],
            # A pod of the development image without the checkout could not start: refuse it instead.
            "failurePolicy": "Fail",
            "reinvocationPolicy": "Never",
            "mutations": [
                {"patchType": "ApplyConfiguration", "applyConfiguration": {"expression": _mutation(folders, venv_bin)}}
            ],
        },
    }
    binding = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingAdmissionPolicyBinding",
        "metadata": {"name": POLICY},
        "spec": {"policyName": POLICY},
    }
    return [policy, binding]
