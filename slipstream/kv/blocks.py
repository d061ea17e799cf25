"""Paged KV cache: fixed-size blocks of token slots, reference-counted, and a block table per sequence.

K and V for every layer live in two tensors indexed by *slot* (block * block_size + offset), so a
sequence's cache is wherever its block table points. When a sequence's blocks happen to be
consecutive (the common case on a quiet server) attention reads a plain slice instead of gathering.

Blocks are reference-counted so that sequences can share the full blocks of a common prefix (see
`prefix_cache.py`). A block whose count drops to zero but whose content is registered in the
prefix cache is not wiped: it waits in an LRU list, still findable by its hash, and is only
recycled when no never-used block is left.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from slipstream.errors import SlipstreamError


class OutOfBlocks(SlipstreamError):
    pass


def int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows x [..., D] as an int8 KV cache holds them: codes round(x / scale) (nearest, ties to even) and one
    float32 scale absmax / 127 per row (0, and zero codes, for a row of zeros). The native step stores the
    same bits (kernels/cpu/ops.h, ss_store_i8_row)."""
    x = x.float()
    scale = x.abs().amax(-1) / 127.0
    live = scale > 0
    codes = torch.where(live[..., None], x / torch.where(live, scale, 1.0)[..., None], 0.0)
    return codes.round().clamp_(-127, 127).to(torch.int8), scale


