"""InferenceService status from what runs: Deployments, their pods, the rollout plan (pure).

Conditions:
- ModelLoaded: a replica running the model the spec asks for has loaded it (readiness means loaded). False
  with FetchFailed / LoadFailed when its pods fail, Loading while they start, or the resolution error
  (TrainingJobNotFound, NoCheckpointYet, ...) when there is nothing to run.
- RolledOut: every track runs its current template on all of its replicas; False while rolling, promoting,
  rolling back, or when the rollout is stuck (ProgressDeadlineExceeded) or the spec is unusable.
- Ready: the service answers, and a user who waited for it (`kubectl wait --for=condition=Ready`) finds it
  up: a new service becomes Ready once its first rollout completed (every wanted replica available, as
  `kubectl rollout status` waits for; a rollout stuck past its deadline is Ready with what it has). From then
  on, and while an earlier model or template still serves during an update, it stays Ready as long as one
  replica is ready: an update never flips Ready off. Back from zero replicas counts as served before.

The phase is a summary that never contradicts Ready: Ready=True <=> phase Ready, RollingOut (a newer model or
template replaces one that serves) or Degraded; Ready=False <=> Pending, Loading (a new service coming up,
including its replicas' minReadySeconds) or Failed.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...core.kit import Condition, Event, Manifest, condition_events, set_condition
from ...core.pod_problems import REASONS as POD_REASONS
from ...core.pod_problems import PodProblem, find_problem, scrub
from .api import CanaryStatus, InferenceServiceStatus, ServingPhase
from .llm.vllm import openai_base_url
from .render import CONFIG_HASH_ANNOTATION, selector_string, service_url
from .rollout import RolloutPlan, rolled_out
from .source.model import ResolveError

# How much of a container's own termination message the Ready condition keeps: a vLLM error and its advice fit.
MAX_TERMINATION_MESSAGE = 1000


@dataclass(frozen=True)
class Observed:
    """What the controller read and applied in this pass."""

    plan: RolloutPlan
    stable: Manifest | None  # Deployments as applied (or as live when not applied)
    canary: Manifest | None
    pods: list[Manifest]
    serving_config_hash: str | None  # pod template hash of the track serving the spec's model
    resolve_error: ResolveError | None = None
    invalid: str | None = None  # an InvalidSpec message
    activator_problem: PodProblem | None = None  # why the scale-to-zero activator's pod cannot start
    runtime: str = "default"  # spec.runtime (the owner view carries no spec): vllm has an OpenAI base URL
    queued: tuple[str, str] | None = None  # Kueue admits no replica yet: (Queued | Evicting, Kueue's message)


def _replicas(deployment: Manifest | None, field: str) -> int:
    if deployment is None:
        return 0
    return int((deployment.get("status") or {}).get(field, 0))


def _wanted(deployment: Manifest | None) -> int:
    return 0 if deployment is None else int(deployment.get("spec", {}).get("replicas", 1))


def _pod_ready(pod: Manifest) -> bool:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return bool(cond.get("status") == "True")
    return False


def _pods_of(pods: list[Manifest], config_hash: str | None) -> list[Manifest]:
    return [
        p
        for p in pods
        if (p.get("metadata", {}).get("annotations") or {}).get(CONFIG_HASH_ANNOTATION) == config_hash
        and not p.get("metadata", {}).get("deletionTimestamp")
    ]


def _failed(state: Manifest | None) -> bool:
    if not state:
        return False
    terminated = state.get("terminated")
    if terminated and int(terminated.get("exitCode", 0)) != 0:
        return True
    waiting = state.get("waiting") or {}
    return waiting.get("reason") in ("CrashLoopBackOff", "CreateContainerConfigError", "CreateContainerError")


def _ended(container: Manifest) -> Manifest:
    """The container's failed termination, current or last ({} when it has none)."""
    for state in (container.get("state"), container.get("lastState")):
        terminated = (state or {}).get("terminated") or {}
        if terminated and int(terminated.get("exitCode", 0)) != 0:
            return dict(terminated)
    return {}


