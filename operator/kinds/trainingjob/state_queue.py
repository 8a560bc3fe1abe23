"""The TrainingJob state machine's Kueue transitions (pure; state.py runs them): held Queued until admitted, as many
workers as admitted, an eviction stopped after the final checkpoint then requeued, a finished job's Workload marked
Finished. What admission allows is decided by queueing.gate; this module turns it into status, events and actions.

- Queued by Kueue (label kueue.x-k8s.io/queue-name, queueing.py): no worker before the Workload is admitted
  (phase Queued, with its position in the queue when Kueue's visibility API reports one); admitted, as many workers
  as Kueue admitted; evicted, every worker is stopped after its final checkpoint (bounded by
  Policy.eviction_timeout_seconds), the quota released and the job Queued again, without counting a restart or a
  failure; readmitted, a new gang attempt resumes from that checkpoint.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from loom.workloads.trainer.config import EXIT_INTERRUPTED

from ...core import kueue
from ...core.kit import format_time
from .api import QueueEviction, QueueStatus
from .queueing import QueueObservation, gate, live

if TYPE_CHECKING:
    from .state import Decision, _Machine


def queued(m: _Machine, queue: QueueObservation) -> Decision | None:
    """Kueue's admission: None when the workers may run (m.desired set to the admitted count), else the
    decision that holds them (Queued) or stops them for an eviction (see queueing.py)."""
    st, obs = m.st, m.obs
    g = gate(queue, m.spec, obs.pods, obs.now, m.policy.eviction_timeout_seconds)
    wl = queue.workload
    old = st.queue or QueueStatus()
    named = {"name": queue.name, "workload": wl.name if wl else None}
    position = queue.position.cluster_queue if queue.position is not None and g.state == "Queued" else None
    qs = old.model_copy(update={**named, "state": g.state, "message": g.message or None, "position": position})
    m.decision.create_workload = g.create_workload
    if g.state == "Admitted" and wl is not None:
        qs.cluster_queue = wl.cluster_queue
        qs.flavor = kueue.describe_flavors(wl.assignments)
        qs.admitted_workers = g.workers
        if old.state != "Admitted":
            partial = f" of {m.desired}" if g.workers < m.desired else ""
            m.event(
                "Normal",
                "Admitted",
                f"admitted by ClusterQueue {wl.cluster_queue} on flavor {qs.flavor or '-'}: "
                f"{g.workers}{partial} worker(s)",
            )
        m.desired = g.workers
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
    if g.stop:
        for pod in obs.pods:
            if live(pod):
                m.delete(pod, force=g.force or m.node_lost(pod))
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

def note_checkpoint(m: _Machine, qs: QueueStatus, *, forced: bool) -> None:
    """Whether the evicted workers stopped after their final checkpoint (exit 143), as far as seen."""
    if qs.last_eviction is None:
        return
    stopped = [p for p in m.obs.pods if p.phase in ("Succeeded", "Failed")]
    if any(p.exit_code == EXIT_INTERRUPTED for p in stopped) and qs.last_eviction.checkpointed is None:
        qs.last_eviction = qs.last_eviction.model_copy(update={"checkpointed": True})
    elif forced and qs.last_eviction.checkpointed is None:
        qs.last_eviction = qs.last_eviction.model_copy(update={"checkpointed": False})


def finish_workload(m: _Machine) -> None:
    """A finished job marks its Workload Finished, which frees the quota."""
    queue = m.obs.queue
    if queue is not None and queue.workload is not None and not queue.workload.finished:
        m.decision.finish_workload = True
    if m.st.queue is not None:
        m.st.queue = m.st.queue.model_copy(update={"state": "Finished", "message": None})