def int8_store(codes: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """Rows x [len(slots), KVH, D] into an int8 layer cache (codes [slots, KVH, D], scales [slots, KVH])."""
    c, s = int8_rows(x)
    codes.index_copy_(0, slots, c)
    scales.index_copy_(0, slots, s)


def read_rows(rows: torch.Tensor, scales: torch.Tensor | None, at: tuple[int, int] | torch.Tensor) -> torch.Tensor:
    """A layer cache's rows at `at` (a [start, end) range: a view; an index tensor: gathered) as stored, or,
    for an int8 cache (`scales` [slots, KVH]), their float32 values codes x scales."""
    pick = (lambda t: t[at[0]:at[1]]) if isinstance(at, tuple) else (lambda t: t.index_select(0, at))
    return pick(rows) if scales is None else pick(rows).float() * pick(scales)[..., None]


class BlockAllocator:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._cached_free: OrderedDict[int, None] = OrderedDict()    # ref 0 but content cached; LRU first
        self.ref_count = [0] * num_blocks
        self.hash_of: dict[int, int] = {}       # block -> content hash (registered blocks only)
        self.block_of: dict[int, int] = {}      # content hash -> block

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (never used, or cached and unreferenced)."""
        return len(self._free) + len(self._cached_free)

    @property
    def num_in_use(self) -> int:
        return self.num_blocks - self.num_free

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise OutOfBlocks(f"KV cache full: need {n} blocks, {self.num_free} free")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:  # recycle the least recently used cached block: its content is forgotten
                b, _ = self._cached_free.popitem(last=False)
                del self.block_of[self.hash_of.pop(b)]
            self.ref_count[b] = 1
            out.append(b)
        return out

    def share(self, block: int) -> None:
        """One more sequence reads this (cached) block."""
        if self.ref_count[block] == 0:
            del self._cached_free[block]
        self.ref_count[block] += 1

    def free(self, blocks: list[int]) -> None:
        released = False
        for b in blocks:
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                if b in self.hash_of:
                    self._cached_free[b] = None
                else:
                    self._free.append(b)
                    released = True
        if released:  # keep low ids at the end so new sequences get consecutive blocks again
            self._free.sort(reverse=True)

    def register(self, block: int, content_hash: int) -> None:
        """Make a full block findable by the hash of its tokens (and of every token before them)."""
        if content_hash in self.block_of or block in self.hash_of:
            return  # an identical block is already cached (computed twice concurrently): keep the first
        self.block_of[content_hash] = block
        self.hash_of[block] = content_hash

    def reset_cache(self) -> None:
        """Forget every cached block's content (unreferenced ones become plain free blocks)."""
        for b in self._cached_free:
            self._free.append(b)
        self._cached_free.clear()
        self.hash_of.clear()
        self.block_of.clear()
        self._free.sort(reverse=True)


def block_ids(read: tuple[int, int] | torch.Tensor, block_size: int) -> torch.Tensor:
    """A sequence's block table from its read slots (`SequenceKV.read_slots`: a slot range or the
    gathered slot ids), on the host: what the GPU kernels address the cache with."""
    slots = torch.arange(read[0], read[1]) if isinstance(read, tuple) else read.cpu()
    return slots[::block_size] // block_size


class _BlockCache:
    """What every paged cache shares: fixed-size blocks of slots handed out by one allocator."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.allocator = BlockAllocator(num_blocks)
        # set when every layer attends over at most its last `window` positions (Phi-3 mini): a
        # sequence gives back the blocks that no later token can see (`drop_outside_window`)
        self.window: int | None = None
        self._spare: int | None = None

    def spare_block(self) -> int:
        """A block held for good whose slots read as zeros: where a sequence's table points once its
        blocks outside the window are given back. Attention masks those positions; zeros (not stale
        values, which may be NaN) keep the masked products finite."""
        if self._spare is None:
            self._spare = self.allocator.allocate(1)[0]
            self._zero(self._spare)
        return self._spare

    def _zero(self, block: int) -> None:
        raise NotImplementedError

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def usage(self) -> float:
        return self.allocator.num_in_use / self.num_blocks


class PagedKVCache(_BlockCache):
    """K and V per layer, [num_layers, slots, num_kv_heads, head_dim] each (the Llama family, GQA). With
    dtype torch.int8 the rows hold int8 codes and `k_scale`, `v_scale` [num_layers, slots, num_kv_heads]
    their float32 scales (`int8_rows`): D + 4 bytes a row against fp16's 2 D; `store` and `read` convert."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        super().__init__(num_blocks, block_size)
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        # empty, not zeros: pages are only committed when written, and attention never reads a
        # slot before its token was stored
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        if dtype == torch.int8:
            self.k_scale = torch.empty(shape[:3], dtype=torch.float32, device=device)
            self.v_scale = torch.empty(shape[:3], dtype=torch.float32, device=device)

    def _zero(self, block: int) -> None:
        slots = slice(block * self.block_size, (block + 1) * self.block_size)
        self.k[:, slots].zero_()
        self.v[:, slots].zero_()
        if self.k_scale is not None and self.v_scale is not None:
            self.k_scale[:, slots].zero_()
            self.v_scale[:, slots].zero_()

    def layer_cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """(K, V, addressed through local slots?) of a model layer: here every layer's own rows."""
        return self.k[layer], self.v[layer], False

    def layer_scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """An int8 cache's K and V scale planes of a model layer ([slots, KVH] each), else (None, None)."""
        if self.k_scale is None or self.v_scale is None:
            return None, None
        return self.k_scale[layer], self.v_scale[layer]

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """A model layer's K and V rows [len(slots), KVH, D] written at `slots` (the layer's own slots: local
        ones for a hybrid cache's sliding layers), rounded to the cache's type."""
        lk, lv, _ = self.layer_cache(layer)
        ks, vs = self.layer_scales(layer)
        if ks is None or vs is None:
            lk.index_copy_(0, slots, k.to(lk.dtype))
            lv.index_copy_(0, slots, v.to(lv.dtype))
            return
        int8_store(lk, ks, slots, k)
        int8_store(lv, vs, slots, v)

    def read(self, layer: int, at: tuple[int, int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A model layer's K and V rows at its slots `at` (a [start, end) range or an index tensor), as
        stored: the cache's own dtype, or float32 values (codes x scales) for an int8 cache."""
        lk, lv, _ = self.layer_cache(layer)
        ks, vs = self.layer_scales(layer)
        return read_rows(lk, ks, at), read_rows(lv, vs, at)


class HybridKVCache(PagedKVCache):
    """Gemma 2/3: sliding-window layers interleaved with global ones. The global layers keep every token
    (`k`, `v`: [global layers, slots, KVH, D], as `PagedKVCache`); the sliding layers keep only what a
    window can still see. Every block has a *local part* (`k_local`, `v_local`: [sliding layers, local
    slots, KVH, D]) from its allocation until no sequence holding it has the block inside its window any
    more; then the part goes back and `local_of[block]` points to a zeroed spare part. A block in the
    prefix cache keeps its unheld part (LRU) until a part is needed, so a conversation's next turn finds
    its last window; a prefix hit ends where the window it needs still has its parts (`PrefixCache.match`).
    The sliding layers address the cache through `local_slots`: same block tables and slot numbers,
    translated per block.

    There are as many parts as blocks (plus the spare), so a part is there whenever a block is: the
    scheduler counts blocks only. The memory saved is the pages never written (CPU tensors commit pages
    when first written): a new part is a free one already written before if there is one, else a kept
    part taken back (LRU), and only then one never written; so the sliding layers' memory stays at about
    a window per sequence (`parts_touched`) while the global layers grow with the context."""

    def __init__(self, sliding: list[bool], window: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        if not any(sliding) or all(sliding):
            raise ValueError("a hybrid cache needs both sliding and global layers")
        super().__init__(sum(not s for s in sliding), num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
        self.local_window = window
        n_local = sum(sliding)
        # model layer -> (sliding?, index into k_local/v_local or k/v)
        self.layer_index = [(s, sum(sliding[:i]) if s else sum(not t for t in sliding[:i]))
                            for i, s in enumerate(sliding)]
        shape = (n_local, (num_blocks + 1) * block_size, num_kv_heads, head_dim)
        self.k_local = torch.empty(shape, dtype=dtype, device=device)
        self.v_local = torch.empty(shape, dtype=dtype, device=device)
        self.k_local_scale: torch.Tensor | None = None   # an int8 cache's scales of the local parts
        self.v_local_scale: torch.Tensor | None = None
        if dtype == torch.int8:
            self.k_local_scale = torch.empty(shape[:3], dtype=torch.float32, device=device)
            self.v_local_scale = torch.empty(shape[:3], dtype=torch.float32, device=device)
        self.spare_part = num_blocks                    # the last part: zeros, never handed out
        rows = slice(num_blocks * block_size, (num_blocks + 1) * block_size)
        self.k_local[:, rows].zero_()
        self.v_local[:, rows].zero_()
        if self.k_local_scale is not None and self.v_local_scale is not None:
            self.k_local_scale[:, rows].zero_()
            self.v_local_scale[:, rows].zero_()
        self._free_parts = list(range(num_blocks - 1, -1, -1))    # pop() hands out low parts first
        self._kept_parts: OrderedDict[int, None] = OrderedDict()   # blocks whose unheld part is kept (LRU)
        self.local_ref = [0] * num_blocks               # sequences holding each block's part
        self.parts_touched = 0                          # parts [0, parts_touched) were handed out before
        self._local_of = [self.spare_part] * num_blocks
        self.local_of = torch.full((num_blocks,), self.spare_part, dtype=torch.int64)

    def layer_cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """(K, V, addressed through `local_slots`?) of a model layer."""
        sliding, i = self.layer_index[layer]
        return (self.k_local[i], self.v_local[i], True) if sliding else (self.k[i], self.v[i], False)

    def layer_scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        sliding, i = self.layer_index[layer]
        if sliding:
            if self.k_local_scale is None or self.v_local_scale is None:
                return None, None
            return self.k_local_scale[i], self.v_local_scale[i]
        return super().layer_scales(i)

    def local_slots(self, slots: torch.Tensor | tuple[int, int]) -> torch.Tensor:
        """Where the sliding layers keep the tokens of these (global) slots; the spare's zeros where a
        block's part is gone."""
        s = torch.arange(slots[0], slots[1]) if isinstance(slots, tuple) else slots.to(torch.int64)
        bs = self.block_size
        return self.local_of[s // bs] * bs + s % bs

    def has_part(self, block: int) -> bool:
        return self._local_of[block] != self.spare_part

    def _set_part(self, block: int, part: int) -> None:
        self._local_of[block] = part
        self.local_of[block] = part

    def _give_back_part(self, block: int) -> None:
        self._kept_parts.pop(block, None)
        part = self._local_of[block]
        if part != self.spare_part:
            self._free_parts.append(part)
            self._free_parts.sort(reverse=True)
            self._set_part(block, self.spare_part)

    def attach_parts(self, blocks: list[int]) -> None:
        """Newly allocated blocks get a part each, held by the sequence that allocated them."""
        for b in blocks:
            self._give_back_part(b)      # a recycled prefix-cache block's kept part: its content is gone
            fresh = not self._free_parts or self._free_parts[-1] >= self.parts_touched
            if fresh and self._kept_parts:   # take back a kept part rather than write new pages
                self._give_back_part(next(iter(self._kept_parts)))
            part = self._free_parts.pop()
            self.parts_touched = max(self.parts_touched, part + 1)
            self._set_part(b, part)
            self.local_ref[b] = 1

    def hold_part(self, block: int) -> None:
        """One more sequence has this (shared) block inside its window."""
        assert self.has_part(block), "holding a block whose part is gone"
        self._kept_parts.pop(block, None)
        self.local_ref[block] += 1

    def release_part(self, block: int) -> None:
        self.local_ref[block] -= 1
        if self.local_ref[block] == 0:
            if block in self.allocator.hash_of:   # findable by prefix: keep the part until one is needed
                self._kept_parts[block] = None
            else:
                self._give_back_part(block)

    @property
    def parts_in_use(self) -> int:
        """Parts held or kept."""
        return self.num_blocks - len(self._free_parts)

    @property
    def parts_held(self) -> int:
        """Parts some sequence's window still sees."""
        return self.parts_in_use - len(self._kept_parts)


class LatentKVCache(_BlockCache):
    """The MLA cache (DeepSeek-V3 / GLM-5): per token and layer only the normalised KV latent
    ([num_layers, slots, kv_lora_rank]) and the shared rotary key ([num_layers, slots, rope_dim]);
    with DeepSeek Sparse Attention also the indexer's key ([num_layers, slots, index_dim]).
    Same slots, blocks and allocator as `PagedKVCache`, so the scheduler and prefix cache use it alike."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, latent_dim: int,
                 rope_dim: int, index_dim: int = 0, dtype: torch.dtype = torch.float32):
        super().__init__(num_blocks, block_size)
        slots = num_blocks * block_size
        self.latent = torch.empty((num_layers, slots, latent_dim), dtype=dtype)
        self.rope = torch.empty((num_layers, slots, rope_dim), dtype=dtype)
        self.index_k = torch.empty((num_layers, slots, index_dim), dtype=dtype) if index_dim else None

    def _zero(self, block: int) -> None:
        slots = slice(block * self.block_size, (block + 1) * self.block_size)
        for t in (self.latent, self.rope, self.index_k):
            if t is not None:
                t[:, slots].zero_()


@dataclass
class SequenceKV:
    """The blocks one sequence holds and how many of its slots hold computed tokens."""
    cache: PagedKVCache | LatentKVCache
    block_table: list[int] = field(default_factory=list)
    num_tokens: int = 0
    num_hashed_blocks: int = 0    # leading full blocks already registered in the prefix cache
    last_hash: int | None = None  # hash of the last registered block (the chain's parent)
    num_dropped: int = 0          # leading blocks given back (outside the window); they map to the spare
    num_unheld: int = 0           # hybrid cache: leading blocks whose local part this sequence does not hold
    # the slots of the table's first blocks as (those blocks, their slots as a tensor and as a numpy view of
    # it): `read_slots` / `read_ids` of a scattered
    # table slices it instead of recomputing every slot at every decode step
    _gathered: tuple[list[int], torch.Tensor, np.ndarray] | None = field(default=None, repr=False, compare=False)

    def blocks_needed(self, total_tokens: int) -> int:
        return max(0, -(-total_tokens // self.cache.block_size) - len(self.block_table))

    def reserve(self, total_tokens: int) -> None:
        need = self.blocks_needed(total_tokens)
        if need > 0:
            new = self.cache.allocator.allocate(need)
            if isinstance(self.cache, HybridKVCache):
                self.cache.attach_parts(new)
            self.block_table += new

    def slot(self, pos: int) -> int:
        """The cache slot of position `pos` (reserved)."""
        bs = self.cache.block_size
        return self.block_table[pos // bs] * bs + pos % bs

    def slots(self, start: int, end: int) -> torch.Tensor:
        bs = self.cache.block_size
        if end - start == 1:   # one decode token: a table lookup, not five tensor ops
            return torch.tensor([self.block_table[start // bs] * bs + start % bs])
        pos = torch.arange(start, end)
        table = torch.tensor(self.block_table, dtype=torch.long)
        return table[pos // bs] * bs + pos % bs

    def contiguous_range(self, end: int) -> tuple[int, int] | None:
        """(first slot, last slot + 1) when tokens [0, end) sit in consecutive slots, else None."""
        nb = -(-end // self.cache.block_size)
        t = self.block_table[:nb]
        if t and t[-1] - t[0] == nb - 1 and all(b - a == 1 for a, b in zip(t, t[1:])):
            start = t[0] * self.cache.block_size
            return start, start + end
        return None

    def read_slots(self, end: int) -> tuple[int, int] | torch.Tensor:
        """Where attention reads tokens [0, end): a slot range when contiguous, else the slot ids."""
        rng = self.contiguous_range(end)
        return rng if rng is not None else self._gathered_slots(end)

    def read_ids(self, end: int) -> tuple[int, int] | np.ndarray:
        """`read_slots` with slot ids as a numpy array (int64, sharing the cached tensor's memory): slicing
        it costs a fraction of a tensor slice, which matters once per row of every decode step."""
        rng = self.contiguous_range(end)
        if rng is not None:
            return rng
        have = self._gathered_table(end)
        return have[2][:end] if have is not None else self.slots(0, end).numpy()

    def _gathered_slots(self, end: int) -> torch.Tensor:
        """`slots(0, end)` sliced from the cached slots of the whole table."""
        have = self._gathered_table(end)
        return have[1][:end] if have is not None else self.slots(0, end)

    def _gathered_table(self, end: int) -> tuple[list[int], torch.Tensor, np.ndarray] | None:
        """The cached slots of the whole table (a tensor and a numpy view of it), rebuilt when the table
        has grown past them or changed (compared with the table itself, so an in-place change is seen);
        None when tokens [0, end) are not all reserved (`slots` raises the error)."""
        bs = self.cache.block_size
        nb = -(-end // bs)
        if nb > len(self.block_table):
            return None
        have = self._gathered
        if have is None or len(have[0]) < nb or have[0] != self.block_table[:len(have[0])]:
            blocks = list(self.block_table)
            ids = (np.asarray(blocks, dtype=np.int64)[:, None] * bs + np.arange(bs, dtype=np.int64)).reshape(-1)
            self._gathered = have = (blocks, torch.from_numpy(ids), ids)
        return have

    def drop_outside_window(self) -> int:
        """Give back the leading blocks that no later token can see when every layer attends over its
        last `cache.window` positions (call it between steps, on the committed length: the next token,
        at position num_tokens, sees positions from num_tokens - window + 1 on; one block of slack is
        kept). Their table entries then point to the cache's spare block, so slots and block counts
        keep their meaning. Returns how many blocks were given back."""
        window = self.cache.window
        if not window:
            return self._drop_parts_outside_window()
        bs = self.cache.block_size
        keep_from = min(max(0, (self.num_tokens - window + 1) // bs - 1), len(self.block_table))
        if keep_from <= self.num_dropped:
            return 0
        spare = self.cache.spare_block()
        gone = self.block_table[self.num_dropped:keep_from]
        self.cache.allocator.free(gone)   # blocks in the prefix cache stay findable there
        self.block_table[self.num_dropped:keep_from] = [spare] * len(gone)
        self.num_dropped = keep_from
        return len(gone)

    def _drop_parts_outside_window(self) -> int:
        """A hybrid cache: the local parts of the blocks behind the sliding layers' window go back (the
        blocks themselves stay: the global layers read them). Returns how many parts were let go."""
        cache = self.cache
        if not isinstance(cache, HybridKVCache):
            return 0
        keep_from = min(max(0, (self.num_tokens - cache.local_window + 1) // cache.block_size - 1),
                        len(self.block_table))
        if keep_from <= self.num_unheld:
            return 0
        gone = self.block_table[self.num_unheld:keep_from]
        for b in gone:
            cache.release_part(b)
        self.num_unheld = keep_from
        return len(gone)

    def release(self) -> None:
        if isinstance(self.cache, HybridKVCache):
            for b in self.block_table[self.num_unheld:]:
                self.cache.release_part(b)
        self.cache.allocator.free(self.block_table[self.num_dropped:])
        self.block_table = []
        self._gathered = None
        self.num_tokens = 0
        self.num_hashed_blocks = 0
        self.last_hash = None
        self.num_dropped = 0
        self.num_unheld = 0
