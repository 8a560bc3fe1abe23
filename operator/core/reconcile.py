"""The reconcile skeleton every kind's controller runs: one pass for one object, in the same five steps.

    parse    the spec; a spec that does not validate, or that the kind cannot run (InvalidSpec), becomes one
             message, here and nowhere else (`Pass.invalid`), and the pass goes on to report what still runs
    observe  the children and whatever else the kind reads (from the watch cache where Kopf streams it)
    decide   pure: what the children should be, from the spec and what was observed
    apply    the writes the decision asks for (only for a valid spec)
    status   pure: the status and the events, written here once per pass (a merge patch only when it changed)

A kind supplies the four kind-specific steps as a `Reconciler`; `run` is the skeleton. Most kinds apply and then
report what they applied; a kind whose status must be written before its children (a TrainingJob persists its
attempt before creating that attempt's pods) says `status_first`, and its `prepare` writes, beside the status,
what the status need not precede (children it does not name): a new object's children wait one round trip less.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from pydantic import ValidationError

from . import client as kube
from .events import post_events
from .kit import Event, owner_of, status_patch
from .model import API_VERSION, InvalidSpec, Manifest, StatusBase, first_error

log = logging.getLogger("loom.operator.reconcile")

SpecT = TypeVar("SpecT")
ObservedT = TypeVar("ObservedT")
PlanT = TypeVar("PlanT")
StatusT = TypeVar("StatusT", bound=StatusBase)


@dataclass(frozen=True)
class Pass(Generic[SpecT]):
    """What one pass knows before it observes anything: the object as read, and its spec or why it has none."""

    namespace: str
    name: str
    body: Manifest
    owner: Manifest
    spec: SpecT | None
    invalid: str | None  # the spec's first validation error or InvalidSpec message; then `spec` may be None

    @property
    def generation(self) -> int | None:
        generation = self.body["metadata"].get("generation")
        return None if generation is None else int(generation)

    @property
    def valid(self) -> bool:
        return self.spec is not None and self.invalid is None


class Reconciler(Protocol[SpecT, ObservedT, PlanT, StatusT]):
    kind: ClassVar[str]
    status_model: ClassVar[type[Any]]
    status_first: ClassVar[bool]

    def parse(self, body: Manifest) -> SpecT:
        """The spec as the schema reads it (with whatever the kind fills in); raises ValidationError."""

    def check(self, body: Manifest, spec: SpecT) -> None:
        """What the schema cannot say (a name too long for the children, settings that cannot work together):
        raises InvalidSpec. The pass keeps the spec to report what still runs."""

    async def observe(self, ctx: Pass[SpecT]) -> ObservedT:
        """What the pass reads: children, referenced objects (read-only)."""

    def decide(self, ctx: Pass[SpecT], observed: ObservedT) -> PlanT:
        """What should be (pure)."""

    async def prepare(self, ctx: Pass[SpecT], observed: ObservedT, plan: PlanT, *, owner_written: bool) -> None:
        """`status_first` kinds: the writes of a valid pass that need not wait for the status, made while it is
        written (before `apply`). `owner_written`: a status write goes out beside them, and its answer stands for
        their owner check (kube.apply `owner_written_beside`). Other kinds are never asked."""

    async def apply(self, ctx: Pass[SpecT], observed: ObservedT, plan: PlanT) -> ObservedT:
        """The writes of a valid pass; returns what was observed, updated by what it wrote."""

    def status(
        self, ctx: Pass[SpecT], observed: ObservedT, plan: PlanT, previous: StatusT | None
    ) -> tuple[StatusT, Sequence[Event]]:
        """The status and the events of this pass (pure)."""


class StatusAfterApply:
    """What a kind that applies first and then reports what it applied inherits: it is not `status_first`, so it
    has nothing to `prepare`."""

    status_first: ClassVar[bool] = False

    async def prepare(self, ctx: Pass[Any], observed: Any, plan: Any, *, owner_written: bool) -> None:
        """Never asked: the skeleton calls `prepare` only for `status_first` kinds."""


def previous_status(model: type[StatusT], body: Manifest) -> StatusT | None:
    """The status as the last pass wrote it; None when it does not parse (another version wrote it: the
    conditions start afresh)."""
    try:
        return model.model_validate(body.get("status") or {})
    except ValidationError:
        return None


def parse(reconciler: Reconciler[Any, Any, Any, Any], body: Manifest) -> tuple[Any, str | None]:
    """The spec (None when it does not validate) and the message status shows when it cannot run: the one place
    a spec error becomes InvalidSpec.

    The CRD's CEL rules are not evaluated again here (half a millisecond a pass): the API server checked them when
    it stored the object. A rule added to a field that objects already use would need the kind's `check` to report
    the objects stored before it, as the name rule's does. What is built outside the cluster (tests, the SDK) is
    checked by loom.operator.api.cel."""
    try:
        spec = reconciler.parse(body)
    except ValidationError as exc:
        return None, first_error(exc)
    try:
        reconciler.check(body, spec)
    except ValidationError as exc:
        return spec, first_error(exc)
    except InvalidSpec as exc:
        return spec, str(exc)
    return spec, None


async def read(kind: str, namespace: str, name: str, cache: Mapping[tuple[str, str], Any] | None) -> Manifest | None:
    """The object: from the watch cache when the controller keeps one (a Kopf index of its bodies), else a GET."""
    if cache is not None:
        bodies = cache.get((namespace, name))
        for body in bodies or ():
            return dict(body)
        return None
    return await kube.get(API_VERSION, kind, namespace, name)


async def run(
    reconciler: Reconciler[SpecT, ObservedT, PlanT, StatusT],
    namespace: str,
    name: str,
    *,
    body: Manifest | None = None,
    cache: Mapping[tuple[str, str], Any] | None = None,
) -> None:
    """One pass of the skeleton for one object (read fresh unless `body` is handed in)."""
    kind = reconciler.kind
    if body is None:
        body = await read(kind, namespace, name, cache)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return
    spec: SpecT | None
    spec, invalid = parse(reconciler, body)
    ctx = Pass(namespace, name, body, owner_of(body, kind), spec, invalid)
    previous = previous_status(reconciler.status_model, body)
    observed = await reconciler.observe(ctx)
    plan = reconciler.decide(ctx, observed)
    if reconciler.status_first:
        status, events = reconciler.status(ctx, observed, plan, previous)
        patch = status_change(body, status)
        writes = [write_status(kind, body, patch, events)]
        if ctx.valid:
            # What need not wait for the status goes out beside it, checked by its answer when one goes out.
            writes.append(reconciler.prepare(ctx, observed, plan, owner_written=patch is not None))
        # All finish before the pass goes on or ends (the runner's one pass at a time holds for their writes too).
        for outcome in await asyncio.gather(*writes, return_exceptions=True):
            if isinstance(outcome, BaseException):
                raise outcome
        if ctx.valid:
            await reconciler.apply(ctx, observed, plan)
        return
    if ctx.valid:
        observed = await reconciler.apply(ctx, observed, plan)
    status, events = reconciler.status(ctx, observed, plan, previous)
    await write_status(kind, body, status_change(body, status), events)


def status_change(body: Manifest, status: StatusBase) -> Manifest | None:
    """The merge patch from the object's status to the pass's (None: nothing changed, nothing is written)."""
    return status_patch(dict(body.get("status") or {}), status.to_wire())


async def write_status(kind: str, body: Manifest, patch: Manifest | None, events: Sequence[Event]) -> None:
    """The status's merge patch (None: it did not change), then the events: once per pass, for every kind."""
    meta = body["metadata"]
    if patch is not None:
        try:
            await kube.patch_status(API_VERSION, kind, meta["namespace"], meta["name"], patch)
        except kube.NotFound as gone:
            # Deleted while the pass ran: nothing to report on, and nothing wrong (the runner ends the pass quietly).
            raise kube.OwnerGone(f"{kind} {meta['namespace']}/{meta['name']}") from gone
    post_events(body, events)
