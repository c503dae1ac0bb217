"""Prefix caching: prompts that start like recent ones reuse those tokens' keys and values.

A prompt is cut into blocks of `block` tokens. A full block's keys and values depend only on the
tokens up to its end (and the LoRA adapter the prompt runs with), so a block is named by its tokens
and its parent (the block before it): key = (parent's serial number, the block's token ids), as vLLM
and SGLang key theirs by a hash of the same; a prompt's first block's parent is its LoRA adapter
(0 the base, -s the adapter loaded with serial s: `lora.ServedAdapter.serial`), so prompts under
different adapters, or under two loads of one name, share nothing. The key holds the token ids
themselves, so a lookup is exact (no hash collision can return another prompt's keys). Each
cached block owns `block` token slots of a device pool (per layer k [1, K, H, M] and v [1, K, M, H],
heads over 'mp' like the decode cache; K kv heads, M = capacity); the host table maps keys to blocks in least-recently-used order, and a new block takes
a free one or evicts the least recently used. A parent is always touched after its children, so
leaves go first and a chain is never cut in the middle while its tail stays.

Decoding rows may keep reading a prompt's cached blocks from the pool (a `SharedPrefix`: rows
behind one system prompt read its keys and values once per step between them, not once each from
copies in their own slots); such blocks are pinned (`pin`) until the last of those rows ends, and
eviction passes over them.

`plan` is the whole host side of one admission: which prompt tokens are found (`cached`, always
leaving a prompt's last token to compute, since its logits give the first output token), where
they live (`found`), and which new full blocks the prefill's keys and values go to (`new`).
The device side (gather the found slots, prefill the rest after them, scatter the new blocks in)
is one compiled call, `Generator.admit`.
"""
from __future__ import annotations

import collections
import itertools
from typing import NamedTuple, Optional, Sequence as Seq

import jax.numpy as jnp

DEFAULT_BLOCK = 16  # tokens per block (vLLM's default block size)
DEFAULT_MEMORY = 512 << 20  # bytes: the default bound of the pool ...
DEFAULT_CONTEXTS = 16  # ... or this many full contexts, whichever is smaller


class Plan(NamedTuple):
    """One admission's use of the cache, per prompt (in order)."""

    cached: list[int]  # prompt tokens found in the cache (a multiple of `block`, less than the prompt)
    found: list[list[int]]  # the pool block of each found block
    new: list[list[tuple[int, int]]]  # (block number in the prompt, pool block) to store after the prefill


class _Entry:
    __slots__ = ("serial", "slot")

    def __init__(self, serial: int, slot: int):
        self.serial, self.slot = serial, slot


