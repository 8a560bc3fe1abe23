"""Pure translation of a pod spec into what the agent runs: env, mounts, working dir, devices.

Everything here works on plain dicts as the API server serves them (camelCase JSON) and raises
ConfigError with the reason and message kubelet would show, so the caller can put them in status.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import os
from dataclasses import dataclass, field
from typing import Any

Obj = dict[str, Any]


class ConfigError(Exception):
    """A container cannot be started as specified; reason goes into containerStatuses."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class ClusterData:
    """The API objects a pod refers to, fetched by the caller: {name: object}."""

    config_maps: dict[str, Obj] = field(default_factory=dict)
    secrets: dict[str, Obj] = field(default_factory=dict)


def config_map_data(cm: Obj) -> dict[str, bytes]:
    data = {k: v.encode() for k, v in (cm.get("data") or {}).items()}
    data.update({k: base64.b64decode(v) for k, v in (cm.get("binaryData") or {}).items()})
    return data


def secret_data(secret: Obj) -> dict[str, bytes]:
    data = {k: base64.b64decode(v) for k, v in (secret.get("data") or {}).items()}
    data.update({k: v.encode() for k, v in (secret.get("stringData") or {}).items()})
    return data


def field_value(pod: Obj, path: str) -> str:
    """Resolve a downward-API fieldPath against the pod."""
    meta, spec, status = pod.get("metadata", {}), pod.get("spec", {}), pod.get("status", {})
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.podIP": status.get("podIP", ""),
        "status.hostIP": status.get("hostIP", ""),
    }
    if path in simple:
        return str(simple[path])
    if path == "status.podIPs":
        return ",".join(ip["ip"] for ip in status.get("podIPs", []))
    for prefix, source in (("metadata.labels", "labels"), ("metadata.annotations", "annotations")):
        values: dict[str, str] = meta.get(source) or {}
        if path == prefix:
            return "\n".join(f'{k}="{v}"' for k, v in sorted(values.items()))
        if path.startswith(prefix + "['") and path.endswith("']"):
            return values.get(path[len(prefix) + 2 : -2], "")
    raise ConfigError("CreateContainerConfigError", f"unsupported fieldPath {path!r}")


def _lookup(kind: str, objects: dict[str, Obj], ref: Obj) -> Obj | None:
    obj = objects.get(ref.get("name", ""))
    if obj is None and not ref.get("optional", False):
        raise ConfigError("CreateContainerConfigError", f'{kind} "{ref.get("name")}" not found')
    return obj


def resolve_env(pod: Obj, container: Obj, data: ClusterData) -> dict[str, str]:
    """envFrom first, then env in order; $(VAR) references expand against what came before."""
    env: dict[str, str] = {}
    for source in container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        if "configMapRef" in source:
            cm = _lookup("configmap", data.config_maps, source["configMapRef"])
            values = config_map_data(cm) if cm else {}
        elif "secretRef" in source:
            secret = _lookup("secret", data.secrets, source["secretRef"])
            values = secret_data(secret) if secret else {}
        else:
            continue
        env.update({prefix + k: v.decode() for k, v in values.items()})
    for var in container.get("env") or []:
        name = var["name"]
        if "valueFrom" not in var:
            env[name] = expand(var.get("value", ""), env)
            continue
        source = var["valueFrom"]
        if "fieldRef" in source:
            env[name] = field_value(pod, source["fieldRef"]["fieldPath"])
        elif "configMapKeyRef" in source:
            env_value = _key("configmap", data.config_maps, source["configMapKeyRef"], config_map_data)
            if env_value is not None:
                env[name] = env_value
        elif "secretKeyRef" in source:
            env_value = _key("secret", data.secrets, source["secretKeyRef"], secret_data)
            if env_value is not None:
                env[name] = env_value
        elif "resourceFieldRef" in source:
            env[name] = resource_field(container, source["resourceFieldRef"])
    return env


def _key(kind: str, objects: dict[str, Obj], ref: Obj, decode: Any) -> str | None:
    obj = _lookup(kind, objects, ref)
    if obj is None:
        return None
    values: dict[str, bytes] = decode(obj)
    if ref["key"] not in values:
        if ref.get("optional", False):
            return None
        raise ConfigError("CreateContainerConfigError", f"couldn't find key {ref['key']} in {kind} {ref.get('name')}")
    return values[ref["key"]].decode()


