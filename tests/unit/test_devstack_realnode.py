"""The real node's configuration (devstack/cluster/realnode): pure parts, no root, no network."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import json
import tarfile
import tomllib
from pathlib import Path

from cryptography import x509

from loom.devstack.cluster.components import Ports, control_plane
from loom.devstack.cluster.pki import ensure_pki
from loom.devstack.cluster.realnode import checkout, config, host, images, relay

NEVER_ROUTED = (ipaddress.ip_network("198.51.100.0/24"), ipaddress.ip_network("198.18.0.0/15"))


def test_every_address_of_the_node_is_in_a_range_that_is_never_routed_and_apart_from_the_agents() -> None:
    node_ip = ipaddress.ip_address(config.NODE_IP)
    assert node_ip in NEVER_ROUTED[0]
    for cidr in (config.POD_CIDR, config.SERVICE_CIDR):
        network = ipaddress.ip_network(cidr)
        assert network.subnet_of(NEVER_ROUTED[1])
        assert not network.overlaps(ipaddress.ip_network("10.96.0.0/16"))  # other stacks' node-agent Services
        assert not network.overlaps(ipaddress.ip_network("127.0.0.0/8"))
    assert not ipaddress.ip_network(config.POD_CIDR).overlaps(ipaddress.ip_network(config.SERVICE_CIDR))
    assert ipaddress.ip_address(config.KUBERNETES_SERVICE_IP) == next(ipaddress.ip_network(config.SERVICE_CIDR).hosts())


def test_kubelet_settings_this_machine_needs() -> None:
    kubelet = config.kubelet_config(Path("/ca"), Path("/c"), Path("/k"), Path("/run/x.sock"), Path("/logs"))
    assert kubelet["failCgroupV1"] is False
    assert kubelet["cgroupDriver"] == "cgroupfs"
    # Its rule dropping non-loopback traffic to 127.0.0.0/8 would cut the stack's loopback services.
    assert kubelet["makeIPTablesUtilChains"] is False
    assert kubelet["address"] == kubelet["healthzBindAddress"] == config.NODE_IP
    assert kubelet["readOnlyPort"] == 0
    assert kubelet["authentication"]["anonymous"]["enabled"] is False
    assert kubelet["containerRuntimeEndpoint"] == "unix:///run/x.sock"
    assert kubelet["registerWithTaints"] == [config.TAINT]


def test_kube_proxy_programs_nftables_on_the_node_address_only_and_leaves_conntrack_alone() -> None:
    proxy = config.kube_proxy_config(Path("/kp.kubeconfig"))
    assert proxy["mode"] == "nftables"
    assert proxy["clusterCIDR"] == config.POD_CIDR
    assert proxy["nodePortAddresses"] == [f"{config.NODE_IP}/32"]
    for address in (proxy["bindAddress"], proxy["healthzBindAddress"], proxy["metricsBindAddress"]):
        assert address.split(":")[0] == config.NODE_IP
    assert proxy["conntrack"]["maxPerCore"] == 0 and proxy["conntrack"]["min"] == 0


def test_containerd_config_is_toml_with_the_settings_runc_needs_here(tmp_path: Path) -> None:
    text = config.containerd_config(
        tmp_path / "root",
        tmp_path / "state",
        tmp_path / "c.sock",
        tmp_path / "bin",
        tmp_path / "net.d",
        "/usr/sbin/runc",
        tmp_path / "hosts",
    )
    parsed = tomllib.loads(text)
    assert parsed["version"] == 3
    assert parsed["grpc"]["address"] == str(tmp_path / "c.sock")
    runtime = parsed["plugins"]["io.containerd.cri.v1.runtime"]
    # The VM drops CAP_SYS_RESOURCE: runc fails on oom_score_adj without this.
    assert runtime["restrict_oom_score_adj"] is True
    assert runtime["netns_mounts_under_state_dir"] is True
    options = runtime["containerd"]["runtimes"]["runc"]["options"]
    assert options == {"BinaryName": "/usr/sbin/runc", "SystemdCgroup": False}
    assert runtime["cni"]["bin_dirs"] == [str(tmp_path / "bin")]
    images_section = parsed["plugins"]["io.containerd.cri.v1.images"]
    assert images_section["pinned_images"]["sandbox"] == config.SANDBOX_IMAGE
    assert images_section["registry"] == {"config_path": str(tmp_path / "hosts")}
    assert parsed["plugins"]["io.containerd.grpc.v1.cri"]["stream_server_address"] == "127.0.0.1"


def test_the_stacks_registry_is_pulled_from_over_plain_http_on_loopback() -> None:
    hosts = tomllib.loads(config.registry_hosts_toml("127.0.0.1:41234"))
    assert hosts == {
        "server": "http://127.0.0.1:41234",
        "host": {"http://127.0.0.1:41234": {"capabilities": ["pull", "resolve"]}},
    }


def test_cni_network_puts_pods_on_the_stacks_bridge_without_masquerade(tmp_path: Path) -> None:
    conflist = config.cni_conflist(tmp_path)
    bridge, portmap = conflist["plugins"]
    assert bridge["bridge"] == config.BRIDGE
    assert bridge["ipMasq"] is False  # pod traffic never leaves the machine
    assert bridge["ipam"]["ranges"] == [[{"subnet": config.POD_CIDR, "gateway": config.POD_GATEWAY}]]
    assert bridge["ipam"]["dataDir"] == str(tmp_path)
    assert portmap["backend"] == "nftables"


def test_guard_table_drops_traffic_between_the_bridge_and_any_other_interface() -> None:
    rules = config.guard_ruleset()
    assert f"table inet {config.GUARD_TABLE}" in rules
    assert f'iifname "{config.BRIDGE}" oifname != "{config.BRIDGE}" drop' in rules
    assert f'oifname "{config.BRIDGE}" iifname != "{config.BRIDGE}" drop' in rules


def test_the_control_plane_of_a_real_node_stack_uses_the_nodes_service_range(tmp_path: Path) -> None:
    pki = ensure_pki(tmp_path / "pki")
    ports = Ports(*range(40000, 40000 + len(Ports.names())))
    default = {c.name: c.argv for c in control_plane(Path("/bin"), pki, ports)}
    real = {c.name: c.argv for c in control_plane(Path("/bin"), pki, ports, real_node=True)}
    assert "--service-cluster-ip-range=10.96.0.0/16" in default["kube-apiserver"]
    assert f"--service-cluster-ip-range={config.SERVICE_CIDR}" in real["kube-apiserver"]
    assert f"--service-cluster-ip-range={config.SERVICE_CIDR}" in real["kube-controller-manager"]
    assert f"--advertise-address={config.NODE_IP}" in real["kube-apiserver"]
    assert "--endpoint-reconciler-type=lease" in real["kube-apiserver"]
    assert "--kubelet-preferred-address-types=InternalIP,Hostname" in real["kube-apiserver"]
    # The default stack's command lines are untouched (a running stack is not restarted by this change).
    assert not any("198." in arg for args in default.values() for arg in args)


def test_apiserver_certificate_names_the_real_nodes_service_ip_and_a_changed_leaf_is_issued_again(
    tmp_path: Path,
) -> None:
    pki = ensure_pki(tmp_path / "pki")

    def ips(name: str) -> set[str]:
        cert = x509.load_pem_x509_certificate(pki.cert(name).read_bytes())
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        return {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)}

    assert {config.KUBERNETES_SERVICE_IP, config.NODE_IP, "10.96.0.1", "127.0.0.1"} <= ips("apiserver")
    assert ips("realnode-kubelet") == {config.NODE_IP}
    # An apiserver certificate from before the real node (other names): issued again, the CA kept.
    pki.cert("apiserver").write_bytes(pki.cert("kwok").read_bytes())
    ca = pki.ca_cert.read_bytes()
    ensure_pki(tmp_path / "pki")
    assert config.KUBERNETES_SERVICE_IP in ips("apiserver")
    assert pki.ca_cert.read_bytes() == ca


def test_image_archive_names_its_layers_by_digest(tmp_path: Path) -> None:
    binary = tmp_path / "pause-bin"
    binary.write_bytes(b"\x7fELF fake")
    (tmp_path / "link").symlink_to(binary)  # as in the stack's bin directory: the layer holds the file, not a link
    archive = images.sandbox_archive(tmp_path / "link", tmp_path / "out")
    with tarfile.open(archive) as tar:
        manifest = json.loads(tar.extractfile("manifest.json").read())  # type: ignore[union-attr]
        (entry,) = manifest
        assert entry["RepoTags"] == [config.SANDBOX_IMAGE]
        layer = tar.extractfile(entry["Layers"][0]).read()  # type: ignore[union-attr]
        image = json.loads(tar.extractfile(entry["Config"]).read())  # type: ignore[union-attr]
    assert image["rootfs"]["diff_ids"] == [f"sha256:{hashlib.sha256(layer).hexdigest()}"]
    assert image["config"]["Entrypoint"] == ["/pause"]
    with tarfile.open(fileobj=__import__("io").BytesIO(layer)) as inner:
        (member,) = inner.getmembers()
        assert (member.name, member.mode, member.uid, member.isfile()) == ("pause", 0o755, 0, True)
        assert inner.extractfile(member).read() == b"\x7fELF fake"  # type: ignore[union-attr]


def test_mounts_under_finds_only_the_nodes_deepest_first() -> None:
    mountinfo = "\n".join(
        [
            "1 0 8:1 / / rw - ext4 /dev/vda rw",
            "2 1 0:5 / /work/s/realnode/kubelet/pods/x/volumes/tok rw - tmpfs tmpfs rw",
            "3 1 0:6 / /work/s/realnode/containerd/rootfs rw - overlay overlay rw",
            "4 1 0:7 / /work/s/realnode-other rw - tmpfs tmpfs rw",
            "5 1 0:8 / /run/loom-real-node/containerd/netns/cni-1 rw - nsfs nsfs rw",
        ]
    )
    found = host.mounts_under([Path("/work/s/realnode"), Path("/run/loom-real-node")], mountinfo)
    assert found[0] == "/work/s/realnode/kubelet/pods/x/volumes/tok"
    assert set(found) == {
        "/work/s/realnode/kubelet/pods/x/volumes/tok",
        "/work/s/realnode/containerd/rootfs",
        "/run/loom-real-node/containerd/netns/cni-1",
    }


def test_relay_forwards_both_ways() -> None:
    async def scenario() -> bytes:
        async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(b"echo:" + await reader.readexactly(5))
            await writer.drain()
            writer.close()

        target = await asyncio.start_server(echo, "127.0.0.1", 0)
        target_port = target.sockets[0].getsockname()[1]
        listener = await asyncio.start_server(
            lambda r, w: relay._handle(r, w, ("127.0.0.1", target_port)), "127.0.0.1", 0
        )
        port = listener.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"hello")
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(100), 5)
        writer.close()
        for server in (listener, target):
            server.close()
            with contextlib.suppress(Exception):
                await server.wait_closed()
        return answer

    assert asyncio.run(scenario()) == b"echo:hello"
    assert relay.parse_address("198.51.100.1:6443") == ("198.51.100.1", 6443)


def test_cluster_dns_serves_the_cluster_domain_on_the_node_address_and_forwards_nothing(tmp_path: Path) -> None:
    corefile = config.corefile(tmp_path / "admin.kubeconfig")
    assert f"bind {config.NODE_IP}" in corefile
    assert f"kubeconfig {tmp_path / 'admin.kubeconfig'}" in corefile
    assert "forward" not in corefile  # no query leaves the machine
    kubelet = config.kubelet_config(Path("/ca"), Path("/c"), Path("/k"), Path("/s"), Path("/l"))
    assert kubelet["clusterDNS"] == [config.NODE_IP]
    assert kubelet["clusterDomain"] == config.CLUSTER_DOMAIN


# What `ip -o -4 route show table all` and `ip -o -4 addr` print on the dev VM (its own network is TEST-NET-1), plus
# the node's bridge once up.
HOST_ROUTES = """default via 192.0.2.1 dev eth0
192.0.2.0/24 dev eth0 proto kernel scope link src 192.0.2.2
local 127.0.0.0/8 dev lo table local proto kernel scope host src 127.0.0.1
local 192.0.2.2 dev eth0 table local proto kernel scope host src 192.0.2.2
198.18.0.0/16 dev loomnode0 proto kernel scope link src 198.18.0.1
local 198.51.100.1 dev loomnode0h table local proto kernel scope host src 198.51.100.1
4: eth0    inet 192.0.2.2/24 brd 192.0.2.255 scope global eth0\\       valid_lft forever preferred_lft forever
9: loomnode0h    inet 198.51.100.1/24 scope global loomnode0h\\       valid_lft forever preferred_lft forever
"""


def test_the_node_refuses_address_ranges_the_host_already_uses() -> None:
    ours = (f"{config.NODE_IP}/{config.NODE_PREFIX}", config.POD_CIDR, config.SERVICE_CIDR)
    assert host.overlapping_routes(HOST_ROUTES, ours) == []  # the bridge's own routes are not a clash
    clashes = host.overlapping_routes(HOST_ROUTES, ("192.0.2.0/24",))  # the documentation range the VM lives in
    assert len(clashes) == 4 and all("eth0" in line for line in clashes)


def test_checkout_environment_adds_the_venvs_python_installation_unless_it_is_debians(tmp_path: Path) -> None:
    (tmp_path / ".venv").mkdir()
    cfg = tmp_path / ".venv" / "pyvenv.cfg"
    cfg.write_text("home = /root/.pyenv/versions/3.11.7/bin\nversion = 3.11.7\n")
    assert images.checkout_environment(tmp_path) == [tmp_path, Path("/root/.pyenv/versions/3.11.7")]
    cfg.write_text("home = /usr/bin\n")  # the image's own python3
    assert images.checkout_environment(tmp_path) == [tmp_path]


def test_pods_of_the_development_image_get_the_checkout_read_only() -> None:
    folders = [Path("/work/main"), Path("/root/.pyenv/versions/3.11.7")]
    policy, binding = checkout.checkout_policy("localhost/loom/dev:bookworm", folders, Path("/work/main/.venv/bin"))
    assert binding["spec"] == {"policyName": policy["metadata"]["name"]}
    spec = policy["spec"]
    assert spec["matchConstraints"]["resourceRules"][0]["resources"] == ["pods"]
    assert spec["matchConstraints"]["resourceRules"][0]["operations"] == ["CREATE"]
    [condition] = spec["matchConditions"]
    assert condition["expression"] == 'object.spec.containers.exists(c, c.image == "localhost/loom/dev:bookworm")'
    [mutation] = spec["mutations"]
    expression = mutation["applyConfiguration"]["expression"]
    # Each folder a hostPath volume, mounted read-only at its own path in every container; the .venv first on PATH.
    for i, folder in enumerate(folders):
        assert f'name: "loom-env-{i}", hostPath: Object.spec.volumes.hostPath{{path: "{folder}"' in expression
        assert f'mountPath: "{folder}", readOnly: true' in expression
    assert f'value: "/work/main/.venv/bin:{checkout.IMAGE_PATH}"' in expression
    assert expression.count("{") == expression.count("}") and expression.count("(") == expression.count(")")
