"""What the real node runs with: its addresses, and the configuration of containerd, the CNI plugins, the kubelet and
kube-proxy. Pure: the edges (host.py, node.py) write and apply it.

Every address lives only on the bridge and in the pod network namespaces the stack creates on this machine, in ranges
that are never routed on the Internet (RFC 5737's TEST-NET-2 for the node, RFC 2544's benchmarking range for pods
and Services), so nothing the node does can reach, or be reached from, anywhere else; other stacks on the machine (on
loopback, with the node agent's 10.96.0.0/16 Service addresses) are left alone: kube-proxy only programs this range.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

NODE_NAME = "loom-real-0"
BRIDGE = "loomnode0"
# The node's own address lives on a link of its own: the CNI bridge plugin refuses a bridge holding any address
# but its pods' gateway.
HOST_LINK = "loomnode0h"
# TEST-NET-2, not TEST-NET-1 (192.0.2.0/24): this VM's own eth0 and default gateway live there. Whatever the range,
# host.setup_network refuses to start when a route or address of the host's already overlaps it.
NODE_IP = "198.51.100.1"
NODE_PREFIX = 24
POD_CIDR = "198.18.0.0/16"
POD_GATEWAY = "198.18.0.1"
SERVICE_CIDR = "198.19.0.0/16"
# The first address of the service range is the `kubernetes` Service's ClusterIP (the API server's certificate).
KUBERNETES_SERVICE_IP = "198.19.0.1"
KUBELET_PORT = 10250
KUBELET_HEALTHZ_PORT = 10248
KUBE_PROXY_HEALTHZ_PORT = 10256
KUBE_PROXY_METRICS_PORT = 10249
DNS_PORT = 53
DNS_READY_PORT = 8181
CLUSTER_DOMAIN = "cluster.local"
# Pods land on the real node only when they ask for it (a toleration): the node agent stays the default for
# everything else the stack runs.
TAINT_KEY = "loom.dev/real-node"
TAINT = {"key": TAINT_KEY, "value": "true", "effect": "NoSchedule"}
TOLERATION = {"key": TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}
NODE_SELECTOR = {"kubernetes.io/hostname": NODE_NAME}
SANDBOX_IMAGE = "localhost/loom/pause:1"
CNI_NETWORK = "loom-real-node"
# The kubelet's and kube-proxy's nftables, and the stack's own guard table (host.py).
GUARD_TABLE = "loom-real-node"
# The host sysctls the kubelet (protectKernelDefaults off) and the bridge need changed; `down` restores each.
KUBELET_SYSCTLS = (
    "vm.overcommit_memory",
    "vm.panic_on_oom",
    "kernel.panic",
    "kernel.panic_on_oops",
    "kernel.keys.root_maxkeys",
    "kernel.keys.root_maxbytes",
)
NETWORK_SYSCTLS = {
    # Pod -> Service -> pod on the same bridge is routed through the host after kube-proxy's DNAT.
    "net.ipv4.ip_forward": "1",
    # Bridged replies must go through conntrack, so a Service's DNAT is undone on the way back.
    "net.bridge.bridge-nf-call-iptables": "1",
}
SAVED_SYSCTLS = (*KUBELET_SYSCTLS, *NETWORK_SYSCTLS)
# The kubelet's cgroups, below a root of our own in every v1 hierarchy, so `down` can find and remove all of them.
CGROUP_ROOT = "loom-real-node"


def containerd_config(
    root: Path, state: Path, socket: Path, cni_bin: Path, cni_conf: Path, runc: str, registry_hosts: Path
) -> str:
    """containerd 2.x's configuration (TOML, version 3). The plugins a node does not need here are disabled. Images
    come from `ctr images import` (the sandbox, the development image) or from the stack's own registry, whose
    hosts.toml (registry_hosts_toml) is in the folder `registry_hosts`."""
    disabled = [
        "io.containerd.snapshotter.v1.btrfs",
        "io.containerd.snapshotter.v1.zfs",
        "io.containerd.snapshotter.v1.devmapper",
        "io.containerd.snapshotter.v1.blockfile",
        "io.containerd.snapshotter.v1.erofs",
        "io.containerd.tracing.processor.v1.otlp",
        "io.containerd.internal.v1.tracing",
        "io.containerd.nri.v1.nri",
    ]
    lines = [
        "version = 3",
        f"root = {_toml(str(root))}",
        f"state = {_toml(str(state))}",
        f"disabled_plugins = [{', '.join(_toml(p) for p in disabled)}]",
        "",
        "[grpc]",
        f"  address = {_toml(str(socket))}",
        "",
        "[ttrpc]",
        f"  address = {_toml(str(socket) + '.ttrpc')}",
        "",
        "[plugins.'io.containerd.cri.v1.runtime']",
        # The VM drops CAP_SYS_RESOURCE: runc may not lower a process's oom_score_adj below its own.
        "  restrict_oom_score_adj = true",
        # Pod network namespaces under the node's state, where `down` finds every one of them.
        "  netns_mounts_under_state_dir = true",
        "  [plugins.'io.containerd.cri.v1.runtime'.containerd]",
        "    default_runtime_name = 'runc'",
        "    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]",
        "      runtime_type = 'io.containerd.runc.v2'",
        "      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]",
        f"        BinaryName = {_toml(runc)}",
        "        SystemdCgroup = false",
        "  [plugins.'io.containerd.cri.v1.runtime'.cni]",
        f"    bin_dirs = [{_toml(str(cni_bin))}]",
        f"    conf_dir = {_toml(str(cni_conf))}",
        "",
        "[plugins.'io.containerd.cri.v1.images']",
        "  snapshotter = 'overlayfs'",
        "  [plugins.'io.containerd.cri.v1.images'.registry]",
        # One folder per registry host (`<host:port>/hosts.toml`), read at each pull: no restart when it changes.
        f"    config_path = {_toml(str(registry_hosts))}",
        "  [plugins.'io.containerd.cri.v1.images'.pinned_images]",
        f"    sandbox = {_toml(SANDBOX_IMAGE)}",
        "",
        "[plugins.'io.containerd.grpc.v1.cri']",
        # kubectl exec/attach/port-forward: the kubelet proxies to this streaming server, on loopback only.
        "  stream_server_address = '127.0.0.1'",
        # 0: a free port, chosen by containerd at each start.
        "  stream_server_port = '0'",
        "",
    ]
    return "\n".join(lines)


def registry_hosts_toml(address: str) -> str:
    """containerd's hosts.toml for the stack's registry (`host:port` on loopback, plain HTTP: it never leaves the
    machine): pull and resolve from it directly. containerd otherwise tries HTTPS first for any registry host."""
    server = f"http://{address}"
    return f'server = {_toml(server)}\n\n[host.{_toml(server)}]\n  capabilities = ["pull", "resolve"]\n'


def _toml(value: str) -> str:
    """A TOML basic string."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def cni_conflist(data_dir: Path) -> dict[str, Any]:
    """Pods on the stack's bridge with an address of POD_CIDR; no masquerade (pod traffic never leaves the machine),
    hostPort through portmap's nftables backend (its own table, which `down` deletes)."""
    return {
        "cniVersion": "1.0.0",
        "name": CNI_NETWORK,
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                "isGateway": True,
                "isDefaultGateway": True,
                "ipMasq": False,
                # A pod reaching itself through its own Service (kube-proxy masquerades that hairpin).
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "dataDir": str(data_dir),
                    "ranges": [[{"subnet": POD_CIDR, "gateway": POD_GATEWAY}]],
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}, "backend": "nftables"},
        ],
    }


