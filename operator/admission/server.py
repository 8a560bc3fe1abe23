"""Kopf's TLS webhook server for the validating handlers, from the certificate the chart mounts.

The chart generates a CA and a serving certificate for `<release>-operator-webhook.<namespace>.svc` (Helm's
genCA/genSignedCert, kept across upgrades), mounts them from a Secret at `webhook_cert_dir` and puts the CA into
the ValidatingWebhookConfiguration's caBundle. Kopf only serves: it does not manage the configuration
(`settings.admission.managed` stays None), the chart owns it, so the operator needs no RBAC on webhook
configurations and a `helm uninstall` removes it with the rest.
"""

from __future__ import annotations

from pathlib import Path

import kopf

from ..settings import OperatorSettings

CERT_FILE = "tls.crt"
KEY_FILE = "tls.key"


def webhook_server(settings: OperatorSettings) -> kopf.WebhookServer | None:
    """The server to serve admission on, or None when no certificate is configured (a host-process operator)."""
    if not settings.webhook_cert_dir:
        return None
    folder = Path(settings.webhook_cert_dir)
    for name in (CERT_FILE, KEY_FILE):
        if not (folder / name).is_file():
            raise ValueError(f"LOOM_WEBHOOK_CERT_DIR={folder}: {name} is missing (mount the webhook Secret there)")
    return kopf.WebhookServer(
        addr=settings.webhook_host,
        port=settings.webhook_port,
        certfile=str(folder / CERT_FILE),
        pkeyfile=str(folder / KEY_FILE),
    )
