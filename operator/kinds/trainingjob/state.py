"""The TrainingJob state machine (pure): observation in, new status and actions out (decision.py), conditions from
its phase (conditions.py).

Every decision is a function of the spec, the previous status, the observed pods/nodes/progress and `now`,
so it is unit-tested transition by transition, and an operator restart loses nothing: all memory lives in
status (attempt, restarts, failures, the UIDs of pods already accounted for).

Rules, in order of precedence:
- Finished (Succeeded/Failed) is terminal: leftover running pods are stopped; after ttlSecondsAfterFinished
  the children are deleted (checkpoints in object storage are never touched).
- suspend: every pod gets a graceful delete (SIGTERM -> the trainer's final checkpoint); Suspended once
  gone. Resuming starts a new gang attempt that resumes from that checkpoint. Restarts/failures are kept.
- activeDeadlineSeconds (from startTime, reset on resume like a Job) -> Failed/DeadlineExceeded.
- A worker that failed, was evicted, or sits on a node NotReady for longer than the grace period (then it is
  force-deleted) is lost. Exit codes the trainer marks permanent -> Failed/PermanentError at once. Other
  non-zero exits count one failure per incident against backoffLimit (disruptions count none); more than
  backoffLimit failures -> Failed/BackoffLimitExceeded. Survivors >= minReplicas with worker 0 (the c10d
  store host) among them -> only the lost workers are replaced; otherwise the whole gang restarts.
- Success policy AllWorkers: every worker exited 0. Worker0: worker 0 exited 0 (the rest are stopped).
- spec.trainingData: no worker starts before the training set is built (data/state.py).
- Pods that stay unschedulable past scheduling.scheduleTimeoutSeconds -> Ready=False/Unschedulable.
- Queued by Kueue (label kueue.x-k8s.io/queue-name): no worker before the Workload is admitted, an eviction
  stopped after the final checkpoint and requeued without counting a restart (queue/state.py). A finished job
  marks its Workload Finished, which frees the quota.
- Checkpoint uploads the trainer reports failing (it retries them and trains on) -> CheckpointStorage=False
  UploadRetrying, True Uploaded once one lands (storage.py); the phase is not affected.
- Restarting lasts until the trainer runs steps again, not only until its pods run: a trainer that served
  progress before is waited for (its report leaves phase Starting, or its step passes the checkpoint), at
  most Policy.resume_timeout_seconds. Meanwhile status.progress.step shows the step it resumes from (the
  checkpoint), never the 0 a freshly started trainer reports before it restored anything.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Literal

from loom.workloads.trainer.config import EXIT_PERMANENT

from ...core.kit import Event, format_time, parse_time
from .api import CheckpointStatus, Progress, WorkerCounts
from .conditions import set_conditions
from .config import worker_range
from .data.state import built, training_data
from .decision import Decision, Delete, Observation, Policy
from .observe import WorkerView
from .queue.state import finish_workload, queued

PERMANENT_EXIT_CODES = frozenset({EXIT_PERMANENT})


class _Machine:
    def __init__(self, obs: Observation, policy: Policy) -> None:
        self.obs = obs
        self.policy = policy
        self.spec = obs.spec
        self.old_phase = obs.status.phase
        self.st = obs.status.model_copy(deep=True)
        self.st.observed_generation = obs.generation
        self.decision = Decision(status=self.st)
        self.desired = self.spec.workers.replicas
        self.minimum, _ = worker_range(self.spec)
        self.reason_detail: tuple[str, str] | None = None  # (reason, message) for Ready while not running
        self.data_detail: tuple[str, str] | None = None  # (reason, message) of TrainingDataReady=False

    # ---- helpers -------------------------------------------------------------------------------------
    def event(self, type_: Literal["Normal", "Warning"], reason: str, message: str) -> None:
        self.decision.events.append(Event(type_, reason, message))

    def delete(self, pod: WorkerView, *, force: bool = False) -> None:
        if pod.deleting and not force:
            return
        if any(d.uid == pod.uid for d in self.decision.delete):
            return
        self.decision.delete.append(Delete(pod.name, pod.uid, force))

    def stop_all(self, pods: list[WorkerView] | tuple[WorkerView, ...]) -> None:
        for pod in pods:
            if pod.live:
                self.delete(pod, force=self.node_lost(pod))

    def node_lost(self, pod: WorkerView) -> bool:
        """The pod's node has not been Ready for longer than the grace period."""
        node = self.obs.nodes.get(pod.node_name or "")
        if node is None or node.ready:
            return False
        since = node.since or self.obs.now
        return (self.obs.now - since).total_seconds() >= self.policy.node_lost_grace_seconds

    def finish(self, phase: str, reason: str, message: str) -> Decision:
        self.st.phase = phase  # type: ignore[assignment]
        self.st.completion_time = format_time(self.obs.now)
        progress = self.st.progress
        if phase == "Succeeded" and progress is not None and progress.total_steps is not None:
            # Exit 0 is the trainer's word that every step ran; the last poll may have been a few steps earlier.
            self.st.progress = progress.model_copy(update={"step": progress.total_steps, "eta": "0s"})
        if phase == "Succeeded":
            self.record_final_checkpoint()
            self.record_final_progress()
        finish_workload(self)
        self.stop_all(self.obs.pods)
        self.event("Normal" if phase == "Succeeded" else "Warning", reason, message)
        self.reason_detail = (reason, message)
        return self.conclude()

    def record_final_checkpoint(self) -> None:
        """The last checkpoint is committed after the last progress poll; the trainer names it on exit 0."""
        finals = [p.final_checkpoint for p in self.obs.pods if p.final_checkpoint is not None]
        if not finals:
            return
        newest = max(finals, key=lambda c: c.step if c.step is not None else -1)
        current = self.st.checkpoint
        if current is None or (newest.step or 0) >= (current.step or 0):
            self.st.checkpoint = CheckpointStatus(
                latest=newest.uri, step=newest.step, time=newest.time or format_time(self.obs.now)
            )

    def record_final_progress(self) -> None:
        """The last step and its loss, which the trainer names on exit 0: a job of a few seconds may have ended
        before any progress poll saw either, and a longer one ran steps after the last poll."""
        update: dict[str, object] = {}
        losses = [p.final_loss for p in self.obs.pods if p.final_loss is not None]
        if losses:
            update["loss"] = losses[0]
        steps = [p.final_step for p in self.obs.pods if p.final_step is not None]
        current = self.st.progress.step if self.st.progress is not None else None
        if steps and (current is None or max(steps) > current):
            update["step"] = max(steps)
        if update:
            self.st.progress = (self.st.progress or Progress()).model_copy(update=update)

    # ---- the machine ---------------------------------------------------------------------------------
    def run(self) -> Decision:
        st, obs = self.st, self.obs
        self.apply_progress()
        if st.phase in ("Succeeded", "Failed"):
            return self.finished()
        if obs.spec_error:
            return self.finish("Failed", "InvalidSpec", obs.spec_error)
        if self.spec.run_policy.suspend:
            return self.suspend()
        if st.phase == "Suspended":
            st.attempt += 1
            st.start_time = None
            self.event("Normal", "Resumed", f"resuming as gang attempt {st.attempt} from the latest checkpoint")
        if obs.queue is not None and (held := queued(self, obs.queue)) is not None:
            return held
        deadline = self.spec.run_policy.active_deadline_seconds
        started = parse_time(st.start_time)
        if deadline and started and obs.now - started >= timedelta(seconds=deadline):
            return self.finish(
                "Failed", "DeadlineExceeded", f"the job ran longer than activeDeadlineSeconds={deadline}"
            )
        if obs.endpoint_problem:
            st.phase = "Pending"
            self.reason_detail = ("EndpointNotConfigured", obs.endpoint_problem)
            return self.conclude()
        if not obs.tracking_ready:
            st.phase = "Pending"
            self.reason_detail = (
                "WaitingForTracking",
                obs.tracking_error or "creating the MLflow run before starting workers",
            )
            return self.conclude()
        if obs.base_wait:
            st.phase = "Pending"
            self.reason_detail = obs.base_wait
            return self.conclude()
        if self.spec.training_data is not None and not built(self):
            waiting = training_data(self)
            if waiting is not None:
                return waiting
        return self.active()

    def finished(self) -> Decision:
        st, obs = self.st, self.obs
        finish_workload(self)
        self.stop_all(obs.pods)
        ttl = self.spec.run_policy.ttl_seconds_after_finished
        done = parse_time(st.completion_time)
        if ttl is not None and done and not st.children_deleted and obs.now - done >= timedelta(seconds=ttl):
            self.decision.delete_children = True
            st.children_deleted = True
            self.event("Normal", "ChildrenDeleted", f"ttlSecondsAfterFinished={ttl}: pods and services deleted")
        return self.conclude()

    def suspend(self) -> Decision:
        st = self.st
        self.stop_all(self.obs.pods)
        remaining = [p for p in self.obs.pods if p.live]
        if st.phase != "Suspended":
            self.event("Normal", "Suspending", "stopping workers after their final checkpoint")
        st.phase = "Suspended"
        st.replaced_pods = []
        self.reason_detail = (
            ("Suspending", f"waiting for {len(remaining)} worker(s) to stop")
            if remaining
            else ("Suspended", "suspended")
        )
        return self.conclude()

    def active(self) -> Decision:
        st, obs = self.st, self.obs
        stale = [p for p in obs.pods if p.attempt != st.attempt or p.index >= self.desired]
        self.stop_all(stale)
        if any(p.attempt != st.attempt for p in stale):
            # Same names across attempts: the new gang starts only once every old pod is gone.
            st.phase = "Restarting"
            self.reason_detail = ("Restarting", f"waiting for {len(stale)} worker(s) of an earlier attempt to stop")
            return self.conclude()
        current = {p.index: p for p in obs.pods if p.attempt == st.attempt and p.index < self.desired}
        handled = set(st.replaced_pods)
        st.replaced_pods = [uid for uid in st.replaced_pods if any(p.uid == uid for p in obs.pods)]

        worker0 = current.get(0)
        if worker0 is not None and worker0.phase == "Succeeded" and self.spec.success_policy == "Worker0":
            return self.finish("Succeeded", "Worker0Succeeded", "worker 0 exited 0")
        if len(current) == self.desired and all(p.phase == "Succeeded" for p in current.values()):
            return self.finish("Succeeded", "AllWorkersSucceeded", f"all {self.desired} workers exited 0")

        lost = [p for p in current.values() if p.uid not in handled and self.is_lost(p)]
        if lost:
            return self.recover(lost, current)

        missing = [i for i in range(self.desired) if i not in current]
        if missing:
            if st.start_time is None:
                st.start_time = format_time(obs.now)
            self.decision.create = missing
        return self.conclude(current)

    def is_lost(self, pod: WorkerView) -> bool:
        # A pod stuck terminating on a dead node counts too: only a force delete ever removes it.
        return pod.phase == "Failed" or (pod.live and self.node_lost(pod))

    def recover(self, lost: list[WorkerView], current: dict[int, WorkerView]) -> Decision:
        st = self.st
        permanent = [p for p in lost if p.phase == "Failed" and p.exit_code in PERMANENT_EXIT_CODES]
        if permanent:
            pod = permanent[0]
            return self.finish(
                "Failed",
                "PermanentError",
                f"{pod.name} exited {pod.exit_code} (permanent, not retried): {pod.message}".strip(),
            )
        real = [p for p in lost if p.phase == "Failed" and not p.disrupted]
        what = "; ".join(_describe(p, self.node_lost(p)) for p in lost)
        if real:
            st.failures += 1
            limit = self.spec.run_policy.backoff_limit
            if st.failures > limit:
                return self.finish(
                    "Failed", "BackoffLimitExceeded", f"{st.failures} failures > backoffLimit {limit}: {what}"
                )
        lost_ids = {p.uid for p in lost}
        survivors = [p for p in current.values() if p.uid not in lost_ids and p.active]
        st.restarts += 1
        if 0 not in {p.index for p in lost} and len(survivors) >= self.minimum:
            for pod in lost:
                self.delete(pod, force=pod.live)
                st.replaced_pods.append(pod.uid)
            self.event(
                "Warning", "WorkerReplaced", f"replacing {len(lost)} worker(s), {len(survivors)} continue: {what}"
            )
            st.phase = "Restarting"
            self.reason_detail = ("WorkerReplaced", what)
            return self.conclude(current)
        st.attempt += 1
        st.replaced_pods = []
        for pod in current.values():
            self.delete(pod, force=pod.live and self.node_lost(pod))
        self.event("Warning", "GangRestart", f"restarting all workers as attempt {st.attempt}: {what}")
        st.phase = "Restarting"
        self.reason_detail = ("GangRestart", what)
        return self.conclude()

    def apply_progress(self) -> None:
        """The trainer's report -> status.progress/checkpoint, never showing a step the job is not at.

        A trainer that just (re)started reports step 0 until it has restored the checkpoint and run a step;
        the job really is at the step it resumes from, so that is what status shows (the floor). A legitimate
        decrease exists: steps after the newest checkpoint are lost on a restart, and then step equals the
        checkpoint step, never less.
        """
        report = self.obs.progress
        if report is None:
            return
        latest = report.latest_checkpoint
        if latest is not None and (self.st.checkpoint is None or self.st.checkpoint.latest != latest.uri):
            self.st.checkpoint = CheckpointStatus(
                latest=latest.uri, step=latest.step, time=latest.time or format_time(self.obs.now)
            )
        floor = self.resume_step()
        step = report.step
        if step is not None and floor is not None and step < floor:
            step = floor
        previous = self.st.progress or Progress()
        self.st.progress = Progress(
            step=step,
            total_steps=report.total_steps if report.total_steps is not None else previous.total_steps,
            # A starting trainer has no loss yet: the last known one stays (the loss the checkpoint was near).
            loss=report.loss if report.loss is not None else previous.loss,
            samples_per_second=report.samples_per_second,
            eta=report.eta,
        )

    def resume_step(self) -> int | None:
        """The step the trainer resumes from (or is past): the checkpoint it names, else the newest one when
        the job resumes from the latest checkpoint (resume: none restarts from step 0)."""
        report = self.obs.progress
        if report is not None and report.latest_checkpoint is not None:
            return report.latest_checkpoint.step
        checkpoint = self.spec.checkpoint
        if checkpoint is None or checkpoint.resume != "latest" or self.st.checkpoint is None:
            return None
        return self.st.checkpoint.step

    def trainer_resumed(self) -> bool:
        """After a restart: the trainer runs steps again (not only its pods), so Restarting may end.

        A trainer that never served progress cannot tell; its pods running is all there is. One that did is
        waited for, at most Policy.resume_timeout_seconds after the restart began (an unreachable progress
        endpoint must not pin the phase).
        """
        report = self.obs.progress
        if report is not None and report.starting is not None:
            return not report.starting
        floor = self.resume_step()
        if report is not None and report.step is not None:
            return floor is None or report.step > floor
        if self.obs.status.progress is None:
            return True
        since = next(
            (parse_time(c.last_transition_time) for c in self.st.conditions if c.type == "Restarting"), None
        )
        return since is None or (self.obs.now - since).total_seconds() >= self.policy.resume_timeout_seconds

    # ---- phase, counts and conditions ------------------------------------------------------------------
    def conclude(self, current: dict[int, WorkerView] | None = None) -> Decision:
        st = self.st
        workers = current or {}
        if self.reason_detail is None and st.phase == self.old_phase:
            # A phase that persists keeps the reason it was entered with (e.g. GangRestart, BackoffLimitExceeded).
            previous = next((c for c in st.conditions if c.type == st.phase and c.status == "True"), None)
            if previous is not None and st.phase in ("Restarting", "Suspended", "Succeeded", "Failed"):
                self.reason_detail = (previous.reason, previous.message)
        ready = sum(1 for p in workers.values() if p.ready and p.uid not in st.replaced_pods)
        st.workers = WorkerCounts(
            desired=0 if st.phase in ("Succeeded", "Failed", "Suspended", "Queued") else self.desired, ready=ready
        )
        if current is not None and st.phase not in ("Succeeded", "Failed"):
            self.running_phase(workers, ready)
        set_conditions(self)
        if st.phase != self.old_phase and st.phase in ("Running", "Created") and self.old_phase != "Restarting":
            messages = {"Running": f"{ready}/{self.desired} workers running", "Created": "worker pods created"}
            self.event("Normal", st.phase, messages[st.phase])
        return self.decision

    def running_phase(self, workers: dict[int, WorkerView], ready: int) -> None:
        st, obs = self.st, self.obs
        timeout = timedelta(seconds=self.spec.scheduling.schedule_timeout_seconds)
        stuck = [
            p
            for p in workers.values()
            if p.unschedulable and p.active and p.created is not None and obs.now - p.created >= timeout
        ]
        recovering = st.phase == "Restarting"
        # Workers that already exited 0 are done, not missing: the gang is still running to completion.
        finished = sum(1 for p in workers.values() if p.phase == "Succeeded")
        ready += finished
        # A gang winding down (some workers done, the rest no longer ready while they exit) is still Running.
        if ready >= self.desired or (st.phase == "Running" and (ready >= self.minimum or finished > 0)):
            if recovering and not self.trainer_resumed():
                # Pods running is not training: the trainer still re-forms the gang and restores its checkpoint.
                reason = self.reason_detail[0] if self.reason_detail else "Restarting"
                resume = self.resume_step()
                where = f" from step {resume}" if resume is not None else ""
                self.reason_detail = (
                    reason,
                    f"{ready}/{self.desired} workers running, waiting for the trainer to resume{where}",
                )
                return
            if recovering:
                self.event("Normal", "Recovered", f"{ready}/{self.desired} workers running again")
            st.phase = "Running"
            return
        if not recovering:
            st.phase = "Created" if (workers or self.decision.create) else "Pending"
        blocked = next((p.problem for _, p in sorted(workers.items()) if p.active and p.problem), None)
        if stuck:
            self.reason_detail = ("Unschedulable", f"{stuck[0].name}: {stuck[0].unschedulable}")
        elif blocked is not None and self.reason_detail is None:  # a missing Secret, the image, ...: pod_problems
            self.reason_detail = (blocked.reason, blocked.message)
        elif self.reason_detail is None:
            self.reason_detail = ("WaitingForWorkers", f"{ready}/{self.desired} workers running")


def _describe(pod: WorkerView, node_lost: bool) -> str:
    if pod.phase != "Failed" and node_lost:
        return f"{pod.name} on NotReady node {pod.node_name}"
    detail = f"exit {pod.exit_code}" if pod.exit_code is not None else (pod.reason or "failed")
    if pod.disrupted:
        detail += ", disrupted"
    return f"{pod.name} {detail}"


def decide(obs: Observation, policy: Policy | None = None) -> Decision:
    """One reconcile step of a TrainingJob."""
    return _Machine(obs, policy or Policy()).run()
