"""Real backing servers on this machine for tests and the demo: an S3-compatible store and MLflow tracking.

This is the one home for such helpers (a new backing server, e.g. Prometheus or Redis, goes here too);
not to be confused with the node agent's Service proxies (loom.devstack.agent.proxies).

Each context manager starts the real program as a subprocess on a free loopback port, waits until it
answers its health check (bounded), yields its endpoint and stops it on exit. When a server does not
come up, the error names its log file so the cause is one `cat` away.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from loom.devstack.agent.shim import published_host_port
from loom.devstack.cluster.paths import AGENT_STATE_DIR

# The binaries live next to the interpreter that runs the tests (the project's virtualenv).
_BIN = Path(sys.executable).parent
_DEFAULT_START_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class S3Endpoint:
    url: str
    access_key: str
    secret_key: str
    region: str = "us-east-1"

    def env(self) -> dict[str, str]:
        """Environment a client process needs to reach this endpoint with boto3 (and MLflow)."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_ENDPOINT_URL_S3": self.url,
            "MLFLOW_S3_ENDPOINT_URL": self.url,
        }

    def client(self):  # type: ignore[no-untyped-def]  # boto3 is untyped
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.url,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=self.region,
        )


@dataclass(frozen=True)
class MLflowEndpoint:
    url: str
    artifacts_uri: str | None = None


class ServiceStartError(RuntimeError):
    pass


# Ports handed out come from below Linux's ephemeral range (32768-60999), where the kernel picks the source port of
# every outgoing connection and the port of every bind to 0: a port chosen there and bound seconds later by a slow
# starter (a vLLM engine, after a minute of imports) was taken meanwhile ("Address already in use", seen in CI).
PORT_RANGE = (20000, 32768)
_handed_out: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, below the ephemeral range, never the same twice in one process."""
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(*PORT_RANGE)
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port in {PORT_RANGE[0]}-{PORT_RANGE[1] - 1} on {host} after 200 tries")


def _service_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    # The repository has a folder named `operator`; never let a child put the cwd on sys.path.
    env["PYTHONSAFEPATH"] = "1"
    # Keep proxies away from loopback traffic.
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    env.update(extra or {})
    return env


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(200 <= response.status < 500)
    except urllib.error.HTTPError as error:
        return error.code < 500
    except (OSError, urllib.error.URLError):
        return False


@contextlib.contextmanager
def _running(
    name: str,
    argv: list[str],
    health_url: str,
    workdir: Path,
    env: Mapping[str, str] | None = None,
    timeout_s: float = _DEFAULT_START_TIMEOUT_S,
) -> Iterator[subprocess.Popen[bytes]]:
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / f"{name}.log"
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            argv,
            cwd=workdir,
            env=_service_env(env),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            # Own process group: the server's workers are stopped together with it.
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + timeout_s
        while not _http_ok(health_url):
            if process.poll() is not None:
                raise ServiceStartError(
                    f"{name} exited with code {process.returncode} before becoming healthy; log: {log_path}"
                )
            if time.monotonic() > deadline:
                raise ServiceStartError(f"{name} not healthy at {health_url} after {timeout_s:.0f}s; log: {log_path}")
            time.sleep(0.2)
        yield process
    finally:
        _stop(process)


def _stop(process: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=grace_s)


@contextlib.contextmanager
def s3_server(workdir: Path, timeout_s: float = _DEFAULT_START_TIMEOUT_S) -> Iterator[S3Endpoint]:
    """A real S3-compatible HTTP server (moto's standalone server) on a free loopback port.

    Moto accepts any credentials; the ones yielded are what clients are expected to send, so code under
    test exercises the same credential plumbing it would against MinIO or AWS.
    """
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [str(_BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(port)]
    # Pods on the node agent are given this address (a model's endpoint): publish the port to them (agent/shim.py).
    with (
        published_host_port(AGENT_STATE_DIR, port),
        _running("s3", argv, f"{url}/moto-api/", Path(workdir), timeout_s=timeout_s),
    ):
        yield S3Endpoint(url=url, access_key="loom-test-access", secret_key="loom-test-secret")


@contextlib.contextmanager
def mlflow_server(
    workdir: Path,
    s3: S3Endpoint | None = None,
    bucket: str = "mlflow",
    timeout_s: float = 120.0,
) -> Iterator[MLflowEndpoint]:
    """A real `mlflow server` with a sqlite backend; artifacts go to S3 when an endpoint is given."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [
        str(_BIN / "mlflow"),
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        # The machine running tests is small; one worker answers a test suite comfortably.
        "--workers",
        "1",
        "--backend-store-uri",
        f"sqlite:///{workdir / 'mlflow.db'}",
    ]
    # Otherwise seven job-runner processes (MLflow's GenAI evaluation jobs) start beside the server.
    env: dict[str, str] = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    artifacts_uri: str | None = None
    if s3 is not None:
        client = s3.client()
        with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
            client.create_bucket(Bucket=bucket)
        artifacts_uri = f"s3://{bucket}"
        argv += ["--artifacts-destination", artifacts_uri]
        env.update(s3.env())
    else:
        argv += ["--artifacts-destination", str(workdir / "artifacts")]
    with (
        published_host_port(AGENT_STATE_DIR, port),
        _running("mlflow", argv, f"{url}/health", workdir, env=env, timeout_s=timeout_s),
    ):
        yield MLflowEndpoint(url=url, artifacts_uri=artifacts_uri)
