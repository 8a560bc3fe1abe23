"""The TrainingJob state machine's Kueue transitions (pure; state.py runs them through decision.Machine): held Queued
until admitted, as many workers as admitted, an eviction stopped after the final checkpoint then requeued, a
finished job's Workload marked Finished. What admission allows is core/queue's generic reconcile of the job's
Workload (job.py), which drives the workers through QueuedWorkers; this module turns it into status and events.

- Queued by Kueue (label kueue.x-k8s.io/queue-name, workload.py): no worker before the Workload is admitted
  (phase Queued, with its position in the queue when Kueue's visibility API reports one); admitted, as many workers
  as Kueue admitted; evicted, every worker is stopped after its final checkpoint (bounded by
  Policy.eviction_timeout_seconds), the quota released and the job Queued again, without counting a restart or a
  failure; readmitted, a new gang attempt resumes from that checkpoint.

Evicted by Kueue (preempted by a higher priority, a quota change, a waitForPodsReady timeout), the job loses no
work: every worker gets a graceful delete, which is the trainer's signal to write a final checkpoint (SIGTERM ->
a blocking save, then exit 143; workloads/trainer/README.md); the job waits for that, at most
Policy.eviction_timeout_seconds after the eviction, then force-deletes what is left; once no worker runs, the
quota is released and the Workload requeued. Readmitted, a new gang attempt resumes from that checkpoint. An
eviction is not a failure: neither status.restarts nor status.failures counts it (status.queue.evictions does).
"""

from __future__ import annotations

from dataclasses import dataclass

from loom.workloads.trainer.config import EXIT_INTERRUPTED

from ....core.kit import format_time
from ....core.queue import workload as kueue
from ....core.queue.job import QueueObservation, finish_due, reconcile
from ..decision import Decision, Machine
from .api import QueueEviction, QueueStatus
from .workload import POD_SET

# Kueue's admission, on a job labelled kueue.x-k8s.io/queue-name.
ADMITTED_CONDITION = "Admitted"


@dataclass
class QueuedWorkers:
    """The job's workers as core/queue's QueuedJob: admission sets how many run, eviction stops them."""

    m: Machine
    pod_set: str = POD_SET

    def requested(self) -> int:
        return self.m.spec.workers.replicas

    def active(self) -> int:
        return sum(1 for pod in self.m.obs.pods if pod.live)

    def run(self, admitted: int) -> None:
        self.m.desired = admitted

    def stop(self, *, force: bool) -> None:
        for pod in self.m.obs.pods:
            if pod.live:
                self.m.delete(pod, force=force or self.m.node_lost(pod))

    def describe_eviction(self, eviction: kueue.Eviction, active: int, *, force: bool) -> str:
        if not active:
            return f"{eviction.reason}: {eviction.message}".strip()
        what = "forcing the rest" if force else "waiting for their final checkpoint"
        return f"{eviction.reason}: {active} worker(s) stopping, {what}"


def queued(m: Machine, queue: QueueObservation) -> Decision | None:
    """Kueue's admission: None when the workers may run (m.desired set to the admitted count), else the
    decision that holds them (Queued) or stops them for an eviction."""
    st, obs = m.st, m.obs
    requested = m.spec.workers.replicas
    g = reconcile(queue, QueuedWorkers(m), obs.now, m.policy.eviction_timeout_seconds)
    wl = queue.workload
    old = st.queue or QueueStatus()
    named = {"name": queue.name, "workload": wl.name if wl else None}
    position = queue.position.cluster_queue if queue.position is not None and g.state == "Queued" else None
    qs = old.model_copy(update={**named, "state": g.state, "message": g.message or None, "position": position})
    m.decision.create_workload = g.create_workload
    if g.state == "Admitted" and wl is not None:
        qs.cluster_queue = wl.cluster_queue
        qs.flavor = kueue.describe_flavors(wl.assignments)
        qs.admitted_workers = g.admitted
        if old.state != "Admitted":
            partial = f" of {requested}" if g.admitted < requested else ""
            m.event(
                "Normal",
                "Admitted",
                f"admitted by ClusterQueue {wl.cluster_queue} on flavor {qs.flavor or '-'}: "
                f"{g.admitted}{partial} worker(s)",
            )
        st.queue = qs
        return None
    if g.state == "Evicting" and wl is not None and wl.eviction is not None:
        if old.state != "Evicting":
            qs.evictions += 1
            since = format_time(wl.eviction.since or obs.now)
            qs.last_eviction = QueueEviction(reason=wl.eviction.reason, message=wl.eviction.message, time=since)
            m.event(
                "Warning",
                "Evicted",
                f"Kueue evicted the job ({wl.eviction.reason}: {wl.eviction.message}); "
                "stopping the workers after their final checkpoint",
            )
        note_checkpoint(m, qs, forced=g.force)
    if g.release:
        m.decision.release_workload = True
        if old.state == "Evicting":  # once: a release that failed to write is only repeated
            note_checkpoint(m, qs, forced=False)
            st.attempt += 1
            st.replaced_pods = []
            st.start_time = None
            step = st.checkpoint.step if st.checkpoint is not None else None
            if qs.last_eviction is not None:
                qs.last_eviction = qs.last_eviction.model_copy(
                    update={"stopped_time": format_time(obs.now), "checkpoint_step": step}
                )
            done = qs.last_eviction is not None and qs.last_eviction.checkpointed
            m.event(
                "Normal",
                "Requeued",
                f"workers stopped{' after their final checkpoint' if done else ''}; quota released, queued again "
                f"in LocalQueue {queue.name}; resumes from step {step if step is not None else 0}",
            )
    if old.state is None and g.state == "Queued":
        m.event("Normal", "Queued", f"waiting for admission by Kueue in LocalQueue {queue.name}")
    st.queue = qs
    st.phase = "Queued"
    m.reason_detail = (g.reason if g.state != "Evicting" else "Evicting", g.message)
    return m.conclude()


def note_checkpoint(m: Machine, qs: QueueStatus, *, forced: bool) -> None:
    """Whether the evicted workers stopped after their final checkpoint (exit 143), as far as seen."""
    if qs.last_eviction is None:
        return
    stopped = [p for p in m.obs.pods if p.phase in ("Succeeded", "Failed")]
    if any(p.exit_code == EXIT_INTERRUPTED for p in stopped) and qs.last_eviction.checkpointed is None:
        qs.last_eviction = qs.last_eviction.model_copy(update={"checkpointed": True})
    elif forced and qs.last_eviction.checkpointed is None:
        qs.last_eviction = qs.last_eviction.model_copy(update={"checkpointed": False})


def finish_workload(m: Machine) -> None:
    """A finished job marks its Workload Finished, which frees the quota."""
    queue = m.obs.queue
    if queue is not None and finish_due(queue):
        m.decision.finish_workload = True
    if m.st.queue is not None:
        m.st.queue = m.st.queue.model_copy(update={"state": "Finished", "message": None})


def admitted_condition(m: Machine, reason: str, message: str) -> tuple[bool, str, str] | None:
    """Admitted (by Kueue), for a queued job: (status, reason, message); None for a job not queued."""
    if m.obs.queue is None or m.st.queue is None:
        return None
    admitted = m.st.queue.state == "Admitted"
    return admitted, "Admitted" if admitted else reason, message if not admitted else ""