def kubelet_config(
    ca_cert: Path, tls_cert: Path, tls_key: Path, runtime_socket: Path, pod_logs: Path
) -> dict[str, Any]:
    """The kubelet's KubeletConfiguration, with the settings this machine needs (issue 29): cgroup v1 with the
    cgroupfs driver (the v1 memory hierarchy is held by the VM's init, so v2 needs a reboot), no iptables chains of
    its own (its rule dropping non-loopback traffic to 127.0.0.0/8 would cut the stack's loopback services), every
    listener on the node's own address."""
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": NODE_IP,
        "port": KUBELET_PORT,
        "readOnlyPort": 0,
        "healthzBindAddress": NODE_IP,
        "healthzPort": KUBELET_HEALTHZ_PORT,
        "tlsCertFile": str(tls_cert),
        "tlsPrivateKeyFile": str(tls_key),
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(ca_cert)},
        },
        "authorization": {"mode": "Webhook"},
        "containerRuntimeEndpoint": f"unix://{runtime_socket}",
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": f"/{CGROUP_ROOT}",
        "failCgroupV1": False,
        "failSwapOn": False,
        "makeIPTablesUtilChains": False,
        "clusterDomain": CLUSTER_DOMAIN,
        # CoreDNS on the node's own address (realnode/node.py): Service names resolve in pods.
        "clusterDNS": [NODE_IP],
        "podLogsDir": str(pod_logs),
        "registerWithTaints": [TAINT],
        # A shared build machine's disk is often fuller than the defaults allow: never evict or collect images
        # for disk pressure (the images are imported, not pulled: a collected one would not come back).
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "shutdownGracePeriod": "0s",
        "maxPods": 110,
        "serializeImagePulls": False,
    }


