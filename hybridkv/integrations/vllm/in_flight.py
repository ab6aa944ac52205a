"""Prompts being computed, or having their pages saved, that later lookups may want.

vLLM's own prefix cache shares blocks while they are computed; the store has a prompt's pages only
once they are saved. So a request arriving while another computes the same long new prefix (two
clients sending one document, a conversation's next turn sent at once) waits for those pages instead
of computing them a second time alongside it. The scheduler side tells this what is computing and
saving, and asks it before each lookup.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from hybridkv.cache.prefix_index import common_length


@dataclass
class _Source:  # a prompt to be computed (or saved) whose pages later lookups may want
    tokens: np.ndarray
    salt: str | None
    stored: int  # tokens of it the store held already when it was looked up
    saved_at: float | None = None  # when its save went to the worker (None: prefill in progress)


class PromptsInFlight:
    # A new prompt sharing at least this many more tokens with one being computed than the store
    # holds waits for that prompt's pages instead of computing them a second time alongside it
    # (with one whose pages are being written, any number of tokens).
    WAIT_FOR_PREFIX_TOKENS = 512
    SAVE_NOTICE_TIMEOUT_S = 10.0  # a save the worker never reports done stops holding lookups back

    def __init__(self, deferred: Callable[[], None]) -> None:
        self._deferred = deferred  # called each time a request starts waiting (a counter)
        self._sources: dict[str, _Source] = {}  # prompts in flight, until their saves are done
        self._waiting_on: dict[str, str] = {}  # request -> the source whose pages it waits for

    def computing(self, req_id: str, tokens: np.ndarray, salt: str | None, stored: int) -> None:
        """`req_id` computes its prompt `tokens` from here on; the store held `stored` of them."""
        self._sources[req_id] = _Source(tokens, salt, stored)

    def saving(self, req_id: str) -> None:
        """Its prompt is complete and its save went to the worker."""
        if (source := self._sources.get(req_id)) is not None:
            source.saved_at = time.monotonic()

    def saved(self, req_ids: Iterable[str]) -> None:
        """The worker reported these saves done: their pages are in the store."""
        for req_id in req_ids:
            self._sources.pop(req_id, None)

    def forget(self, req_id: str) -> None:
        """A finished request: it waits for nothing, and one that never completed its prompt saves nothing."""
        self._waiting_on.pop(req_id, None)
        if (source := self._sources.get(req_id)) is not None and source.saved_at is None:
            del self._sources[req_id]

    def holds_back(self, request) -> bool:
        """Whether the request should wait for another one's pages: that one is to compute (its
        lookup has answered) or is computing at least `WAIT_FOR_PREFIX_TOKENS` more of this prompt
        than the store holds, or its pages are being written and hold any more of it. Two clients
        sending one long new prefix at once would otherwise both compute it (vLLM's own prefix
        cache shares blocks while they are computed, the store only once they are saved), and a
        conversation's next turn sent at once would miss the last turn's pages by milliseconds."""
        req_id = request.request_id
        now = time.monotonic()
        for source_id, source in list(self._sources.items()):
            if source.saved_at is not None and now - source.saved_at > self.SAVE_NOTICE_TIMEOUT_S:
                del self._sources[source_id]
        if self._waiting_on.get(req_id) in self._sources:
            return True
        self._waiting_on.pop(req_id, None)
        if not self._sources:
            return False
        salt = getattr(request, "cache_salt", None)
        prompt = np.asarray(request.prompt_token_ids[:-1], dtype=np.int64)  # one token is always computed
        for source_id, source in self._sources.items():
            if source_id == req_id:
                continue
            gain = common_length(source.tokens, prompt) - source.stored
            # a save in flight is milliseconds away: worth waiting for whatever it adds
            wanted = 1 if source.saved_at is not None else self.WAIT_FOR_PREFIX_TOKENS
            if source.salt == salt and gain >= wanted:
                self._waiting_on[req_id] = source_id
                self._deferred()
                return True
        return False
