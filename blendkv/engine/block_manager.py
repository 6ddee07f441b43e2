"""Paged KV block allocation with hash-chain prefix caching. Pure Python: ids and ints only.

Every block is **used** (``ref_cnt > 0``, in that many block tables) or **free** (in the free
queue, head evicted first). A free block may still be **cached** (its full-block hash is
registered): a request with the same prefix takes it back; cached blocks go to the queue's tail
and are evicted lazily. With ``place_in_runs`` new blocks are placed so each block table keeps
long runs of consecutive ids (docs/architecture.md, Engine).

A full block's hash is ``xxh3_128(parent_hash, cache_salt, token_ids)``: stable across
processes, chained so equal hashes mean equal whole prefixes.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

import xxhash

if TYPE_CHECKING:
    from blendkv.engine.sequence import Sequence

_ROOT_HASH = 0


def hash_block_tokens(
    parent_hash: int, token_ids: list[int] | tuple[int, ...], salt: bytes = b""
) -> int:
    """Stable 128-bit hash of one full block given the hash of the block before it."""
    h = xxhash.xxh3_128()
    h.update(parent_hash.to_bytes(16, "little"))
    h.update(len(salt).to_bytes(4, "little"))
    h.update(salt)
    h.update(b"".join(t.to_bytes(4, "little", signed=True) for t in token_ids))
    return h.intdigest()


def hash_prefix_blocks(token_ids: list[int], block_size: int, salt: bytes = b"") -> list[int]:
    """Hash chain over every *full* block of ``token_ids``."""
    hashes: list[int] = []
    parent = _ROOT_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size], salt)
        hashes.append(parent)
    return hashes


class BlockManager:
    """Allocates KV blocks to sequences; see the module docstring for the state model."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        place_in_runs: bool = True,
    ):
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.place_in_runs = place_in_runs  # False: new blocks from the queue's head only
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.seq_blocks: dict[str, list[int]] = {}  # request_id -> its block table (shared list)
        self.seq_hashes: dict[str, list[int]] = {}  # request_id -> hashes of its full blocks
        self.pending_copies: list[tuple[int, int]] = []  # copy-on-write (src, dst) to execute

    # ----------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.hash_to_block)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, seq: Sequence) -> tuple[list[int], int]:
        """Longest run of cached full blocks at the start of ``seq``'s tokens.

        Only the first ``num_tokens - 1`` tokens are matched: at least one token must be
        computed to produce logits. A request asking for prompt logits (``logits_from``) matches
        only tokens before that position, so every row it asked for is computed. Returns
        (block ids, number of tokens they hold).
        """
        if not self.enable_prefix_caching:
            return [], 0
        limit = seq.num_tokens - 1
        if seq.logits_from is not None:
            limit = min(limit, seq.logits_from)
        tokens = seq.all_token_ids[:limit]
        blocks: list[int] = []
        for h in hash_prefix_blocks(tokens, self.block_size, seq.cache_salt):
            block_id = self.hash_to_block.get(h)
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks, len(blocks) * self.block_size

    # ------------------------------------------------------------- allocation
    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] | None = None
    ) -> bool:
        """Grow ``seq``'s block table to hold ``num_computed_tokens + num_new_tokens`` tokens.

        ``computed_blocks`` (from :meth:`get_computed_blocks`, only for a sequence holding no
        blocks yet) are prefix-cache hits taken before any new block. Returns False and changes
        nothing when the free queue cannot cover it.
        """
        computed_blocks = computed_blocks or []
        table = self.seq_blocks.setdefault(seq.request_id, seq.block_table)
        assert table is seq.block_table
        assert not computed_blocks or not table, "prefix hits only for a fresh sequence"
        num_computed = max(seq.num_computed_tokens, len(computed_blocks) * self.block_size)
        total_blocks = self.blocks_needed(num_computed + num_new_tokens)
        num_new_blocks = max(0, total_blocks - len(table) - len(computed_blocks))
        cow_index = self._cow_index(table, num_computed) if num_new_tokens else None
        num_revived = sum(1 for b in computed_blocks if self.ref_cnt[b] == 0)
        needed = num_new_blocks + num_revived + (cow_index is not None)
        if needed > self.num_free_blocks:
            return False
        for block_id in computed_blocks:
            self._touch(block_id)
            table.append(block_id)
        if cow_index is not None:
            self._copy_on_write(table, cow_index)
        self._append_blocks(table, num_new_blocks)
        return True

    def free(self, seq: Sequence) -> None:
        """Release all of ``seq``'s blocks (finished, aborted or preempted)."""
        table = self.seq_blocks.pop(seq.request_id, None)
        self.seq_hashes.pop(seq.request_id, None)
        if table is None:
            return
        for block_id in reversed(table):
            self.ref_cnt[block_id] -= 1
            assert self.ref_cnt[block_id] >= 0
            if self.ref_cnt[block_id] == 0:
                self.free_queue[block_id] = None
                if self.block_hash[block_id] is None:
                    self.free_queue.move_to_end(block_id, last=False)
        table.clear()

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let ``child`` share all of ``parent``'s blocks (parallel sampling, beam search)."""
        assert child.request_id not in self.seq_blocks
        child.block_table[:] = parent.block_table
        self.seq_blocks[child.request_id] = child.block_table
        self.seq_hashes[child.request_id] = list(self.seq_hashes.get(parent.request_id, []))
        for block_id in child.block_table:
            self.ref_cnt[block_id] += 1

    def cache_full_blocks(self, seq: Sequence, num_computed_tokens: int) -> None:
        """Register the hashes of blocks that became full once ``num_computed_tokens`` are in."""
        if not self.enable_prefix_caching:
            return
        hashes = self.seq_hashes.setdefault(seq.request_id, [])
        num_full = num_computed_tokens // self.block_size
        if num_full <= len(hashes):
            return
        tokens = seq.all_token_ids
        parent = hashes[-1] if hashes else _ROOT_HASH
        for index in range(len(hashes), num_full):
            start = index * self.block_size
            parent = hash_block_tokens(
                parent, tokens[start : start + self.block_size], seq.cache_salt
            )
            hashes.append(parent)
            block_id = seq.block_table[index]
            if self.block_hash[block_id] is None and parent not in self.hash_to_block:
                self.block_hash[block_id] = parent
                self.hash_to_block[parent] = block_id

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (e.g. after the weights changed)."""
        for block_id in self.hash_to_block.values():
            self.block_hash[block_id] = None
        self.hash_to_block.clear()
        for hashes in self.seq_hashes.values():
            hashes.clear()

    # ---------------------------------------------------------------- helpers
    def _touch(self, block_id: int) -> None:
        if self.ref_cnt[block_id] == 0:
            del self.free_queue[block_id]
        self.ref_cnt[block_id] += 1

    def _append_blocks(self, table: list[int], count: int) -> None:
        """Append ``count`` free blocks to ``table``, in runs of consecutive ids where it can
        (see the module docstring)."""
        if not self.place_in_runs:
            table.extend(self._pop_free_block() for _ in range(count))
            return
        while count and table and self._placeable(table[-1] + 1):
            table.append(self._take(table[-1] + 1))
            count -= 1
        if not count:
            return
        start = self._place(count)
        if start is None:
            table.extend(self._pop_free_block() for _ in range(count))
        else:
            table.extend(self._take(b) for b in range(start, start + count))

    def _placeable(self, block_id: int) -> bool:
        """Free and holding nothing reusable."""
        return (
            block_id < self.num_blocks
            and self.ref_cnt[block_id] == 0
            and self.block_hash[block_id] is None
        )

    def _place(self, count: int) -> int | None:
        """First block of ``count`` placeable blocks in a row, in the longest such run; None if
        no run is long enough. One pass over the pool (Python lists)."""
        ref, hashes = self.ref_cnt, self.block_hash
        best_start, best_len, start = 0, 0, -1
        for b in range(self.num_blocks):
            if ref[b] == 0 and hashes[b] is None:
                if start < 0:
                    start = b
            elif start >= 0:
                if b - start > best_len:
                    best_start, best_len = start, b - start
                start = -1
        if start >= 0 and self.num_blocks - start > best_len:
            best_start, best_len = start, self.num_blocks - start
        if best_len < count:
            return None
        if best_start > 0 and ref[best_start - 1] > 0:
            return best_start + (best_len - count) // 2  # leave the table before it room
        return best_start

    def _take(self, block_id: int) -> int:
        del self.free_queue[block_id]
        self.ref_cnt[block_id] = 1
        return block_id

    def _pop_free_block(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        assert self.ref_cnt[block_id] == 0
        h = self.block_hash[block_id]
        if h is not None:  # lazy eviction of a cached block
            del self.hash_to_block[h]
            self.block_hash[block_id] = None
        self.ref_cnt[block_id] = 1
        return block_id

    def _cow_index(self, table: list[int], num_computed: int) -> int | None:
        """Index of the partially filled block the next token lands in, if it is shared."""
        index = num_computed // self.block_size
        if num_computed % self.block_size == 0 or index >= len(table):
            return None
        return index if self.ref_cnt[table[index]] > 1 else None

    def _copy_on_write(self, table: list[int], index: int) -> None:
        src = table[index]
        dst = self._pop_free_block()
        self.ref_cnt[src] -= 1
        table[index] = dst
        self.pending_copies.append((src, dst))

    # -------------------------------------------------------------- integrity
    def check_integrity(self) -> None:
        """Assert the allocator's invariants; tests call this after every step."""
        refs = [0] * self.num_blocks
        for table in self.seq_blocks.values():
            for block_id in table:
                refs[block_id] += 1
        assert refs == self.ref_cnt, "ref counts disagree with block tables"
        for block_id in range(self.num_blocks):
            in_queue = block_id in self.free_queue
            assert in_queue == (self.ref_cnt[block_id] == 0), f"block {block_id} free state"
        for h, block_id in self.hash_to_block.items():
            assert self.block_hash[block_id] == h, f"block {block_id} hash mismatch"
        assert sum(h is not None for h in self.block_hash) == len(self.hash_to_block)
        used = sum(1 for r in self.ref_cnt if r > 0)
        assert used + self.num_free_blocks == self.num_blocks
