"""Part 5: examples/inferencegraph-ab-splitter.yaml: 80% of requests to chargpt-current, 20% to a challenger. The
challenger is the serving example under the name the graph expects, with one small replica (the local node has
2 CPUs); clients call the graph as one model, and its router says which step answered."""

from __future__ import annotations

import collections
import copy
import time

import httpx

from .serving import FILE as SERVICE_FILE
from .serving import ready
from .stage import Demo, Outcome, example, is_true, wait_obj

FILE = "inferencegraph-ab-splitter.yaml"
CHALLENGER = "chargpt-challenger"
REQUESTS = 40


def challenger() -> dict:  # type: ignore[type-arg]
    (doc,) = example(SERVICE_FILE)
    doc = copy.deepcopy(doc)
    doc["metadata"]["name"] = CHALLENGER
    doc["spec"]["replicas"] = 1
    doc["spec"]["resources"]["requests"]["cpu"] = "100m"
    return dict(doc)


def run(demo: Demo) -> Outcome:
    demo.apply_obj(challenger())
    (graph,) = demo.apply_file(FILE)
    name = graph["metadata"]["name"]
    steps = graph["spec"]["nodes"]["root"]["steps"]
    split = " / ".join(f"{s['serviceName']} {s['weight']}%" for s in steps)
    demo.ui.info(f"kubectl apply -f examples/{FILE}: InferenceGraph {name} ({split}), and {CHALLENGER} (1 replica)")
    wait_obj(demo, "inferenceservice", CHALLENGER, ready, 600, "Ready")
    obj = wait_obj(demo, "inferencegraph", name, lambda o: is_true(o, "Ready"), 300, "Ready")
    url = demo.model_url(name, "generate")
    answered: collections.Counter[str] = collections.Counter()
    body = {"text_input": "To be", "parameters": {"max_tokens": 8, "temperature": 0}}
    headers = {"Authorization": f"Bearer {demo.api_key}"}
    started = time.monotonic()
    with httpx.Client(trust_env=False, timeout=60) as client:
        for _ in range(REQUESTS):
            response = client.post(url, json=body, headers=headers)
            response.raise_for_status()
            # loom-graph-steps: <node>.<step>=<outcome>, the step named by its service here.
            step = response.headers.get("loom-graph-steps", "?").split(",")[0].split("=")[0].removeprefix("root.")
            answered[step] += 1
    per_request_ms = (time.monotonic() - started) * 1000 / REQUESTS
    shares = ", ".join(f"{service} {count}" for service, count in answered.most_common())
    demo.ui.info(f"{REQUESTS} requests through {obj['status'].get('url')}: {shares}")
    return Outcome(
        f"InferenceGraph {name} Ready in front of {len(steps)} services: {shares} of {REQUESTS} requests",
        f"{shares}; {per_request_ms:.0f} ms/request",
    )
