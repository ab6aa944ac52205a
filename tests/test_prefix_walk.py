"""The block walk both store-backed caches share, over an in-memory store and token-only pages:
whole blocks by key, the variant where a prompt diverges inside a block, the stops, and batched
reads that change the round trips but never the match."""

from __future__ import annotations

import random

import numpy as np

from hybridkv.cache.keys import PrefixKeys, kv_block_key
from hybridkv.cache.prefix_walk import READ_BATCH, PrefixWalk, Walk
from hybridkv.errors import CorruptEntry
from hybridkv.store.codec import Entry, encode
from hybridkv.store.guarded import GuardedStore
from hybridkv.store.memory import MemoryStore
from tests.helpers import RoundTripStore

BLOCK = 4
FINGERPRINT = "ab" * 32
KEYS = PrefixKeys(FINGERPRINT, "", BLOCK)


def walker(inner: MemoryStore | None = None) -> PrefixWalk:
    return PrefixWalk(GuardedStore(inner if inner is not None else MemoryStore()), FINGERPRINT, "blk", "blk-variants")


def block_key(tokens: list[int], end: int) -> str:
    return kv_block_key(KEYS.prefix(tokens, end))


def save(walk: PrefixWalk, tokens: list[int], stored: list[int] | None = None) -> None:
    """Store the blocks of `tokens` as the writers do: each under its prompt's key through its last
    token, listed in its slot. `stored` puts other tokens inside the entries (a bad writer)."""
    chain = KEYS.chain(tokens)
    inside = tokens if stored is None else stored
    for index, start in enumerate(range(0, len(tokens), BLOCK)):
        end = min(start + BLOCK, len(tokens))
        key = block_key(tokens, end)
        walk.store.put(key, encode(Entry("blk", FINGERPRINT, key, {"start": start, "tokens": inside[start:end]})))
        walk.list_block(chain[index], tokens[start:end])


def decode(key: str, entry: Entry, start: int) -> tuple[list[int], int]:
    if entry.meta.get("start") != start:
        raise CorruptEntry("a block stored for another position")
    return entry.meta["tokens"], start


def match(walk: PrefixWalk, prompt: list[int]) -> Walk[int]:
    return walk.match(KEYS, KEYS.chain(prompt), np.asarray(prompt, dtype=np.int64), decode)


def ends(walk: PrefixWalk, prompt: list[int], since: int = 0) -> list[int]:
    wanted = np.asarray(prompt, dtype=np.int64)
    return walk.prompt_ends(KEYS, KEYS.chain(prompt), wanted, since, match(walk, prompt).length)


def test_whole_blocks_by_key_then_the_listed_block_sharing_most_where_the_prompt_diverges():
    walk = walker()
    header = list(range(100, 109))  # two whole blocks and the first token of the third
    a, b, c = header + [1, 2, 3, 4, 5, 6, 7], header + [1, 7, 8, 9, 10, 11, 12], header + [6, 6]
    for prompt in (a, b, c):
        save(walk, prompt)
    found = match(walk, header + [1, 2, 0])  # diverges inside the third block: a's shares most
    assert found.length == 11 and [(x.start, x.end) for x in found.blocks] == [(0, 4), (4, 8), (8, 11)]
    assert found.blocks[-1].tokens == [108, 1, 2, 3]
    found = match(walk, header + [1, 2, 3, 4, 5, 0, 0])  # a's third block whole, by key; then inside its fourth
    assert found.length == 14 and found.blocks[-1].tokens == [4, 5, 6, 7]
    assert match(walk, header + [6, 0]).blocks[-1].tokens == [108, 6, 6]
    assert match(walk, [5, *header]).length == 0  # nothing stored starts with 5