def _exited(what: str, log: str, container: Manifest, crash: str) -> str:
    """`what` failed, in the program's own words when it wrote a termination message (the vllm runtime's front
    writes the engine's fatal error there, issue 52), else the way it ended; `crash`: a crash loop's detail."""
    ended = _ended(container)
    message = scrub(str(ended.get("message") or ""), MAX_TERMINATION_MESSAGE)
    if message:
        how = f"{ended.get('reason') or 'Error'} with exit code {ended.get('exitCode', '?')}"
        return f"{what}: {message} (last terminated {how}; see its {log} log)"
    return f"{what} (see its {log} log){crash}"


def diagnose(pods: list[Manifest]) -> tuple[str, str]:
    """Why none of these pods is ready yet: (reason, message). Never includes logs (they may hold secrets); a
    crash's termination message, what the program itself wrote as its cause, comes scrubbed (pod_problems)."""
    if not pods:
        return "Pending", "no replica created yet"
    problem = find_problem(pods)
    if problem is not None and problem.reason != "CrashLoopBackOff":
        # What a person must fix before any replica can start (a missing Secret, the image, memory, no node).
        return problem.reason, problem.message
    for pod in pods:
        name = pod.get("metadata", {}).get("name", "?")
        status = pod.get("status") or {}
        last = f"; {problem.detail}" if problem is not None and problem.pod == name else ""
        for init in status.get("initContainerStatuses") or []:
            if _failed(init.get("state")) or _failed(init.get("lastState")):
                return "FetchFailed", f"pod {name}: " + _exited("fetching the model failed", "fetch-model", init, last)
        for container in status.get("containerStatuses") or []:
            if _failed(container.get("state")) or _failed(container.get("lastState")):
                return "LoadFailed", f"pod {name}: " + _exited("the server exited", "server", container, last)
        for cond in status.get("conditions") or []:
            if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
                return "Unschedulable", f"pod {name}: {cond.get('message') or cond.get('reason') or 'not scheduled'}"
    fetching = any(
        (i.get("state") or {}).get("running") is not None or (i.get("state") or {}).get("waiting") is not None
        for pod in pods
        for i in (pod.get("status") or {}).get("initContainerStatuses") or []
    )
    return ("Fetching", "fetching the model") if fetching else ("Loading", "loading the model")


def _stuck(deployment: Manifest | None) -> str | None:
    for cond in (deployment or {}).get("status", {}).get("conditions") or []:
        if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
            return str(cond.get("message") or "rollout made no progress")
    return None


def _condition(ctype: str, ok: bool | None, reason: str, message: str, generation: int | None) -> Condition:
    status = "Unknown" if ok is None else ("True" if ok else "False")
    return Condition(type=ctype, status=status, reason=reason, message=message, observed_generation=generation)


