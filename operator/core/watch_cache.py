"""The watch cache: Loom's objects and their children as the watch last delivered them, and what Loom last applied.

Before it, a pass read its object fresh (a GET), read its children back (GETs) and applied every child again (an
owner GET, then a PATCH), every resync, for every object, though nothing had changed: nearly all of the
operator's requests in a steady state (bench/bench_steady_requests.py). Kopf already streams these objects; here
that stream is kept (core/runner.py: watch_objects feeds it), and it answers without a request:

- `body`: the object as last seen, for reads. One that is not here (never seen, deleted) is read from the API
  server. Kept current by the watch: every change of an object or a child triggers a pass again, so a body a
  moment older than the API server's (an event on its way) is corrected by the next pass.
- After Loom writes an object some other way than an apply (a status patch, a scale), the body the watch delivered
  before is not served until the watch has delivered that write (`awaiting`): a pass must never decide on a status
  older than the one the last pass wrote (a TrainingJob records its attempt in status before it creates that
  attempt's pods). The write's resourceVersion is what the watch must deliver; watch events of one resource arrive
  in order. Meanwhile the write's own answer is served when it was the whole object (a status write's is): nothing
  the watch holds is newer. Without it every pass in the moment after a status write read its object with a GET
  (two per job in a burst of 200 TrainingJobs: bench/bench_kubeflow_p1.py).
- `is_absent`: a GET found no such object, and the watch has not brought one since. Kept only for kinds whose every
  object the watch delivers (Loom's own kinds) or whose name only Loom gives (its Deployments and Jobs): a pass
  that looks for a canary or an activator that does not exist asks once, not every time.
- `unchanged`: would applying this exact manifest change anything? Only when Loom applied the same manifest (same
  digest) and the child's resourceVersion is still the one that apply returned: nobody wrote it since, not even
  its status. Then the apply and its owner check are skipped. A child deleted meanwhile (its DELETED event not yet
  here) is not re-created by a skipped apply, which is the safe side: the deletion's event triggers a pass that
  finds it gone.

- `alive`: the API server answered for this object, with this uid and not being deleted, at most
  `alive_s` ago (a write of Loom's to it, or the owner check itself). kube.apply checks a child's owner right before
  applying it; an answer this recent is that check, one round trip old like the GET it replaces (a TrainingJob's
  pass writes its status, then applies four children: without it, four owner GETs on the way to its pods). A DELETED
  event, or a body being deleted, ends it at once.

Limits, all on the side of asking the API server: a child is applied again at least every `max_age_s` even when
unchanged (a child whose events stopped reaching the cache, say its managed-by label was removed, is corrected that
often, as a controller's periodic resync would), and an awaited write that the watch skipped (a relist after the
watch expired) stops being awaited after `await_s`. Pure: no I/O and no clock of its own (`now` is handed in).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar, cast

from .model import Manifest

Key = tuple[str, str, str, str]  # (apiVersion, kind, namespace, name)
MAX_AGE_S = 600.0
AWAIT_S = 60.0
# How old an answer may be and still prove an owner alive: about one round trip of a busy API server. The
# operator-churn chaos test tolerates a child applied within its owner's deletion second (the garbage collector
# removes it); an older answer means a GET.
ALIVE_S = 0.5


def key_of(body: Manifest) -> Key:
    meta = body.get("metadata") or {}
    return str(body.get("apiVersion")), str(body.get("kind")), str(meta.get("namespace") or ""), str(meta["name"])


def version_of(body: Manifest | None) -> str | None:
    value = None if body is None else (body.get("metadata") or {}).get("resourceVersion")
    return None if value is None else str(value)


T = TypeVar("T")


def json_copy(value: T) -> T:
    """A copy of a JSON tree (what the API server sends: dicts, lists, scalars), so a pass may change what it read.
    About 3x faster than copy.deepcopy, which keeps a memo for cycles and shared parts a JSON tree cannot have;
    the cache copies every object a pass reads or writes."""
    if isinstance(value, dict):
        return cast(T, {key: json_copy(item) for key, item in value.items()})
    if isinstance(value, list):
        return cast(T, [json_copy(item) for item in value])
    return value


@dataclass(frozen=True)
class _Applied:
    digest: str
    resource_version: str
    at: float


class WatchCache:
    def __init__(self, max_age_s: float = MAX_AGE_S, await_s: float = AWAIT_S, alive_s: float = ALIVE_S) -> None:
        self.max_age_s = max_age_s
        self.await_s = await_s
        self.alive_s = alive_s
        self._alive: dict[Key, tuple[str, float]] = {}  # key -> (uid, when the API server answered for it)
        self._seen: dict[Key, Manifest] = {}
        self._applied: dict[Key, _Applied] = {}
        # key -> (resourceVersion of Loom's write, when, the object as that write left it when its answer was it)
        self._awaiting: dict[Key, tuple[str, float, Manifest | None]] = {}
        self._absent: dict[Key, float] = {}  # key -> when a GET found nothing

    def __len__(self) -> int:
        return len(self._seen)

    def seen(self, event_type: str | None, body: Manifest) -> None:
        """A watch event (ADDED, MODIFIED, DELETED; None for the initial listing)."""
        key = key_of(body)
        if event_type == "DELETED":
            self.forget(key)
            return
        if body.get("metadata", {}).get("deletionTimestamp"):
            self._alive.pop(key, None)
        self._seen[key] = json_copy(body)
        self._absent.pop(key, None)
        awaited = self._awaiting.get(key)
        if awaited is not None and awaited[0] == version_of(body):
            del self._awaiting[key]

    def forget(self, key: Key) -> None:
        self._alive.pop(key, None)
        self._seen.pop(key, None)
        self._applied.pop(key, None)
        self._awaiting.pop(key, None)
        self._absent.pop(key, None)

    def absent(self, key: Key, now: float) -> None:
        """A GET found no such object: until the watch brings one (or max_age_s passes), there is none."""
        if key not in self._seen:
            self._absent[key] = now

    def is_absent(self, key: Key, now: float) -> bool:
        found = self._absent.get(key)
        if found is None or key in self._seen:
            return False
        if now - found > self.max_age_s:
            del self._absent[key]
            return False
        return True

    def answered(self, body: Manifest | None, now: float) -> None:
        """The API server answered a request with this object as it is now (a GET or a write's result)."""
        if body is None:
            return
        meta = body.get("metadata") or {}
        if not meta.get("uid") or not body.get("kind"):
            return  # a status or scale subresource's answer may lack what names the object
        if meta.get("deletionTimestamp"):
            self._alive.pop(key_of(body), None)
        else:
            self._alive[key_of(body)] = (str(meta["uid"]), now)

    def alive(self, key: Key, uid: str, now: float) -> bool:
        """Whether the API server answered for this object, with this uid and not being deleted, within alive_s."""
        answer = self._alive.get(key)
        return answer is not None and answer[0] == uid and now - answer[1] <= self.alive_s

    def wrote(self, key: Key, resource_version: str | None, now: float, answer: Manifest | None = None) -> None:
        """Loom wrote the object other than by an apply; `resource_version` is what the API server answered, and
        `answer` the object as it answered, when its answer was the whole object (not a scale's)."""
        self._applied.pop(key, None)
        if resource_version is None:
            self._seen.pop(key, None)  # nothing to wait for: read it afresh until the watch brings it again
            return
        if version_of(self._seen.get(key)) != resource_version:
            whole = answer is not None and key_of(answer) == key and version_of(answer) == resource_version
            self._awaiting[key] = (resource_version, now, json_copy(answer) if whole else None)

    def applied(self, body: Manifest, digest: str, now: float) -> None:
        """What the API server answered to Loom's apply of a manifest with this digest (the object as it is now)."""
        key, version = key_of(body), version_of(body)
        if version is None:
            return
        self._seen[key] = json_copy(body)
        self._applied[key] = _Applied(digest, version, now)
        self._awaiting.pop(key, None)
        self._absent.pop(key, None)

    def body(self, key: Key, now: float) -> Manifest | None:
        """The object as last seen, or as Loom's write left it while the watch has not brought that write yet; None
        when it is not here, or a write of Loom's whose answer was not the object is still on its way."""
        awaited = self._awaiting.get(key)
        if awaited is not None:
            if now - awaited[1] <= self.await_s:
                written = awaited[2]
                return None if written is None else json_copy(written)
            del self._awaiting[key]
        seen = self._seen.get(key)
        return None if seen is None else json_copy(seen)

    def unchanged(self, key: Key, digest: str, now: float) -> Manifest | None:
        """The child as Loom last applied it, when applying this manifest again would change nothing; else None."""
        applied, seen = self._applied.get(key), self._seen.get(key)
        if applied is None or seen is None or applied.digest != digest or now - applied.at > self.max_age_s:
            return None
        if version_of(seen) != applied.resource_version or key in self._awaiting:
            return None
        return json_copy(seen)
