"""Kueue queueing of a TrainingJob (label kueue.x-k8s.io/queue-name) on core/queue's interface: api.py
(status.queue), workload.py (its Workload, core/queue's WorkloadOwner), state.py (the state machine's admission and
eviction transitions, its workers as core/queue's QueuedJob), io.py (the Workload reads and writes)."""