def default_tokens(config, context: int, block: int = DEFAULT_BLOCK) -> int:
    """The default capacity: DEFAULT_MEMORY of keys and values, at most DEFAULT_CONTEXTS contexts."""
    per_token = 2 * config.layers * config.kv_heads * config.head_dim * jnp.dtype(config.compute_dtype).itemsize
    return min(DEFAULT_MEMORY // per_token, DEFAULT_CONTEXTS * context) // block * block


class PrefixCache:
    """The host table and the device pool of one model's prefix cache (`tokens` slots in all)."""

    def __init__(self, gen, tokens: int, block: int = DEFAULT_BLOCK):
        if block < 1 or tokens < block:
            raise ValueError(f"a prefix cache needs block >= 1 and at least one block of tokens, "
                             f"got block {block}, {tokens} tokens")
        self.block, self.blocks = block, tokens // block
        self.tokens = self.blocks * block
        self.pool = gen.new_pool(self.tokens)  # replaced by each admission (donated to it)
        self._table: collections.OrderedDict[tuple, _Entry] = collections.OrderedDict()  # oldest first
        self._free = list(range(self.blocks))
        self._pins: collections.Counter[int] = collections.Counter()  # block -> rows reading it
        self._serials = itertools.count(1)
        self.queries = self.hits = self.evictions = 0

    def stats(self) -> dict:
        return {"block_tokens": self.block, "capacity_tokens": self.tokens, "cached_tokens": len(self._table) * self.block,
                "shared_tokens": len(self._pins) * self.block,
                "queried_tokens": self.queries, "hit_tokens": self.hits,
                "hit_rate": self.hits / self.queries if self.queries else 0.0, "evicted_blocks": self.evictions}

    def clear(self) -> None:
        """Forget every block and the counters (the pool's contents become unreachable; pinned
        blocks stay readable by their rows and become free when unpinned)."""
        self._table.clear()
        self._free = [b for b in range(self.blocks) if b not in self._pins]
        self.queries = self.hits = self.evictions = 0

    def pin(self, slots: Seq[int]) -> None:
        """A decoding row reads these pool token slots: keep their blocks until `unpin`."""
        self._pins.update({s // self.block for s in slots})

    def unpin(self, slots: Seq[int]) -> None:
        """The row reading these slots ended; a block no row reads and the table forgot is free again."""
        listed = {e.slot for e in self._table.values()}
        for block in {s // self.block for s in slots}:
            self._pins[block] -= 1
            if self._pins[block] <= 0:
                del self._pins[block]
                if block not in listed:
                    self._free.append(block)

    def plan(self, prompts: Seq[Seq[int]], adapters: Optional[Seq[int]] = None) -> Plan:
        """Look every prompt up (each under its adapter's key, default 0: the base), then reserve blocks
        for the full blocks not found.

        Lookups see only blocks stored before this admission (a block filled by this admission's
        prefill cannot be read by it); a block several prompts share is stored once.
        """
        adapters = adapters if adapters is not None else [0] * len(prompts)
        cached, found, serials = [], [], []
        for prompt, adapter in zip(prompts, adapters):
            chain = self._lookup(prompt, adapter)
            cached.append(len(chain) * self.block)
            found.append([e.slot for _, e in chain])
            serials.append(chain[-1][1].serial if chain else -adapter)
            for key, _ in reversed(chain):  # children first: a parent ends more recent than its children
                self._table.move_to_end(key)
            self.queries += len(prompt)
            self.hits += cached[-1]
        used = {s for f in found for s in f}
        new = [self._reserve(p, len(f), serial, used) for p, f, serial in zip(prompts, found, serials)]
        return Plan(cached, found, new)

    def cached_tokens(self, prompt: Seq[int], adapter: int = 0) -> int:
        """The prompt tokens an admission now would read from the cache (`plan` without its effects)."""
        return len(self._lookup(prompt, adapter)) * self.block

    def forget(self, plan: Plan) -> None:
        """Drop the blocks `plan` reserved (their prefill did not happen)."""
        gone = {slot for new in plan.new for _, slot in new}
        for key in [k for k, e in self._table.items() if e.slot in gone]:
            del self._table[key]
        self._free.extend(gone)

    # ---- the table --------------------------------------------------------------------------------

    @staticmethod
    def _key(parent: int, prompt: Seq[int], i: int, block: int) -> tuple:
        return parent, tuple(prompt[i * block:(i + 1) * block])

    def _lookup(self, prompt: Seq[int], adapter: int = 0) -> list[tuple[tuple, _Entry]]:
        """(key, entry) of the longest run of cached blocks from the prompt's start (its last token
        excluded) under `adapter`."""
        chain: list[tuple[tuple, _Entry]] = []
        for i in range((len(prompt) - 1) // self.block):
            key = self._key(chain[-1][1].serial if chain else -adapter, prompt, i, self.block)
            entry = self._table.get(key)
            if entry is None:
                break
            chain.append((key, entry))
        return chain

    def _reserve(self, prompt: Seq[int], start: int, parent: int, used: set[int]) -> list[tuple[int, int]]:
        """Blocks for the prompt's full blocks from block `start` on (after `parent`); those already in
        the table (stored by an earlier prompt of this admission) are chained through, not stored again.
        Stops when the pool is full of blocks this admission uses."""
        new = []
        for i in range(start, len(prompt) // self.block):
            key = self._key(parent, prompt, i, self.block)
            entry = self._table.get(key)
            if entry is None:
                slot = self._take(used)
                if slot is None:
                    break
                entry = self._table[key] = _Entry(next(self._serials), slot)
                used.add(slot)
                new.append((i, slot))
            parent = entry.serial
        return new

    def _take(self, used: set[int]):
        """A free pool block, else the least recently used one's that no decoding row reads (None if
        this admission and those rows use them all)."""
        if self._free:
            return self._free.pop()
        for key, oldest in self._table.items():
            if oldest.slot in self._pins:
                continue
            if oldest.slot in used:
                return None
            del self._table[key]
            self.evictions += 1
            return oldest.slot
        return None