def kube_proxy_config(kubeconfig: Path) -> dict[str, Any]:
    """kube-proxy in nftables mode (its own `kube-proxy` tables), NodePorts on the node's address only, and the
    host's conntrack settings left as they are (0: do not change)."""
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "mode": "nftables",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "hostnameOverride": NODE_NAME,
        "bindAddress": NODE_IP,
        "healthzBindAddress": f"{NODE_IP}:{KUBE_PROXY_HEALTHZ_PORT}",
        "metricsBindAddress": f"{NODE_IP}:{KUBE_PROXY_METRICS_PORT}",
        "clusterCIDR": POD_CIDR,
        "detectLocalMode": "ClusterCIDR",
        "nodePortAddresses": [f"{NODE_IP}/32"],
        "conntrack": {
            "maxPerCore": 0,
            "min": 0,
            "tcpEstablishedTimeout": "0s",
            "tcpCloseWaitTimeout": "0s",
            "udpTimeout": "0s",
            "udpStreamTimeout": "0s",
        },
    }


def corefile(kubeconfig: Path) -> str:
    """CoreDNS on the node's address: the cluster's Service and pod names, nothing forwarded (names outside the cluster
    get REFUSED, so no query leaves the machine)."""
    return "\n".join(
        [
            f"{CLUSTER_DOMAIN}:{DNS_PORT} in-addr.arpa:{DNS_PORT} {{",
            f"  bind {NODE_IP}",
            f"  ready {NODE_IP}:{DNS_READY_PORT}",
            "  errors",
            "  cache 5",
            f"  kubernetes {CLUSTER_DOMAIN} in-addr.arpa {{",
            f"    kubeconfig {kubeconfig}",
            "    pods insecure",
            "  }",
            "}",
            "",
        ]
    )


def guard_ruleset() -> str:
    """The stack's own nftables table: pod traffic may reach the host and other pods, never leave the bridge for
    another interface (no masquerade is set up; this makes "never routed anywhere else" hold even with forwarding on).
    """
    return "\n".join(
        [
            f"table inet {GUARD_TABLE} {{",
            "  chain forward {",
            "    type filter hook forward priority filter + 10; policy accept;",
            f'    iifname "{BRIDGE}" oifname != "{BRIDGE}" drop',
            f'    oifname "{BRIDGE}" iifname != "{BRIDGE}" drop',
            "  }",
            "}",
            "",
        ]
    )