def resource_field(container: Obj, ref: Obj) -> str:
    kind, _, name = ref["resource"].partition(".")
    value = (container.get("resources", {}).get(kind) or {}).get(name, "0")
    return str(value)


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes $(VAR) expansion: $$ escapes, unknown references stay as written."""
    out, i = [], 0
    while i < len(value):
        if value.startswith("$$", i):
            out.append("$")
            i += 2
        elif value.startswith("$(", i) and (end := value.find(")", i)) != -1:
            name = value[i + 2 : end]
            out.append(env.get(name, value[i : end + 1]))
            i = end + 1
        else:
            out.append(value[i])
            i += 1
    return "".join(out)


def command_line(container: Obj, env: dict[str, str]) -> list[str]:
    """command + args with $(VAR) expansion; no image means no default entrypoint to fall back on."""
    argv = [expand(a, env) for a in (container.get("command") or []) + (container.get("args") or [])]
    if not container.get("command"):
        raise ConfigError(
            "CreateContainerError",
            f"container {container['name']!r} has no command: images are not run here, "
            f"only commands from the local environment (image {container.get('image')!r} recorded)",
        )
    return argv


def referenced_objects(pod_spec: Obj) -> tuple[set[str], set[str]]:
    """Names of the ConfigMaps and Secrets a pod refers to (env, envFrom, volumes, projections)."""
    config_maps: set[str] = set()
    secrets: set[str] = set()
    for container in (pod_spec.get("initContainers") or []) + pod_spec["containers"]:
        for source in container.get("envFrom") or []:
            if "configMapRef" in source:
                config_maps.add(source["configMapRef"]["name"])
            if "secretRef" in source:
                secrets.add(source["secretRef"]["name"])
        for var in container.get("env") or []:
            ref = var.get("valueFrom") or {}
            if "configMapKeyRef" in ref:
                config_maps.add(ref["configMapKeyRef"]["name"])
            if "secretKeyRef" in ref:
                secrets.add(ref["secretKeyRef"]["name"])
    for volume in pod_spec.get("volumes") or []:
        for source in [volume, *((volume.get("projected") or {}).get("sources") or [])]:
            if "configMap" in source:
                config_maps.add(source["configMap"]["name"])
            if "secret" in source:
                secrets.add(source["secret"].get("secretName") or source["secret"].get("name"))
    return config_maps, secrets


def gpu_request(pod_spec: Obj) -> int:
    """GPUs a pod needs: the sum over its containers (limits win, as for extended resources)."""
    total = 0
    for container in pod_spec.get("containers", []):
        resources = container.get("resources") or {}
        value = (resources.get("limits") or {}).get("nvidia.com/gpu") or (resources.get("requests") or {}).get(
            "nvidia.com/gpu"
        )
        total += int(value or 0)
    return total


def allocate_gpus(wanted: int, capacity: int, in_use: set[int]) -> list[int] | None:
    free = [i for i in range(capacity) if i not in in_use]
    return free[:wanted] if len(free) >= wanted else None


def allocate_address(network: str, taken: set[str], key: str) -> str:
    """A free address in `network`, first tried at a stable spot derived from `key`."""
    net = ipaddress.ip_network(network)
    hosts = net.num_addresses - 2
    start = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") % hosts
    for offset in range(hosts):
        candidate = str(net.network_address + 1 + (start + offset) % hosts)
        if candidate not in taken and not candidate.endswith(".255") and not candidate.endswith(".0"):
            return candidate
    raise RuntimeError(f"no free address left in {network}")


def image_repository_name(image: str) -> str:
    """The last path segment of an image reference, without tag or digest: `localhost/loom/vllm:0.1.0` -> `vllm`."""
    name = image.split("@", 1)[0].rsplit("/", 1)[-1]
    return name.split(":", 1)[0]


def environment_for(image: str, image_environments: dict[str, str], default_bin_dir: str) -> str:
    """The bin folder a container's programs come from. Images are never pulled here: an image whose repository
    name is mapped (`vllm` -> the checkout's .venv-vllm/bin) runs from that environment, every other image from
    the project's virtualenv. A mapped environment that does not exist is a CreateContainerError naming it."""
    bin_dir = image_environments.get(image_repository_name(image))
    if bin_dir is None:
        return default_bin_dir
    if not os.path.isdir(bin_dir):
        raise ConfigError(
            "CreateContainerError",
            f"image {image!r} runs from the local environment {bin_dir}, which does not exist "
            "(make venv-vllm builds .venv-vllm)",
        )
    return bin_dir


def base_environment(bin_dir: str, pod_ip: str, shim: str | None) -> dict[str, str]:
    """What every container gets before its own env: the project's programs first on PATH."""
    path = os.pathsep.join([bin_dir, "/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"])
    env = {
        "PATH": path,
        "HOME": "/root",
        "LANG": os.environ.get("LANG", "C.UTF-8"),
        "PYTHONSAFEPATH": "1",
        "PYTHONUNBUFFERED": "1",
        "LOOM_POD_IP": pod_ip,
    }
    if shim:
        env["LD_PRELOAD"] = shim
    return env


def api_server_environment(host: str, port: int) -> dict[str, str]:
    """The variables a kubelet gives every container for the `kubernetes` Service, which in-cluster clients
    (client-go, the Python client, Kopf) read to find the API server. They name the API server's real address:
    nothing routes the Service's ClusterIP here (no kube-proxy)."""
    url_host = f"[{host}]" if ":" in host else host
    link = f"KUBERNETES_PORT_{port}_TCP"
    return {
        "KUBERNETES_SERVICE_HOST": host,
        "KUBERNETES_SERVICE_PORT": str(port),
        "KUBERNETES_SERVICE_PORT_HTTPS": str(port),
        "KUBERNETES_PORT": f"tcp://{url_host}:{port}",
        link: f"tcp://{url_host}:{port}",
        f"{link}_PROTO": "tcp",
        f"{link}_PORT": str(port),
        f"{link}_ADDR": host,
    }


def shutil_which(program: str, path: str) -> str | None:
    """Where `program` is found on the container's PATH (absolute paths are checked as they are)."""
    import shutil

    return shutil.which(program, path=path)
