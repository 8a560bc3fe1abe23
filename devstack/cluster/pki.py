"""Certificates and keys of the local control plane, generated once per state directory.

One CA signs everything: the API server's serving certificate, a client certificate per component
(the user names Kubernetes' default RBAC roles are bound to), the serving certificate of our node
agent, and kwok's. The service-account token signing key pair is separate from the CA.
ECDSA P-256 keys: generated in microseconds, accepted by every component.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from loom.devstack.cluster.realnode import config as realnode_config

SERVICE_CIDR = "10.96.0.0/16"
# The first address of the service range is the `kubernetes` Service's ClusterIP.
KUBERNETES_SERVICE_IP = "10.96.0.1"
AGENT_NODE_NAME = "loom-local"
# The real node (realnode/config.py): its name, its address (the API server's advertised one, through the relay) and
# the `kubernetes` Service's ClusterIP of a stack started with it (its own service range).
REAL_NODE_NAME = realnode_config.NODE_NAME
REAL_NODE_IP = realnode_config.NODE_IP
REAL_NODE_KUBERNETES_SERVICE_IP = realnode_config.KUBERNETES_SERVICE_IP
VALIDITY = datetime.timedelta(days=3650)

# name -> (common name, organizations, client?, server?, DNS names, IPs)
_LEAVES: dict[str, tuple[str, tuple[str, ...], bool, bool, tuple[str, ...], tuple[str, ...]]] = {
    "apiserver": (
        "kube-apiserver",
        (),
        False,
        True,
        (
            "localhost",
            "kubernetes",
            "kubernetes.default",
            "kubernetes.default.svc",
            "kubernetes.default.svc.cluster.local",
        ),
        ("127.0.0.1", KUBERNETES_SERVICE_IP, REAL_NODE_KUBERNETES_SERVICE_IP, REAL_NODE_IP),
    ),
    "admin": ("loom-admin", ("system:masters",), True, False, (), ()),
    # An operator run as this identity has its requests written to the API server's audit log (and only it):
    # how bench/bench_steady_requests.py counts what the operator asks of the API server.
    "audited-operator": ("loom-audited-operator", ("system:masters",), True, False, (), ()),
    "controller-manager": ("system:kube-controller-manager", (), True, False, (), ()),
    "scheduler": ("system:kube-scheduler", (), True, False, (), ()),
    # The API server presents this to kubelets (our node agent) for logs, exec and port-forward.
    "apiserver-kubelet-client": ("kube-apiserver-kubelet-client", ("system:masters",), True, False, (), ()),
    "front-proxy-client": ("front-proxy-client", (), True, False, (), ()),
    "kubelet": (
        f"system:node:{AGENT_NODE_NAME}",
        ("system:nodes",),
        True,
        True,
        ("localhost", AGENT_NODE_NAME),
        ("127.0.0.1",),
    ),
    "kwok": ("kwok-controller", (), True, True, ("localhost",), ("127.0.0.1",)),
    # The real node's kubelet: its client identity (the Node authorizer's) and its serving certificate.
    "realnode-kubelet": (
        f"system:node:{REAL_NODE_NAME}",
        ("system:nodes",),
        True,
        True,
        (REAL_NODE_NAME,),
        (REAL_NODE_IP,),
    ),
    # kube-proxy: the user Kubernetes' default `system:node-proxier` binding names.
    "kube-proxy": ("system:kube-proxy", (), True, False, (), ()),
}


@dataclass(frozen=True)
class Pki:
    directory: Path

    @property
    def ca_cert(self) -> Path:
        return self.directory / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.directory / "ca.key"

    @property
    def sa_key(self) -> Path:
        return self.directory / "sa.key"

    @property
    def sa_pub(self) -> Path:
        return self.directory / "sa.pub"

    def cert(self, name: str) -> Path:
        return self.directory / f"{name}.crt"

    def key(self, name: str) -> Path:
        return self.directory / f"{name}.key"


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    path.chmod(0o600)


def _name(common_name: str, organizations: tuple[str, ...] = ()) -> x509.Name:
    attributes = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, org) for org in organizations]
    attributes.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
    return x509.Name(attributes)


def _builder(subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey) -> x509.CertificateBuilder:
    # Backdated a little: components on the same host must not see a "not yet valid" certificate.
    now = datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=5)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + VALIDITY)
    )


def _names_of(cert_file: Path) -> tuple[set[str], set[str]]:
    """A certificate's DNS and IP subject alternative names (a leaf whose names changed is issued again)."""
    cert = x509.load_pem_x509_certificate(cert_file.read_bytes())
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set(), set()
    return set(names.get_values_for_type(x509.DNSName)), {str(ip) for ip in names.get_values_for_type(x509.IPAddress)}


def ensure_pki(directory: Path) -> Pki:
    """Create whatever is missing; existing material is kept so tokens and kubeconfigs stay valid."""
    directory.mkdir(parents=True, exist_ok=True)
    pki = Pki(directory)
    if pki.ca_cert.exists() and pki.ca_key.exists():
        ca_key = serialization.load_pem_private_key(pki.ca_key.read_bytes(), password=None)
        assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
        ca_cert = x509.load_pem_x509_certificate(pki.ca_cert.read_bytes())
    else:
        ca_key = _new_key()
        ca_name = _name("loom-local-ca")
        ca_cert = (
            _builder(ca_name, ca_name, ca_key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_cert_sign=True,
                    crl_sign=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        _write_key(pki.ca_key, ca_key)
        pki.ca_cert.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))

    for name, (common_name, orgs, client, server, dns_names, ips) in _LEAVES.items():
        issued = pki.cert(name).exists() and pki.key(name).exists()
        if issued and _names_of(pki.cert(name)) == (set(dns_names), set(ips)):
            continue
        key = _new_key()
        usages = [ExtendedKeyUsageOID.CLIENT_AUTH] if client else []
        usages += [ExtendedKeyUsageOID.SERVER_AUTH] if server else []
        builder = (
            _builder(_name(common_name, orgs), ca_cert.subject, key.public_key())
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        )
        if dns_names or ips:
            alt_names: list[x509.GeneralName] = [x509.DNSName(d) for d in dns_names]
            alt_names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
            builder = builder.add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())
        _write_key(pki.key(name), key)
        pki.cert(name).write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    if not (pki.sa_key.exists() and pki.sa_pub.exists()):
        sa_key = _new_key()
        _write_key(pki.sa_key, sa_key)
        pki.sa_pub.write_bytes(
            sa_key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )
    return pki
