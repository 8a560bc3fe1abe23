"""Which LoRA adapters each replica probably holds in its engine (pure: no I/O, no clock).

vLLM keeps at most `--max-loras` adapters in the engine's LoRA slots and drops the least recently used one when
another is asked for (loading it again, from the front's copy on disk, costs the request that asks for it). The
picker does not read the engine's slots: like its prefix index, it remembers where it sent each adapter's
requests, at most `slots` adapters per replica, least recently used out first, as the engine evicts.
A replica the picker has not sent an adapter to holds none of it; the base model is in every replica.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class AdapterPlacement:
    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise ValueError("a replica holds at least one adapter")
        self.slots = slots
        self._held: dict[str, OrderedDict[str, None]] = {}

    def holders(self, adapter: str) -> frozenset[str]:
        """The replicas that probably hold `adapter` now."""
        return frozenset(endpoint for endpoint, held in self._held.items() if adapter in held)

    def held(self, endpoint: str) -> list[str]:
        """The adapters a replica probably holds, least recently used first."""
        return list(self._held.get(endpoint, ()))

    def sent(self, endpoint: str, adapter: str) -> None:
        held = self._held.setdefault(endpoint, OrderedDict())
        held[adapter] = None
        held.move_to_end(adapter)
        while len(held) > self.slots:
            held.popitem(last=False)

    def keep(self, endpoints: Iterable[str]) -> None:
        """Forget replicas that are gone (a new pod at the same address starts empty)."""
        wanted = set(endpoints)
        for endpoint in set(self._held) - wanted:
            del self._held[endpoint]
