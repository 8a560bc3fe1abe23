"""The endpoint picker: prefix-cache-aware routing over a vllm InferenceService's replicas.

An InferenceService with `runtime: vllm` and `spec.routing` (or more than one replica: prefix-cache is then the
default) gets one small picker pod (`<name>-picker`, the server image, `python -m loom.workloads.picker`), and
its Service `<name>` selects that pod once it is Ready. The picker watches the replicas' pods, reads each
engine's load from its /metrics, remembers which prompt blocks it sent where, and sends every request to the
replica that probably holds most of its prompt in its prefix cache, unless that one is overloaded.

Modules: `blocks` (prompt text -> chained block hashes; the per-replica LRU index), `scoring` (the choice),
`engine_metrics` (parsing vllm:* series), `state` (what the picker knows), `poll`, `kube`, `app` (the I/O).
Why a component of its own and not the InferenceGraph router: see the README's "Routing over replicas".
"""
