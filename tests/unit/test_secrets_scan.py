"""The secrets scan's pure parts (loom.e2e.secrets_scan): which Secret values count as credentials, and finding
them in texts and log files without ever printing them."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest

from loom.e2e.secrets_scan import Finding, hint, log_texts, scan, secret_values


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def test_credential_values_of_secrets() -> None:
    secrets = [
        {"type": "Opaque", "data": {"AWS_ACCESS_KEY_ID": b64("loom-local"),
                                    "AWS_SECRET_ACCESS_KEY": b64("s3cr3t-value")}},
        {"stringData": {"keys": "# comment line\nkey-aaaaaaaa\n\nkey-bbbbbbbb\nshort\n"}},
        {"data": {"password": b64("hunter2-hunter2"), "host": b64("redis.example:6379")}},
        {"type": "kubernetes.io/service-account-token", "data": {"token": b64("eyJhbGciOiJSUzI1NiJ9.token")}},
        {"data": {"api-key": "not base64!!"}},
    ]
    assert secret_values(secrets) == {"s3cr3t-value", "key-aaaaaaaa", "key-bbbbbbbb", "hunter2-hunter2"}


def test_scan_finds_each_secret_where_it_occurs_and_hints_only() -> None:
    texts = [("event ns/a", "pulled with s3cr3t-value"), ("configmap ns/b", '{"data": {"x": "fine"}}'),
             ("log /x.log", "s3cr3t-value and key-aaaaaaaa")]
    findings = scan(texts, {"s3cr3t-value", "key-aaaaaaaa", "tiny"})
    assert findings == [
        Finding("event ns/a", hint("s3cr3t-value")),
        Finding("log /x.log", hint("key-aaaaaaaa")),
        Finding("log /x.log", hint("s3cr3t-value")),
    ]
    assert "s3cr3t-value" not in " ".join(str(f) for f in findings)
    assert hint("s3cr3t-value") == "s3c...(12 chars)"


def test_log_texts_reads_every_log_file_below_the_folders(tmp_path: Path) -> None:
    (tmp_path / "a" / "c").mkdir(parents=True)
    (tmp_path / "a" / "c" / "0.log").write_text("zero")
    (tmp_path / "top.log").write_text("top")
    (tmp_path / "data.json").write_text("not a log")
    found = dict(log_texts(tmp_path, tmp_path / "missing"))
    assert found == {str(tmp_path / "a" / "c" / "0.log"): "zero", str(tmp_path / "top.log"): "top"}


def test_log_texts_skips_a_folder_removed_while_it_is_listed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The node agent reaps a deleted pod's log folder at any moment; in CI one vanished between the walk's
    # listing of its parent and of the folder itself, and rglob raised FileNotFoundError.
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "0.log").write_text("kept")
    reaped = tmp_path / "reaped"
    reaped.mkdir()
    real_rglob = Path.rglob

    def rglob(self: Path, pattern: str) -> Any:
        if self == reaped:
            raise FileNotFoundError(2, "No such file or directory", str(self / "pod"))
        return real_rglob(self, pattern)

    monkeypatch.setattr(Path, "rglob", rglob)
    assert dict(log_texts(reaped, tmp_path / "kept")) == {str(tmp_path / "kept" / "0.log"): "kept"}