def compute_status(
    owner: Manifest, observed: Observed, previous: InferenceServiceStatus | None
) -> tuple[InferenceServiceStatus, list[Event]]:
    """The new status and the events its condition transitions deserve."""
    generation = owner.get("metadata", {}).get("generation")
    plan = observed.plan
    stable, canary = observed.stable, observed.canary
    ready = _replicas(stable, "readyReplicas") + _replicas(canary, "readyReplicas")
    running = _replicas(stable, "replicas") + _replicas(canary, "replicas")
    wanted = _wanted(stable) + _wanted(canary)
    serving_pods = _pods_of(observed.pods, observed.serving_config_hash)
    loaded = sum(1 for p in serving_pods if _pod_ready(p))
    serving = plan.serving_ref
    version = serving.display_version if serving else None
    err = observed.resolve_error

    # ModelLoaded
    if observed.invalid is not None and plan.stable_ref is None:
        model_loaded = _condition("ModelLoaded", False, "InvalidSpec", observed.invalid, generation)
    elif plan.stable_ref is None:
        reason, message = (err.reason, err.message) if err else ("Pending", "no model resolved yet")
        model_loaded = _condition("ModelLoaded", False, reason, message, generation)
    elif loaded > 0:
        model_loaded = _condition(
            "ModelLoaded", True, "Loaded", f"model {version} loaded on {loaded} replica(s)", generation
        )
    elif wanted == 0 and observed.queued is not None:
        model_loaded = _condition("ModelLoaded", None, *observed.queued, generation)
    elif wanted == 0:
        model_loaded = _condition("ModelLoaded", None, "ScaledToZero", "no replica runs", generation)
    else:
        reason, message = diagnose(serving_pods)
        model_loaded = _condition("ModelLoaded", False, reason, f"model {version}: {message}", generation)

    # RolledOut
    stuck = _stuck(stable) or _stuck(canary)
    if observed.invalid is not None:
        rolled = _condition("RolledOut", False, "InvalidSpec", observed.invalid, generation)
    elif err is not None:
        rolled = _condition("RolledOut", False, err.reason, err.message, generation)
    elif plan.stable_ref is None:
        rolled = _condition("RolledOut", False, "Pending", "nothing to roll out yet", generation)
    elif stuck is not None:
        rolled = _condition("RolledOut", False, "ProgressDeadlineExceeded", stuck, generation)
    elif plan.canary_action in ("keep", "retire"):
        what = "promoting the canary" if plan.mode == "promoting" else "rolling back the canary"
        rolled = _condition(
            "RolledOut", False, "Promoting" if plan.mode == "promoting" else "RollingBack", what, generation
        )
    elif plan.canary_action == "apply":
        done = rolled_out(stable) and rolled_out(canary)
        message = (
            f"canary {plan.canary_ref.display_version if plan.canary_ref else '?'} on {plan.canary_replicas} of "
            f"{plan.stable_replicas + plan.canary_replicas} replicas (asked {plan.canary_percent}%)"
        )
        rolled = _condition("RolledOut", done, "CanaryRolledOut" if done else "RollingOut", message, generation)
    else:
        done = rolled_out(stable)
        updated = _replicas(stable, "updatedReplicas")
        message = (
            f"model {version} on all {plan.stable_replicas} replica(s)"
            if done
            else (f"{updated} of {plan.stable_replicas} replica(s) updated to model {version}")
        )
        rolled = _condition("RolledOut", done, "RolledOut" if done else "RollingOut", message, generation)

    # Ready
    if observed.invalid is not None and ready == 0:
        ready_cond = _condition("Ready", False, "InvalidSpec", observed.invalid, generation)
    elif ready > 0 and not _served(observed, serving_pods, previous) and not _settled(observed, rolled):
        # A new service whose first rollout still finishes (replicas loading or within minReadySeconds).
        ready_cond = _condition(
            "Ready", False, "RollingOut", f"{ready} replica(s) ready, first rollout not complete: {rolled.message}",
            generation,
        )  # fmt: skip
    elif ready > 0:
        ready_cond = _condition("Ready", True, "Serving", f"{ready} replica(s) ready", generation)
    elif observed.queued is not None:  # nothing admitted by Kueue: nothing may run (queue/admission.py)
        ready_cond = _condition("Ready", False, *observed.queued, generation)
    elif plan.stable_ref is not None and wanted == 0 and (held := observed.activator_problem) is not None:
        # At zero the activator answers for the service: it cannot, so a request would find nothing.
        ready_cond = _condition("Ready", False, held.reason, f"at zero, the activator: {held.message}", generation)
    elif plan.stable_ref is not None and wanted == 0:
        ready_cond = _condition("Ready", False, "ScaledToZero", "no replica runs", generation)
    else:
        ready_cond = _condition("Ready", False, model_loaded.reason, model_loaded.message, generation)

    old = list(previous.conditions) if previous else []
    conditions = old
    for cond in (model_loaded, rolled, ready_cond):
        conditions = set_condition(conditions, cond)

    status = InferenceServiceStatus(
        observed_generation=generation,
        conditions=conditions,
        phase=_phase(observed, model_loaded, rolled, ready_cond, ready, wanted),
        url=service_url(owner),
        openai_base_url=openai_base_url(service_url(owner)) if observed.runtime == "vllm" else None,
        replicas=running,
        ready_replicas=ready,
        selector=selector_string(owner),
        model_version=plan.stable_ref.display_version if plan.stable_ref else None,
        canary=_canary(plan, canary),
        # Written by the autoscaler (autoscale/loop.py); kept as it is.
        autoscaling=previous.autoscaling if previous else None,
    )
    return status, condition_events(old, conditions, WARNING_REASONS)