def test_a_shorter_stored_prompt_the_longer_block_hides_is_named_by_where_it_ends():
    """A shared document (ending inside a block) then one question on it: another question's walk
    takes the first question's block (it shares the question's opening words too), and learns
    where the document's own prompt ended, where its checkpoint would be."""
    walk = walker()
    document = list(range(100, 110))  # two whole blocks and two tokens of the third
    save(walk, document)
    save(walk, document + [7, 7, 1])  # the first question
    found = match(walk, document + [7, 7, 2])
    assert found.length == 12 and found.blocks[-1].tokens == [108, 109, 7, 7]
    assert ends(walk, document + [7, 7, 2]) == [10]
    assert match(walk, document + [6, 6]).blocks[-1].tokens == [108, 109]  # the document's own block,
    assert ends(walk, document + [6, 6]) == []  # which marks its checkpoint itself
    assert ends(walk, document + [7]) == [10]  # the first question's block, one token past the document
    assert ends(walk, document) == []  # the match ends where the document does (a checkpoint it marks)
    assert ends(walk, [*document[:9], 5, 5]) == []  # nor one the prompt does not hold whole
    assert ends(walk, document + [7, 7, 2], since=11) == []  # nor one before the tail
    # A first question crossing a block boundary: the second's match ends a block later, and the
    # document's end is found in the block before.
    save(walk, document + [7, 7, 8, 8, 8, 1])
    assert match(walk, document + [7, 7, 8, 8, 8, 2]).length == 15
    assert ends(walk, document + [7, 7, 8, 8, 8, 2]) == [10]


def test_a_missing_block_ends_the_walk_even_where_later_ones_are_stored():
    walk = walker()
    prompt = list(range(1, 21))
    save(walk, prompt)
    walk.store.delete(block_key(prompt, 8))
    found = match(walk, prompt)
    assert found.length == 4 and len(found.blocks) == 1


def test_a_whole_block_agreeing_in_part_ends_the_match_inside_it():
    """A whole block read by its key whose tokens differ inside it (only a bad writer makes one)
    ends the match at the difference: no later block and no listed variant is taken."""
    walk = walker()
    prompt = list(range(1, 21))
    save(walk, prompt, stored=[*prompt[:6], 0, *prompt[7:]])
    found = match(walk, prompt)
    assert found.length == 6 and [b.end for b in found.blocks] == [4, 6]


def test_an_entry_its_decode_rejects_is_reported_removed_and_ends_the_walk():
    walk = walker()
    prompt = list(range(1, 21))
    save(walk, prompt)
    misplaced = block_key(prompt, 12)
    entry = Entry("blk", FINGERPRINT, misplaced, {"start": 0, "tokens": prompt[8:12]})
    walk.store.put(misplaced, encode(entry))
    assert match(walk, prompt).length == 8
    assert walk.store.counts["corrupt"] == 1 and walk.store.get(misplaced) is None
    assert match(walk, prompt).length == 8 and walk.store.counts["corrupt"] == 1


def test_batched_reads_change_the_round_trips_never_the_match():
    rng = random.Random(0)
    for _ in range(40):
        single, batched = walker(), walker(RoundTripStore())
        base = [rng.randrange(1, 4) for _ in range(rng.randrange(1, 40))]
        prompts = [base[: rng.randrange(len(base) + 1)] + [rng.randrange(1, 4) for _ in range(10)] for _ in range(4)]
        # the same damage to both: one of the first prompt's blocks gone, another's checksum broken
        ends = range(BLOCK, len(prompts[0]) + 1, BLOCK)
        gone, damaged = (block_key(prompts[0], rng.choice(ends)) for _ in range(2))
        for walk in (single, batched):
            for prompt in prompts:
                save(walk, prompt)
            walk.store.delete(gone)
            data = walk.store.inner.get(damaged)
            if data is not None:
                walk.store.inner.put(damaged, data[:-1] + bytes([data[-1] ^ 1]))
        for prompt in [*prompts, base + [9], [rng.randrange(1, 4) for _ in range(30)]]:
            want, got = match(single, prompt), match(batched, prompt)
            assert got.length == want.length
            assert [(x.start, x.tokens, x.end) for x in got.blocks] == [(x.start, x.tokens, x.end) for x in want.blocks]
        # entries past where a match ends are read with their batch but never verified, so never counted
        assert batched.store.counts["corrupt"] == single.store.counts["corrupt"]


def test_a_batched_backend_reads_1_2_4_then_read_batch_keys_per_round_trip():
    inner = RoundTripStore()
    walk = walker(inner)
    prompt = list(range(1, 1 + 20 * BLOCK))
    save(walk, prompt)
    inner.trips = 0
    found = match(walk, prompt + [7])  # every block whole, then a variant lookup for the token after
    assert found.length == len(prompt)
    assert READ_BATCH == 8 and inner.trips == 5 + 1  # 1 + 2 + 4 + 8 + 5 blocks; the variants' slot
