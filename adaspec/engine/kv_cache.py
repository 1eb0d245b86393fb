"""Paged KV-cache bookkeeping: the block pool, prefix caching, per-request block tables.

Only the scheduler calls this module; the runner merely reads `req.block_ids`. The GPU/CPU
tensors themselves live in the runner. A block is a run of `block_size` consecutive slots
(slot = block_id * block_size + offset) shared by the target's layers and the draft head.

Prefix caching: a block whose positions all hold committed KV is registered under a hash
chained over every token up to its end (parent hash + its own tokens). Freed blocks keep
their registration and stay evictable in LRU order until reused, so `num_free` counts them.

Draft KV in cached blocks: the draft pair at position p lives at slot p + 1, so a block's draft
KV depends only on the tokens of that block and those before it, like its target KV. But a
request that did not speculate did not write its draft KV (scheduler.py), so a registered
block is also flagged `draft_ok` once its writer's draft covers it (`commit`), and a request
that matches a prefix gets `draft_valid_len` from the leading flagged blocks only; the rest
of its draft is caught up like any other missed positions.
"""
from __future__ import annotations

from collections import OrderedDict

from adaspec.engine.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_key: list[tuple | None] = [None] * num_blocks  # (parent hash, tokens): guards collisions
        self.cached: dict[int, int] = {}  # hash -> block id
        self.draft_ok = [False] * num_blocks   # registered, with the draft KV of its slots written
        # Free blocks in eviction order: front is reused first. Unregistered blocks go to the
        # front (nothing to lose), registered ones to the back (most recently used last).
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.prefix_hit_tokens = 0

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free)

    def blocks_for(self, num_slots: int) -> int:
        return (num_slots + self.block_size - 1) // self.block_size

    # ---- allocation ----------------------------------------------------------------------
    def reserve(self, req: Request, num_slots: int) -> bool:
        """Grow `req`'s block table to hold `num_slots` slots. False (and no change) if the
        pool can't; never partially allocates."""
        need = self.blocks_for(num_slots) - len(req.block_ids)
        if need <= 0:
            return True
        if need > self.num_free:
            return False
        for _ in range(need):
            block, _ = self.free.popitem(last=False)
            self._unregister(block)
            self.ref_count[block] = 1
            req.block_ids.append(block)
        return True

    def release_tail(self, req: Request, keep_slots: int) -> int:
        """Rollback: free the blocks past the first `keep_slots` slots (rejected draft tokens).
        Returns the number of blocks freed."""
        keep = self.blocks_for(keep_slots)
        tail = req.block_ids[keep:]
        del req.block_ids[keep:]
        req.table_synced = min(req.table_synced, keep)
        self._release(reversed(tail))
        return len(tail)

    def free_request(self, req: Request) -> None:
        # Reverse order: the tail (least likely to be shared) is evicted first.
        self._release(reversed(req.block_ids))
        req.block_ids = []
        req.table_synced = 0
        req.num_hashed_blocks = 0
        req.num_draft_blocks = 0
        req.block_hashes = []

    def _release(self, blocks) -> None:
        for b in blocks:
            self.ref_count[b] -= 1
            assert self.ref_count[b] >= 0, f"block {b} freed twice"
            if self.ref_count[b] == 0:
                self.free[b] = None
                if self.block_hash[b] is None:
                    self.free.move_to_end(b, last=False)

    # ---- prefix caching ------------------------------------------------------------------
    def _chain(self, token_ids: list[int], num_blocks: int, parent: int | None = None,
               start: int = 0) -> list[tuple[int, tuple]]:
        out = []
        bs = self.block_size
        for i in range(start, num_blocks):
            toks = tuple(token_ids[i * bs:(i + 1) * bs])
            key = (parent, toks)
            parent = hash(key)
            out.append((parent, key))
        return out

    def match_prefix(self, req: Request) -> int:
        """Attach cached blocks for the longest cached prefix of `req`'s tokens, leaving at
        least one token to compute. Returns the number of tokens covered; sets
        `req.draft_valid_len` from the leading blocks whose draft KV is complete (pairs whose
        slots lie in them: k such blocks hold pairs 0 .. k * block_size - 2)."""
        if not self.enable_prefix_caching or req.block_ids:
            return 0
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits = []
        for h, key in self._chain(req.all_token_ids, max_blocks, _root(req)):
            b = self.cached.get(h)
            if b is None or self.block_key[b] != key:
                break
            hits.append((b, h))
        for b, h in hits:
            if self.ref_count[b] == 0:
                del self.free[b]
            self.ref_count[b] += 1
            req.block_ids.append(b)
            req.block_hashes.append(h)
        req.num_hashed_blocks = len(hits)
        ok = next((i for i, (b, _) in enumerate(hits) if not self.draft_ok[b]), len(hits))
        req.num_draft_blocks = ok
        req.draft_valid_len = ok * self.block_size - 1 if ok else 0
        self.prefix_hit_tokens += len(hits) * self.block_size
        return len(hits) * self.block_size

    def commit(self, req: Request) -> None:
        """Register `req`'s blocks that are full of computed (or launched) KV and whose tokens
        are known on the host, and flag those whose draft KV `req.draft_valid_len` covers. A
        request that matches them later reads their KV in a later step, which the device runs
        after the step writing it."""
        if not self.enable_prefix_caching:
            return
        full = min(req.num_computed, len(req.all_token_ids)) // self.block_size
        if full > req.num_hashed_blocks:
            self._register(req, full)
        ok = min((req.draft_valid_len + 1) // self.block_size, req.num_hashed_blocks)
        for i in range(req.num_draft_blocks, ok):
            b = req.block_ids[i]
            if self.block_hash[b] is not None:
                self.draft_ok[b] = True
        req.num_draft_blocks = max(req.num_draft_blocks, ok)

    def _register(self, req: Request, full: int) -> None:
        parent = req.block_hashes[-1] if req.block_hashes else _root(req)
        for i, (h, key) in enumerate(self._chain(req.all_token_ids, full, parent, req.num_hashed_blocks),
                                     start=req.num_hashed_blocks):
            b = req.block_ids[i]
            req.block_hashes.append(h)
            if h not in self.cached and self.block_hash[b] is None:
                self.cached[h] = b
                self.block_hash[b] = h
                self.block_key[b] = key
        req.num_hashed_blocks = full

    def _unregister(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            if self.cached.get(h) == block:
                del self.cached[h]
            self.block_hash[block] = None
            self.block_key[block] = None
            self.draft_ok[block] = False


def _root(req: Request):
    """The parent of a request's first block: its `cache_salt` (vLLM's), so only requests with
    the same salt share cached prefixes; None without one."""
    salt = getattr(req.params, "cache_salt", None)
    return None if salt is None else ("cache_salt", salt)
