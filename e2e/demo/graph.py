"""Part 5: examples/inferencegraph-ab-splitter.yaml: 80% of requests to chargpt-current, 20% to a challenger. The
challenger is the serving example under the name the graph expects, with one small replica (the local node has
2 CPUs), started in part 4 beside the first service; clients call the graph as one model, and its router says
which step answered."""

from __future__ import annotations

import collections
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from .serving import CHALLENGER, challenger, ready
from .stage import Demo, Outcome, is_true, wait_obj

FILE = "inferencegraph-ab-splitter.yaml"
REQUESTS = 40
CLIENTS = 4


def run(demo: Demo) -> Outcome:
    demo.apply_obj(challenger())  # applied in part 4 already: unchanged, unless that part was skipped
    (graph,) = demo.apply_file(FILE)
    name = graph["metadata"]["name"]
    steps = graph["spec"]["nodes"]["root"]["steps"]
    split = " / ".join(f"{s['serviceName']} {s['weight']}%" for s in steps)
    demo.ui.info(f"kubectl apply -f examples/{FILE}: InferenceGraph {name} ({split}); {CHALLENGER} started in part 4")
    wait_obj(demo, "inferenceservice", CHALLENGER, ready, 600, "Ready")
    obj = wait_obj(demo, "inferencegraph", name, lambda o: is_true(o, "Ready"), 300, "Ready")
    url = demo.model_url(name, "generate")
    answered: collections.Counter[str] = collections.Counter()
    body = {"text_input": "To be", "parameters": {"max_tokens": 8, "temperature": 0}}
    headers = {"Authorization": f"Bearer {demo.api_key}"}
    started = time.monotonic()

    def ask(client: httpx.Client) -> str:
        response = client.post(url, json=body, headers=headers)
        response.raise_for_status()
        # loom-graph-steps: <node>.<step>=<outcome>, the step named by its service here.
        header = str(response.headers.get("loom-graph-steps", "?"))
        return header.split(",")[0].split("=")[0].removeprefix("root.")

    # A few clients at once, as real traffic comes: the split is per request either way.
    with httpx.Client(trust_env=False, timeout=60) as client, ThreadPoolExecutor(CLIENTS) as pool:
        answered.update(pool.map(lambda _: ask(client), range(REQUESTS)))
    seconds = time.monotonic() - started
    shares = ", ".join(f"{service} {count}" for service, count in answered.most_common())
    through = f"{REQUESTS} requests ({CLIENTS} clients at once) through {obj['status'].get('url')}"
    demo.ui.info(f"{through} in {seconds:.0f}s: {shares}")
    return Outcome(
        f"InferenceGraph {name} Ready in front of {len(steps)} services: {shares} of {REQUESTS} requests",
        f"{shares}; {REQUESTS / seconds:.1f} requests/s",
    )
