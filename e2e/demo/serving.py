"""Part 4: examples/inferenceservice-chargpt-from-trainingjob.yaml serves what the TrainingJob produced (2 replicas,
API keys, rate limit); a generation is streamed through its Service and printed token by token."""

from __future__ import annotations

import copy
import json
import time
from typing import Any

import httpx

from .stage import Demo, Outcome, example, is_true, wait_obj

FILE = "inferenceservice-chargpt-from-trainingjob.yaml"
PROMPT = "The "
CHALLENGER = "chargpt-challenger"  # part 5's second service, the name examples/inferencegraph-ab-splitter.yaml uses


def challenger() -> dict[str, Any]:
    """The serving example under the name the A/B graph expects, with one small replica (the node has 2 CPUs)."""
    (doc,) = example(FILE)
    doc = copy.deepcopy(doc)
    doc["metadata"]["name"] = CHALLENGER
    doc["spec"]["replicas"] = 1
    doc["spec"]["resources"]["requests"]["cpu"] = "100m"
    return dict(doc)


def ready(obj: dict) -> bool:  # type: ignore[type-arg]
    return is_true(obj, "Ready") and (obj.get("status") or {}).get("phase") == "Ready"


def stream(demo: Demo, service: str, prompt: str, max_tokens: int) -> tuple[str, float, float, int]:
    """Print a generate_stream's tokens as they arrive; (text, first token s, total s, tokens)."""
    body = {"text_input": prompt, "parameters": {"max_tokens": max_tokens, "temperature": 0.8}}
    headers = {"Authorization": f"Bearer {demo.api_key}"}
    printer = demo.ui.tokens()
    printer.token(prompt)
    text, first, count = "", 0.0, 0
    sent = time.monotonic()
    with httpx.stream(
        "POST", demo.model_url(service, "generate_stream"), json=body, headers=headers, timeout=120, trust_env=False
    ) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data:"):
                continue
            token = json.loads(line[5:]).get("text_output", "")
            if token:
                first = first or time.monotonic() - sent
                count += 1
                text += token
                printer.token(token)
    printer.end()
    return text, first, time.monotonic() - sent, count


def run(demo: Demo) -> Outcome:
    (doc,) = demo.apply_file(FILE)
    name = doc["metadata"]["name"]
    demo.ui.info(
        f"kubectl apply -f examples/{FILE}: {doc['spec']['replicas']} replicas of TrainingJob "
        f"{doc['spec']['model']['fromTrainingJob']['name']}'s final model, API keys required"
    )
    # Part 5's challenger loads the same model: started now, its model server starts beside these two.
    demo.apply_obj(challenger())
    demo.ui.info(f"and {CHALLENGER} (1 replica, the same model) for part 5's A/B test, starting meanwhile")
    started = time.monotonic()
    obj = wait_obj(demo, "inferenceservice", name, ready, 600, "Ready")
    status = obj["status"]
    demo.ui.info(f"Ready in {time.monotonic() - started:.0f}s: {status.get('url')} model {status.get('modelVersion')}")
    demo.facts["service"] = name
    _, first, total, tokens = stream(demo, name, PROMPT, 120)
    return Outcome(
        f"InferenceService {name} Ready ({status.get('readyReplicas', doc['spec']['replicas'])} replicas), "
        f"{tokens} tokens streamed, first after {first * 1000:.0f} ms",
        f"{tokens / max(total - first, 1e-3):.0f} tokens/s streamed",
    )
