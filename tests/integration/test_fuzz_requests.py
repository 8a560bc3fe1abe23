"""Chaos: fuzzed requests against a real model-server process and a real router process in front of it (issue 15).

Malformed JSON, wrong datatypes and shapes, JSON nested deeper than any parser's stack, a binary-extension length
that lies, huge bodies (declared, and streamed without a length) and slow clients: each gets a 4xx with a message
(a request that happens to be valid may get its 200), never a 5xx or a dropped connection; the processes' memory
stays bounded; good requests sent all along keep succeeding.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest
from hypothesis import HealthCheck, Phase, given, settings

from loom.devstack.servers import free_port
from loom.e2e.chaos.bodies import ALL, Probe, good_infer, problem
from loom.workloads.server.testing import model_server, running

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

MAX_BODY = 4 * 1024 * 1024  # set small here so the huge-body probes stay cheap
BODY_TIMEOUT_S = 2.0
FUZZ_EXAMPLES = 150


@dataclass
class Target:
    name: str
    url: str
    model: str
    pid: int


def _pid_of(config: Path) -> int:
    for child in psutil.Process().children(recursive=True):
        if str(config) in " ".join(child.cmdline()):
            return child.pid
    raise LookupError(f"no process runs {config}")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    folder = tmp_path_factory.mktemp("fuzz-server")
    config = folder / "server.json"
    config.write_text(json.dumps({
        "modelName": "echo", "handler": "noop", "storageUri": str(folder), "host": "127.0.0.1",
        "port": free_port(), "maxRequestBytes": MAX_BODY, "requestBodyTimeoutS": BODY_TIMEOUT_S,
    }))
    with model_server(config, folder / "server.log") as url:
        yield Target("server", url, "echo", _pid_of(config))
    assert "Traceback" not in (folder / "server.log").read_text()


@pytest.fixture(scope="module")
def router(server: Target, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    folder = tmp_path_factory.mktemp("fuzz-router")
    config, port = folder / "router.json", free_port()
    # A Switch reads the request (its condition parses the JSON); both branches reach the real server.
    config.write_text(json.dumps({
        "graphName": "g", "host": "127.0.0.1", "port": port,
        "maxRequestBytes": MAX_BODY, "requestBodyTimeoutS": BODY_TIMEOUT_S,
        "services": {"echo": {"url": server.url, "modelName": "echo"}},
        "nodes": {"root": {"routerType": "Switch", "steps": [
            {"serviceName": "echo", "condition": 'has(request.parameters) && request.parameters.route == "a"'},
            {"serviceName": "echo"},
        ]}},
    }))
    argv = [sys.executable, "-m", "loom.workloads.router", "--config", str(config)]
    with running(argv, f"http://127.0.0.1:{port}", folder / "router.log"):
        yield Target("router", f"http://127.0.0.1:{port}", "g", _pid_of(config))
    assert "Traceback" not in (folder / "router.log").read_text()


@dataclass
class GoodTraffic:
    """Good requests sent all along from another thread; every one must succeed."""

    target: Target
    sent: int = 0
    failures: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self.stop.is_set():
                self.sent += 1
                try:
                    answer = client.post(f"{self.target.url}/v2/models/{self.target.model}/infer",
                                         json=good_infer(self.sent))
                    if answer.status_code != 200 or answer.json()["outputs"][0]["data"] != [self.sent]:
                        self.failures.append(f"{answer.status_code} {answer.text[:200]}")
                except httpx.HTTPError as error:
                    self.failures.append(repr(error))
                time.sleep(0.01)


@pytest.fixture(params=["server", "router"])
def target(request: pytest.FixtureRequest) -> Iterator[Target]:
    chosen: Target = request.getfixturevalue(request.param)
    good = GoodTraffic(chosen)
    thread = threading.Thread(target=good.run, daemon=True)
    thread.start()
    yield chosen
    # A quick test may end before a handful of good requests went out: let them (the server must still answer
    # them right after the fuzzing), bounded in time, before stopping.
    deadline = time.monotonic() + 30
    while good.sent < 5 and time.monotonic() < deadline and thread.is_alive():
        time.sleep(0.05)
    good.stop.set()
    thread.join(timeout=30)
    assert good.sent >= 5 and not good.failures, good.failures[:10]


def _send(client: httpx.Client, target: Target, probe: Probe) -> tuple[int, bytes]:
    answer = client.post(f"{target.url}/v2/models/{target.model}/{probe.endpoint}", content=probe.body,
                         headers={"content-type": "application/json", **probe.headers})
    return answer.status_code, answer.content


def test_fuzzed_bodies_get_a_4xx_with_a_message(target: Target) -> None:
    problems: list[str] = []
    families: dict[str, int] = {}
    with httpx.Client(timeout=30) as client:

        @settings(max_examples=FUZZ_EXAMPLES, database=None, phases=[Phase.generate], deadline=None,
                  suppress_health_check=list(HealthCheck))
        @given(probe=ALL)
        def probe_once(probe: Probe) -> None:
            families[probe.family] = families.get(probe.family, 0) + 1
            status, body = _send(client, target, probe)
            issue = problem(probe, status, body)
            if issue:
                problems.append(issue)

        probe_once()
    print(f"[chaos requests] {target.name}: {sum(families.values())} fuzzed bodies {families}, {len(problems)} bad")
    assert not problems, "\n".join(sorted(set(problems))[:20])


def _rss(target: Target) -> int:
    return int(psutil.Process(target.pid).memory_info().rss)


def _chunks(total: int, size: int = 256 * 1024) -> Iterator[bytes]:
    for _ in range(total // size):
        yield b"7" * size


def test_huge_bodies_get_a_413_and_memory_stays_bounded(target: Target) -> None:
    before = _rss(target)
    url = f"{target.url}/v2/models/{target.model}/infer"
    with httpx.Client(timeout=60) as client:
        for _ in range(3):
            # Declared: refused from the header alone. Streamed (chunked, no length): refused at the limit.
            declared = client.post(url, content=b"x" * (MAX_BODY + 1))
            streamed = client.post(url, content=_chunks(8 * MAX_BODY))
            for answer in (declared, streamed):
                assert answer.status_code == 413, answer.text[:300]
                assert "exceeds" in answer.json()["error"]
    grown = _rss(target) - before
    # Each refusal holds at most one limit's worth of body; 64 MiB of headroom covers the allocator's slack.
    assert grown < 64 * 1024 * 1024, f"{target.name} grew by {grown / 2**20:.0f} MiB"


def _slow_client(target: Target, declared: int, sent: bytes) -> bytes:
    """Send the headers and part of a body, then nothing: the server must answer 408 on its own."""
    host, port = target.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=BODY_TIMEOUT_S * 10) as sock:
        head = (f"POST /v2/models/{target.model}/infer HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                f"content-length: {declared}\r\n\r\n").encode()
        sock.sendall(head + sent)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = sock.recv(4096)
            if not chunk:
                break
            answer += chunk
        return answer


def test_slow_clients_get_a_408_and_do_not_hold_up_others(target: Target) -> None:
    answers: list[bytes] = []
    threads = [
        threading.Thread(target=lambda n=n: answers.append(_slow_client(target, 100, b'{"inputs": '[: n % 8])))
        for n in range(20)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=BODY_TIMEOUT_S * 15)
    assert len(answers) == 20
    for answer in answers:
        assert answer.startswith(b"HTTP/1.1 408"), answer[:300]
        assert b"not received within" in answer
