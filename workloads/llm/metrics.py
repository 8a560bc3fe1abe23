"""LLM metrics on the front's /metrics.

Two sources, one exposition:
- ``loom_llm_*``: measured by the front itself, as a client sees it (its own queueing and the engine's):
  time to first token, time per output token, end-to-end latency, prompt and generated tokens, answers by code.
- ``vllm:*``: the engine's own series (requests running and waiting, KV-cache usage, prefix-cache queries and
  hits, the engine's latency histograms), scraped from the engine's /metrics at each scrape of the front and
  passed through unchanged. Only ``vllm:`` families are kept: the engine's process and Python collectors would
  otherwise clash with nothing useful.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
ENGINE_PREFIX = "vllm:"


class LlmMetrics:
    def __init__(self, model: str) -> None:
        self.model = model
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model"]
        self.ttft = Histogram("loom_llm_time_to_first_token_seconds", "Request start to its first generated token.",
                              labels, buckets=LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("loom_llm_time_per_output_token_seconds",
                              "Mean time between generated tokens after the first, per request.",
                              labels, buckets=TOKEN_BUCKETS, registry=self.registry)
        self.e2e = Histogram("loom_llm_e2e_request_latency_seconds", "Request start to its last byte.",
                             labels, buckets=LATENCY_BUCKETS, registry=self.registry)
        self.prompt_tokens = Counter("loom_llm_prompt_tokens", "Prompt tokens of answered requests.",
                                     labels, registry=self.registry)
        self.generation_tokens = Counter("loom_llm_generation_tokens", "Tokens generated for answered requests.",
                                         labels, registry=self.registry)
        self.requests = Counter("loom_llm_requests", "Answers of the front by endpoint and HTTP status.",
                                ["model", "endpoint", "code"], registry=self.registry)
        # Each series' child looked up once, not per request (labels() takes a lock and builds its key each time:
        # the most of a request's metrics cost, bench/bench_front_path.py).
        self._ttft, self._tpot, self._e2e = (m.labels(model) for m in (self.ttft, self.tpot, self.e2e))
        self._prompt, self._generated = self.prompt_tokens.labels(model), self.generation_tokens.labels(model)
        self._answers: dict[tuple[str, int], Counter] = {}

    def answered(self, endpoint: str, status: int) -> None:
        child = self._answers.get((endpoint, status))
        if child is None:
            child = self._answers[endpoint, status] = self.requests.labels(self.model, endpoint, str(status))
        child.inc()

    def finished(self, started: float, first_token: float | None, ended: float, prompt: int, completion: int) -> None:
        """Record one successful generation (clock readings from time.perf_counter)."""
        self._e2e.observe(ended - started)
        self._prompt.inc(prompt)
        self._generated.inc(completion)
        if first_token is not None:
            self._ttft.observe(first_token - started)
            if completion > 1:
                self._tpot.observe((ended - first_token) / (completion - 1))

    def exposition(self, engine_text: str) -> bytes:
        return generate_latest(self.registry) + engine_families(engine_text).encode()


def engine_families(text: str) -> str:
    """The ``vllm:`` families of the engine's exposition (their HELP/TYPE lines and samples)."""
    kept = []
    for line in text.splitlines():
        name = line.split(" ", 3)[2] if line.startswith(("# HELP ", "# TYPE ")) else line
        if name.startswith(ENGINE_PREFIX):
            kept.append(line)
    return "\n".join(kept) + ("\n" if kept else "")
