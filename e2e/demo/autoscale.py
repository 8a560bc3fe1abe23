"""Part 6: examples/inferenceservice-queue-depth-scale-to-zero.yaml: Loom's autoscaler reads the servers' queue
depth from Prometheus and adds a replica under load; idle, it goes to zero (the Service turns to the activator);
the next request wakes it and is answered."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx

from .serving import ready
from .stage import Demo, Outcome, example, wait, wait_obj

FILE = "inferenceservice-queue-depth-scale-to-zero.yaml"
CLIENTS = 24  # against 8 per batch: about 16 waiting, past the target of 4 per replica
LOAD_TOKENS = 32
LOAD_TIMEOUT_S = 240
ZERO_TIMEOUT_S = 420
IDLE_SECONDS = 20  # spec.autoscaling.idleSeconds for the demo; examples/ says 60


def autoscaling(obj: dict[str, Any]) -> dict[str, Any]:
    return dict((obj.get("status") or {}).get("autoscaling") or {})


def load(url: str, stop: threading.Event, answered: list[int]) -> None:
    # Short answers: the queue, not the length, is what scales; what is in flight when the load stops drains sooner.
    body = {"text_input": "To be", "parameters": {"max_tokens": LOAD_TOKENS, "temperature": 0.8}}
    with httpx.Client(trust_env=False, timeout=120) as client:
        while not stop.is_set():
            try:
                answered.append(client.post(url, json=body).status_code)
            except httpx.HTTPError:
                answered.append(0)


def run(demo: Demo) -> Outcome:
    ui = demo.ui
    # The node has 2 CPUs: the A/B test's current model keeps one replica while this one scales.
    demo.kubectl("scale", "inferenceservice", "chargpt-current", "--replicas=1", "-n", demo.namespace)
    (doc,) = example(FILE)
    name, spec = doc["metadata"]["name"], doc["spec"]["autoscaling"]
    # The example's idle period, shortened in the object's own spec so the demo does not sit through it.
    written, spec["idleSeconds"] = spec["idleSeconds"], IDLE_SECONDS
    demo.apply_obj(doc)
    ui.info(
        f"kubectl apply -f examples/{FILE} with spec.autoscaling.idleSeconds {IDLE_SECONDS} (the file says "
        f"{written}): {spec['metric']} target {spec['target']} per replica, "
        f"{spec['minReplicas']}..{spec['maxReplicas']} replicas, zero after {spec['idleSeconds']}s idle"
    )
    wait_obj(demo, "inferenceservice", name, ready, 600, "Ready")
    url = demo.model_url(name, "generate")
    stop, answered = threading.Event(), []  # type: ignore[var-annotated]
    threads = [threading.Thread(target=load, args=(url, stop, answered), daemon=True) for _ in range(CLIENTS)]
    for thread in threads:
        thread.start()
    ui.info(f"load: {CLIENTS} clients generating {LOAD_TOKENS} tokens each, again and again")
    started = time.monotonic()
    try:
        up = wait_obj(
            demo,
            "inferenceservice",
            name,
            lambda o: (o["spec"].get("replicas") or 1) > 1,
            LOAD_TIMEOUT_S,
            "scaled up by the autoscaler",
        )
        asked_s = time.monotonic() - started
        seen = autoscaling(up)
        ui.info(
            # The decision's own words: metricValue may already be a later round's sample.
            f"autoscaler: {up['spec']['replicas']} replicas after {asked_s:.0f}s "
            f"({seen.get('lastScaleReason')}: {seen.get('lastScaleMessage')})"
        )
        two = wait_obj(
            demo,
            "inferenceservice",
            name,
            lambda o: (o["status"].get("readyReplicas") or 0) > 1,
            LOAD_TIMEOUT_S,
            "a second replica Ready",
        )
        ready_s = time.monotonic() - started
        ui.info(f"{two['status']['readyReplicas']} replicas Ready {ready_s:.0f}s after the load began")
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=150)
    ok = len([code for code in answered if code == 200])
    ui.info(f"load stopped: {ok} of {len(answered)} requests answered 200; now idle")
    idle = time.monotonic()

    def at_zero(obj: dict[str, Any]) -> bool:
        return obj["spec"].get("replicas") == 0 and autoscaling(obj).get("lastScaleReason") == "ScaledToZero"

    wait_obj(demo, "inferenceservice", name, at_zero, ZERO_TIMEOUT_S, "scaled to zero")
    zero_s = time.monotonic() - idle
    wait(
        lambda: (
            not demo.kubectl(
                "get",
                "pods",
                "-n",
                demo.namespace,
                "-l",
                f"app.kubernetes.io/instance={name},app.kubernetes.io/component=server",
                "-o",
                "name",
            ).stdout.strip()
        ),
        180,
        "no model server left",
        2,
    )
    ui.info(f"scaled to zero {zero_s:.0f}s after the load stopped; the Service now points at the activator")
    woken = time.monotonic()
    response = httpx.post(
        url,
        json={"text_input": "To be", "parameters": {"max_tokens": 24, "temperature": 0}},
        timeout=300,
        trust_env=False,
    )
    wake_s = time.monotonic() - woken
    response.raise_for_status()
    ui.info(
        f"a request at zero was held, the service woke and answered in {wake_s:.0f}s: "
        f"{response.json()['text_output']!r}"
    )
    return Outcome(
        f"{name}: 1 -> {up['spec']['replicas']} replicas under load ({ok}/{len(answered)} requests answered 200), "
        f"0 after {zero_s:.0f}s idle, woken by a request and answered",
        f"scale-up asked {asked_s:.0f}s / Ready {ready_s:.0f}s; wake {wake_s:.0f}s",
    )