def _canary(plan: RolloutPlan, canary: Manifest | None) -> CanaryStatus | None:
    if canary is None or plan.canary_ref is None or plan.canary_action == "retire":
        return None
    return CanaryStatus(
        percent=plan.canary_percent or 0,
        model_version=plan.canary_ref.display_version,
        replicas=_wanted(canary),
        ready_replicas=_replicas(canary, "readyReplicas"),
    )


def _served(observed: Observed, serving_pods: list[Manifest], previous: InferenceServiceStatus | None) -> bool:
    """This rollout updates a service that served before, so Ready follows what answers now: Ready was True
    (or it was scaled to zero after serving), replicas of an earlier model/template still answer, or there
    is a canary (only ever added next to a stable track)."""
    cond = next((c for c in (previous.conditions if previous else []) if c.type == "Ready"), None)
    if cond is not None and (cond.status == "True" or cond.reason == "ScaledToZero"):
        return True
    earlier = [p for p in observed.pods if p not in serving_pods and not p.get("metadata", {}).get("deletionTimestamp")]
    return observed.canary is not None or any(_pod_ready(p) for p in earlier)


def _settled(observed: Observed, rolled: Condition) -> bool:
    """The Deployments finished rolling out (even when RolledOut is False for another reason, e.g. the
    model reference no longer resolves), or the rollout is stuck past its deadline (Degraded, not pending)."""
    if rolled.status == "True" or rolled.reason == "ProgressDeadlineExceeded":
        return True
    return rolled_out(observed.stable) and (observed.canary is None or rolled_out(observed.canary))


def _phase(
    observed: Observed, loaded: Condition, rolled: Condition, ready_cond: Condition, ready: int, wanted: int
) -> ServingPhase:
    err = observed.resolve_error
    if (observed.invalid is not None or (err is not None and not err.transient)) and ready == 0:
        return "Failed"
    if observed.invalid is not None:
        return "Degraded"  # the previous spec still serves; the new one cannot be applied
    if observed.plan.stable_ref is None:
        return "Pending"
    if ready_cond.status != "True":
        if ready == 0 and wanted == 0:
            return "Pending"
        return "Failed" if ready == 0 and loaded.reason in ("FetchFailed", "LoadFailed") else "Loading"
    if rolled.status != "True":
        # Serving, but stuck, or without the FeatureView its requests are enriched from (they may fail meanwhile).
        stuck = ("ProgressDeadlineExceeded", "FeatureViewNotFound", "FeatureViewNotReady", "FeatureViewMismatch")
        return "Degraded" if rolled.reason in stuck else "RollingOut"
    return "Ready" if ready >= wanted else "Degraded"


WARNING_REASONS = {
    "FetchFailed", "LoadFailed", "InvalidSpec", "ProgressDeadlineExceeded", "TrainingJobNotFound",
    "TrainingJobFailed", "HandlerRequired", "Unschedulable", "NoCheckpointStore", "FeatureViewNotFound",
    "FeatureViewMismatch", *POD_REASONS,
}  # fmt: skip
