"""What a Secret volume does for a webhook server in a pod, for one the stack runs on the host (Kueue, LWS).

Both controllers' internal certificate rotators (open-policy-agent/cert-controller) write a CA and a serving
certificate into a Secret, then wait for the files to appear in their certificate directory, as the kubelet would
put them there for a mounted Secret. Here the stack copies them once the rotator wrote them.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

from loom.devstack.cluster.handle import Cluster, wait_until

KEYS = ("ca.crt", "tls.key", "tls.crt")  # tls.crt last: its presence is what the rotator waits for


def sync_from_secret(cluster: Cluster, namespace: str, secret: str, cert_dir: Path, timeout_s: float = 90) -> None:
    """Wait until the Secret holds the rotator's keys, then write each into cert_dir (atomically, when changed)."""

    def written() -> dict[str, str] | None:
        result = cluster.kubectl("get", "secret", "-n", namespace, secret, "-o", "json", check=False)
        if result.returncode != 0:
            return None
        data: dict[str, str] = json.loads(result.stdout).get("data") or {}
        return data if set(KEYS) <= set(data) else None

    data = wait_until(written, timeout_s, f"the webhook certificate in Secret {namespace}/{secret}", interval=0.5)
    cert_dir.mkdir(parents=True, exist_ok=True)
    for key in KEYS:
        target = cert_dir / key
        content = base64.b64decode(data[key])
        if not target.exists() or target.read_bytes() != content:
            staging = target.with_suffix(".tmp")
            staging.write_bytes(content)
            staging.chmod(0o600)
            staging.rename(target)
