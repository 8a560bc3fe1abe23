"""How many characters of prompt text make one of the model's tokens, learned from the engines (pure).

The picker has no tokenizer: it cuts prompts into blocks of `block_size * chars_per_token` characters to predict
the engine's KV blocks. Four characters a token fits English under the usual tokenizers, not every model: the local
stack's example Llama (a 512-entry tokenizer) takes about 2.3 in chats, so with a guess of 4 the picker sees half
the blocks the engine caches, and a system prompt the engine reuses a block of can look like no shared prefix.
Each replica's engine counts the prompt tokens it took (`vllm:prompt_tokens_total`) and the picker counts the
characters of the prompts it sent there: over enough tokens their ratio is the model's characters per token.

A new ratio changes every block hash: the ratio in use moves only after MIN_TOKENS tokens and when the measured one
is off by more than CHANGE (a few times in a picker's life at most), and the index under the old one is still
consulted (blocks.BlockIndexes), so no prefix is forgotten at a change. Requests that reach an engine without the
picker (or whose prompt the picker cannot read) add tokens and no characters: the ratio comes out low, which
predicts more, smaller blocks than the engine has; a shared prefix still shows as shared.
"""

from __future__ import annotations

from collections import Counter

MIN_TOKENS = 2000  # prompt tokens counted before the first measured ratio is trusted
CHANGE = 0.25  # the measured ratio replaces the one in use when they differ by more than this fraction
LOWEST, HIGHEST = 0.5, 64.0


class CharsPerToken:
    """`value` is the ratio in use; `fixed` (set in the picker's config) is never replaced."""

    def __init__(self, initial: float, fixed: bool = False) -> None:
        self.value = initial
        self.fixed = fixed
        self._tokens_at_start: dict[str, float] = {}  # each engine's counter when the picker first read it
        self._tokens: dict[str, float] = {}  # ... and when it last read it
        self._chars: Counter[str] = Counter()  # characters sent to each engine since its first reading

    def sent(self, endpoint: str, chars: int) -> None:
        """A request with `chars` characters of prompt went to `endpoint`. Counted only once the engine's counter
        has been read: the tokens of what went there before are part of the starting count."""
        if endpoint in self._tokens_at_start:
            self._chars[endpoint] += chars

    def observe(self, endpoint: str, prompt_tokens: float) -> bool:
        """The engine's prompt-token counter as just read; True when the ratio in use changed."""
        if endpoint not in self._tokens_at_start or prompt_tokens < self._tokens.get(endpoint, 0.0):
            # First reading, or the counter went back (the engine restarted): count from here.
            self._tokens_at_start[endpoint] = self._tokens[endpoint] = prompt_tokens
            self._chars[endpoint] = 0
            return False
        self._tokens[endpoint] = prompt_tokens
        measured = self.measured()
        if self.fixed or measured is None or abs(measured - self.value) <= CHANGE * self.value:
            return False
        self.value = measured
        return True

    def measured(self) -> float | None:
        """Characters per token over every engine read so far; None before MIN_TOKENS tokens."""
        tokens = sum(self._tokens[e] - self._tokens_at_start[e] for e in self._tokens)
        if tokens < MIN_TOKENS:
            return None
        return min(HIGHEST, max(LOWEST, sum(self._chars.values()) / tokens))

    def keep(self, endpoints: set[str]) -> None:
        """Forget replicas that went away (their counts leave the ratio with them)."""
        for gone in set(self._tokens) - endpoints:
            del self._tokens[gone], self._tokens_at_start[gone]
            self._chars.pop(gone, None)
