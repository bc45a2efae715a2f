"""The compressed store: GPU pools of compressed KV blocks for every layer, their allocator, the
virtual slot ids that name stored blocks, and the compressor that fills the store.

Unit of allocation: a *virtual block*, ``B`` tokens of one cached prefix (= one SGLang page) in all
layers and KV heads. The block's K is either dense or 2:4 sparse, the same in every layer and KV
head (with a K head map: 2:4 on the mapped heads only, below), and takes one slot of the dense-K or
the sparse-K pool; V likewise. Because a virtual block
always occupies the same slots in every layer, a radix-tree node can be split or evicted at any
block boundary and frees exactly what it holds.

Per layer the pools follow :mod:`sglang_hs.format`, with one pool row per (slot, KV head):
row ``slot * H + h``. The index maps ``k_index``/``v_index`` ``[H, capacity]`` hold, per KV head
and virtual block, the signed entry of that row (``>= 0`` dense, ``< 0`` sparse ``~row``); they are
shared by all layers and are what the kernels and the reference read.

**K head map** (``k_sparse_heads``, bool ``[L, H]``, from ``--hierasparse-k-head-map``): in a K-sparse
block only the mapped (layer, head) pairs store K 2:4; the others, the heads that retrieve, keep it
dense. The slot accounting does not change (a K-sparse block still takes one sparse-K slot in every
layer); in layer ``l`` with ``n_s`` mapped heads the slot owns sparse-K rows ``slot * n_s + rank`` and
dense-K rows ``k_dense_slots * H + slot * (H - n_s) + rank`` (rank: the head's place among the
mapped, resp. unmapped, heads of the layer), so the pools' sizes differ per layer and no row is
wasted. ``k_index`` is then ``[L, H, capacity]``, one map per layer (:meth:`CompressedStore.k_index_of`).

Block choice: the caller ranks a prefix's blocks by their pruning loss summed over layers and
heads (see :func:`compress_prefix`), so the decision is per virtual block.

Virtual slots (:class:`VirtualSlots`): a compressed token keeps one slot id in SGLang's token tables
(the radix tree's ``node.value``, ``req_to_token``), ``base + vb·B + offset``, above every dense
slot, so that the attention backend can tell it apart and resolve block ``vb`` through the index maps.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from sglang_hs.format import (FP8_DTYPE, BlockPools, dense_block_bytes, pack_2to4, quantize_rows, sparse_block_bytes,
                               sparse_entry)  # fmt: skip
from sglang_hs.pruner import Operand, Pruner, rank_sparse

logger = logging.getLogger(__name__)


class VirtualSlots:
    """The virtual slot id space of compressed tokens, placed above every dense slot."""

    def __init__(self, base: int, block_size: int):
        if base % block_size:
            raise ValueError("virtual_base must be block aligned")
        self.base, self.block_size = base, block_size

    def mask(self, slots: torch.Tensor) -> torch.Tensor:
        return slots >= self.base

    def blocks_of(self, slots: torch.Tensor) -> list[int]:
        """Distinct virtual block ids among virtual ``slots`` (host sync)."""
        return torch.unique((slots - self.base) // self.block_size).tolist()

    def block_table(self, rows: torch.Tensor) -> torch.Tensor:
        """int32 block table of ``req_to_token`` rows ``[bs, L]``: per block of ``B`` tokens, the
        SGLang page id (dense) or ``~vb`` (compressed virtual block ``vb``)."""
        starts = rows[:, :: self.block_size].long()
        pages = starts // self.block_size
        return torch.where(starts >= self.base, ~((starts - self.base) // self.block_size), pages).to(torch.int32)

    def slots_of(self, vbs: list[int], device) -> torch.Tensor:
        offsets = torch.arange(self.block_size, device=device)
        starts = torch.tensor(vbs, dtype=torch.int64, device=device) * self.block_size + self.base
        return (starts[:, None] + offsets[None, :]).reshape(-1)


class BlockPlacement(NamedTuple):
    """Where one virtual block's K and V live: which pool (sparse or dense) and which slot of it."""

    k_sparse: bool
    k_slot: int
    v_sparse: bool
    v_slot: int


@dataclass(frozen=True)
class StoreCapacity:
    """Slots of each pool (a slot holds one block of every KV head, in every layer)."""

    virtual_blocks: int
    k_dense: int
    k_sparse: int
    v_dense: int
    v_sparse: int

    @classmethod
    def from_budget(
        cls, budget_bytes: int, num_layers: int, kv_heads: int, head_dim: int, block_size: int, sk: float, sv: float,
        k_sparse_share: float = 1.0, elem_bytes: int = 2,
    ) -> "StoreCapacity":
        """Split a byte budget between the pools in the proportions the expected S_K/S_V need.
        ``k_sparse_share``: the share of (layer, head) pairs whose K a K-sparse block stores 2:4 (the
        K head map's; 1 without one); ``elem_bytes``: of the stored values (1: FP8 with row scales)."""
        dense = dense_block_bytes(block_size, head_dim, elem_bytes) * kv_heads * num_layers
        sparse = sparse_block_bytes(block_size, head_dim, elem_bytes) * kv_heads * num_layers
        k_sparse = k_sparse_share * sparse + (1 - k_sparse_share) * dense
        per_block = (1 - sk) * dense + sk * k_sparse + (1 - sv) * dense + sv * sparse
        blocks = int(budget_bytes // per_block)
        # Round each pool down so the total never exceeds the budget.
        return cls(
            virtual_blocks=blocks,
            k_dense=math.floor((1 - sk) * blocks),
            k_sparse=math.floor(sk * blocks),
            v_dense=math.floor((1 - sv) * blocks),
            v_sparse=math.floor(sv * blocks),
        )

    def nbytes(self, num_layers: int, kv_heads: int, head_dim: int, block_size: int, k_sparse_share: float = 1.0,
               elem_bytes: int = 2) -> int:  # fmt: skip
        """Bytes of a store of this capacity: what allocating it takes (``k_sparse_share`` and
        ``elem_bytes`` as in :meth:`from_budget`)."""
        rows = kv_heads * num_layers
        dense_row = dense_block_bytes(block_size, head_dim, elem_bytes)
        sparse_row = sparse_block_bytes(block_size, head_dim, elem_bytes)
        k_sparse_rows = round(k_sparse_share * rows)  # rows of a K-sparse slot stored 2:4
        k_sparse_block = k_sparse_rows * sparse_row + (rows - k_sparse_rows) * dense_row
        return (self.k_dense + self.v_dense) * rows * dense_row + self.k_sparse * k_sparse_block + self.v_sparse * rows * sparse_row


class StoreFull(Exception):
    """Not enough free slots for a compression; the caller evicts or keeps the prefix dense."""


class CompressedStore:
    def __init__(
        self,
        capacity: StoreCapacity,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        allocate: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None,
        k_sparse_heads: torch.Tensor | None = None,
        value_dtype: torch.dtype | None = None,
    ):
        """``allocate(shape, dtype)`` makes the zero-filled pool tensors (default: ``torch.zeros`` on
        ``device``); a host-tier store passes SGLang's pinned host allocation, which GPU copy kernels
        read and write directly. ``k_sparse_heads``: the K head map, bool ``[L, H]`` (module
        docstring); None: every head's K follows its block. ``value_dtype``: of the stored values,
        ``dtype`` (the model's, default) or :data:`~sglang_hs.format.FP8_DTYPE` with a float32 scale per
        pool row (:mod:`sglang_hs.format`)."""
        self.capacity = capacity
        self.value_dtype = value_dtype or dtype
        self.quantized = self.value_dtype == FP8_DTYPE
        if self.value_dtype not in (dtype, FP8_DTYPE):
            raise ValueError(f"store values of {self.value_dtype}; allowed: the model's {dtype} or {FP8_DTYPE}")
        self.elem_bytes = self.value_dtype.itemsize
        self.num_layers, self.kv_heads, self.head_dim, self.block_size = num_layers, kv_heads, head_dim, block_size
        # The concrete device ("cuda:0", not "cuda"): callers compare it with their tensors' devices.
        self.dtype, self.device = dtype, torch.empty(0, device=device).device
        h, b, d = kv_heads, block_size, head_dim
        if k_sparse_heads is not None:
            k_sparse_heads = k_sparse_heads.to(torch.bool).cpu()
            if tuple(k_sparse_heads.shape) != (num_layers, kv_heads):
                raise ValueError(f"K head map of shape {tuple(k_sparse_heads.shape)}; the store has "
                                 f"{num_layers} layers of {kv_heads} KV heads")  # fmt: skip
        self.k_sparse_heads = k_sparse_heads
        # Per layer and head: the head's rank among the layer's 2:4-K heads, or among its dense-K heads.
        mapped = k_sparse_heads if k_sparse_heads is not None else torch.ones(num_layers, h, dtype=torch.bool)
        k_sparse_rank = torch.where(mapped, mapped.long().cumsum(1) - 1, -1)
        k_dense_rank = torch.where(mapped, -1, (~mapped).long().cumsum(1) - 1)
        self._k_sparse_rows = mapped.sum(1).tolist()  # per layer: rows of one sparse-K slot stored 2:4
        # Per (layer, head), where a K-sparse block's K row goes: (stored 2:4, slot stride, offset), the
        # row being slot * stride + offset in the sparse-K pools (2:4) or the dense-K pool (not).
        n_sparse = mapped.sum(1, keepdim=True)
        self._k_block_rows_host = torch.stack([
            mapped.long(),
            torch.where(mapped, n_sparse, h - n_sparse),
            torch.where(mapped, k_sparse_rank, capacity.k_dense * h + k_dense_rank),
        ], dim=-1).to(torch.int32)  # fmt: skip
        self.k_sparse_block_rows = self._k_block_rows_host.to(self.device)  # what the fused compressor reads
        # The K ranking loss counts the heads that store K 2:4 (float32 [L, H] weights; V: every head).
        self.loss_head_weights = {"k": mapped.float().to(self.device),
                                  "v": torch.ones(num_layers, h, device=self.device)}  # fmt: skip
        # Per layer, (2:4 heads, dense heads) of a K-sparse block in head order, on the store's device;
        # a head's place in its list is its rank (None: all heads 2:4, no head selection needed).
        self._k_head_split = [None if k_sparse_heads is None else
                              (row.nonzero()[:, 0].to(self.device), (~row).nonzero()[:, 0].to(self.device))
                              for row in mapped]  # fmt: skip

        def pool(rows: list[int], *shape: int, dtype: torch.dtype = dtype) -> list[torch.Tensor]:
            return [torch.zeros(n, *shape, dtype=dtype, device=device) if allocate is None or n == 0
                    else allocate((n, *shape), dtype) for n in rows]  # fmt: skip

        c = capacity
        k_dense_rows = [c.k_dense * h + c.k_sparse * (h - n) for n in self._k_sparse_rows]
        k_sparse_rows = [c.k_sparse * n for n in self._k_sparse_rows]
        v_dense_rows, v_sparse_rows = [c.v_dense * h] * num_layers, [c.v_sparse * h] * num_layers
        self.k_dense = pool(k_dense_rows, b, d, dtype=self.value_dtype)
        self.k_values = pool(k_sparse_rows, b, d // 2, dtype=self.value_dtype)
        self.k_meta = pool(k_sparse_rows, b, d // 16, dtype=torch.int16)
        self.v_dense = pool(v_dense_rows, b, d, dtype=self.value_dtype)
        self.v_values = pool(v_sparse_rows, d, b // 2, dtype=self.value_dtype)
        self.v_meta = pool(v_sparse_rows, d, b // 16, dtype=torch.int16)
        # FP8 values: a float32 scale per row of each value pool (empty lists for 16-bit values).
        scales = (k_dense_rows, k_sparse_rows, v_dense_rows, v_sparse_rows) if self.quantized else ([],) * 4
        self.k_dense_scale, self.k_values_scale, self.v_dense_scale, self.v_values_scale = (
            pool(rows, dtype=torch.float32) for rows in scales)
        k_maps = (num_layers,) if k_sparse_heads is not None else ()
        self.k_index = torch.zeros(*k_maps, h, capacity.virtual_blocks, dtype=torch.int32, device=device)
        self.v_index = torch.zeros(h, capacity.virtual_blocks, dtype=torch.int32, device=device)
        # Host-side ownership: per virtual block, (is_sparse, slot) of its K and of its V.
        self._k_slot: dict[int, tuple[bool, int]] = {}
        self._v_slot: dict[int, tuple[bool, int]] = {}
        self._pointer_tables: dict[tuple, torch.Tensor] = {}
        self.clear()

    # ----------------------------------------------------------------------------- bookkeeping
    def clear(self) -> None:
        """Forget every block (the pools' bytes are left as they are)."""
        c = self.capacity
        self._free = {
            "virtual": list(range(c.virtual_blocks - 1, -1, -1)),
            "k_dense": list(range(c.k_dense - 1, -1, -1)),
            "k_sparse": list(range(c.k_sparse - 1, -1, -1)),
            "v_dense": list(range(c.v_dense - 1, -1, -1)),
            "v_sparse": list(range(c.v_sparse - 1, -1, -1)),
        }
        self._k_slot.clear()
        self._v_slot.clear()

    def free_counts(self) -> dict[str, int]:
        return {name: len(ids) for name, ids in self._free.items()}

    def used_blocks(self) -> int:
        return len(self._k_slot)

    def placement(self, vb: int) -> BlockPlacement:
        """The pools and slots of virtual block ``vb`` (allocated)."""
        return BlockPlacement(*self._k_slot[vb], *self._v_slot[vb])

    def placements(self) -> dict[int, BlockPlacement]:
        """Every allocated virtual block's placement (two stores hold the same blocks iff equal)."""
        return {vb: self.placement(vb) for vb in self._k_slot}

    def check(self) -> str | None:
        """None if every slot is either free or owned exactly once, else a description."""
        c = self.capacity
        counts = {
            "virtual": (len(self._free["virtual"]) + len(self._k_slot), c.virtual_blocks),
            "k_dense": (len(self._free["k_dense"]) + sum(not sp for sp, _ in self._k_slot.values()), c.k_dense),
            "k_sparse": (len(self._free["k_sparse"]) + sum(sp for sp, _ in self._k_slot.values()), c.k_sparse),
            "v_dense": (len(self._free["v_dense"]) + sum(not sp for sp, _ in self._v_slot.values()), c.v_dense),
            "v_sparse": (len(self._free["v_sparse"]) + sum(sp for sp, _ in self._v_slot.values()), c.v_sparse),
        }
        bad = {name: got for name, got in counts.items() if got[0] != got[1]}
        if bad or self._k_slot.keys() != self._v_slot.keys():
            return f"compressed store leak: (free + used, capacity) = {bad}"
        return None

    @property
    def k_sparse_share(self) -> float:
        """The share of (layer, head) pairs whose K a K-sparse block stores 2:4 (1 without a head map)."""
        return sum(self._k_sparse_rows) / (self.num_layers * self.kv_heads)

    def k_index_of(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s K index map ``[H, capacity]`` (the one shared map without a K head map)."""
        return self.k_index[layer] if self.k_index.dim() == 3 else self.k_index

    def stored_bytes(self) -> int:
        """Bytes of the blocks currently held (all layers), from the pools' slots in use (free counts
        against capacity, which :meth:`check` verifies): the tree publishes this after every
        compression and eviction, so it must not walk the blocks."""
        dense_row = dense_block_bytes(self.block_size, self.head_dim, self.elem_bytes)
        sparse_row = sparse_block_bytes(self.block_size, self.head_dim, self.elem_bytes)
        rows = self.kv_heads * self.num_layers
        k_sparse_rows = sum(self._k_sparse_rows)
        k_sparse_block = k_sparse_rows * sparse_row + (rows - k_sparse_rows) * dense_row
        free = self.free_counts()
        used = {name: getattr(self.capacity, name) - free[name] for name in ("k_dense", "k_sparse", "v_dense", "v_sparse")}
        k = used["k_sparse"] * k_sparse_block + used["k_dense"] * rows * dense_row
        v = (used["v_sparse"] * sparse_row + used["v_dense"] * dense_row) * rows
        return k + v

    def _take(self, pool: str, n: int) -> list[int]:
        ids = self._free[pool]
        taken = ids[len(ids) - n :][::-1] if n else []
        del ids[len(ids) - n :]
        return taken

    def allocate(self, sparse_k: list[bool], sparse_v: list[bool]) -> list[int]:
        """Reserve virtual blocks and pool slots for blocks of these kinds; returns virtual ids.

        Raises :class:`StoreFull` (and reserves nothing) when any pool lacks room.
        """
        need = {
            "virtual": len(sparse_k),
            "k_sparse": sum(sparse_k),
            "k_dense": len(sparse_k) - sum(sparse_k),
            "v_sparse": sum(sparse_v),
            "v_dense": len(sparse_v) - sum(sparse_v),
        }
        short = {name: n for name, n in need.items() if n > len(self._free[name])}
        if short:
            raise StoreFull(f"compressed store lacks {short} (free: {self.free_counts()})")
        vbs = self._take("virtual", need["virtual"])
        k_ids = {True: iter(self._take("k_sparse", need["k_sparse"])), False: iter(self._take("k_dense", need["k_dense"]))}
        v_ids = {True: iter(self._take("v_sparse", need["v_sparse"])), False: iter(self._take("v_dense", need["v_dense"]))}
        for vb, sk, sv in zip(vbs, sparse_k, sparse_v):
            self._k_slot[vb] = (sk, next(k_ids[sk]))
            self._v_slot[vb] = (sv, next(v_ids[sv]))
        self._write_index(vbs)
        return vbs

    def free(self, vbs: list[int]) -> None:
        for vb in vbs:
            k_sparse, k_slot = self._k_slot.pop(vb)
            v_sparse, v_slot = self._v_slot.pop(vb)
            self._free["k_sparse" if k_sparse else "k_dense"].append(k_slot)
            self._free["v_sparse" if v_sparse else "v_dense"].append(v_slot)
            self._free["virtual"].append(vb)

    def _write_index(self, vbs: list[int]) -> None:
        """Publish the per-head index-map entries of newly allocated blocks."""
        heads = torch.arange(self.kv_heads, dtype=torch.int64)

        def entries(slots: dict[int, tuple[bool, int]]) -> torch.Tensor:
            sparse = torch.tensor([slots[vb][0] for vb in vbs])
            rows = torch.tensor([slots[vb][1] for vb in vbs])[None, :] * self.kv_heads + heads[:, None]
            return torch.where(sparse[None, :], sparse_entry(rows), rows).to(torch.int32)

        columns = torch.tensor(vbs, dtype=torch.int64, device=self.device)
        if self.k_sparse_heads is None:
            self.k_index[:, columns] = entries(self._k_slot).to(self.device)
        else:
            self.k_index[:, :, columns] = self._k_entries(vbs).to(self.device)
        self.v_index[:, columns] = entries(self._v_slot).to(self.device)

    def _k_entries(self, vbs: list[int]) -> torch.Tensor:
        """int32 ``[L, H, n]`` K index entries of blocks ``vbs`` under the K head map (module docstring)."""
        sparse = torch.tensor([self._k_slot[vb][0] for vb in vbs])
        slot = torch.tensor([self._k_slot[vb][1] for vb in vbs])
        h = self.kv_heads
        dense_block = (slot[None, :] * h + torch.arange(h)[:, None]).expand(self.num_layers, h, len(vbs))
        mapped, stride, offset = (t[:, :, None].long() for t in self._k_block_rows_host.unbind(-1))
        row = slot * stride + offset
        in_sparse_block = torch.where(mapped != 0, sparse_entry(row), row)
        return torch.where(sparse[None, None, :], in_sparse_block, dense_block).to(torch.int32)

    # ----------------------------------------------------------------------------- data
    def pointer_table(self, name: str, device: torch.device | str, layers: tuple[int, ...] | None = None,
                      first_row: int = 0) -> torch.Tensor:  # fmt: skip
        """uint64 addresses of pool tensor ``name``'s row ``first_row`` in ``layers`` (default: every
        layer), on ``device``: SGLang's all-layer copy kernels take such a table (built once per
        argument set)."""
        layers = tuple(range(self.num_layers)) if layers is None else layers
        key = (name, str(device), layers, first_row)
        if key not in self._pointer_tables:
            tensors = getattr(self, name)
            row_bytes = math.prod(tensors[0].shape[1:]) * tensors[0].element_size()
            addresses = [tensors[layer].data_ptr() + first_row * row_bytes for layer in layers]
            self._pointer_tables[key] = torch.tensor(addresses, dtype=torch.uint64, device=device)
        return self._pointer_tables[key]

    def slot_rows(self, pool: str) -> list[tuple[str, int, list[int]]]:
        """Where a slot of ``pool`` (a :meth:`free_counts` name other than "virtual") keeps its rows:
        per tensor ``(name, first row, rows per slot in each layer)``, slot ``s`` owning rows
        ``first + s*rows .. first + (s+1)*rows - 1``. Without a K head map every slot owns ``H`` rows
        from row 0; with one, a sparse-K slot owns each layer's mapped heads in ``k_values``/``k_meta``
        and its other heads in the tail of ``k_dense`` (module docstring), so copies between two stores
        of one map move the same rows. An FP8 store's value tensors bring their ``*_scale`` rows along."""
        h = self.kv_heads
        if pool == "k_sparse":
            items = [(name, 0, list(self._k_sparse_rows)) for name in ("k_values", "k_meta")]
            dense_heads = [h - n for n in self._k_sparse_rows]
            if any(dense_heads):
                items.append(("k_dense", self.capacity.k_dense * h, dense_heads))
        else:
            names = {"k_dense": ("k_dense",), "v_dense": ("v_dense",), "v_sparse": ("v_values", "v_meta")}[pool]
            items = [(name, 0, [h] * self.num_layers) for name in names]
        if self.quantized:
            items += [(f"{name}_scale", first, rows) for name, first, rows in items if not name.endswith("_meta")]
        return items

    def layer_pools(self, layer: int) -> BlockPools:
        scales = ((self.k_dense_scale[layer], self.k_values_scale[layer], self.v_dense_scale[layer],
                   self.v_values_scale[layer]) if self.quantized else ())  # fmt: skip
        return BlockPools(
            self.k_dense[layer], self.k_values[layer], self.k_meta[layer],
            self.v_dense[layer], self.v_values[layer], self.v_meta[layer], *scales,
        )  # fmt: skip

    def write_layer(self, layer: int, vbs: list[int], k_blocks: torch.Tensor, v_blocks: torch.Tensor,
                    k_keep: torch.Tensor, v_keep: torch.Tensor) -> None:  # fmt: skip
        """Store one layer's ``[H, n, B, D]`` blocks of virtual blocks ``vbs`` in their slots."""
        h = self.kv_heads
        heads = torch.arange(h, device=self.device)

        def split(slots: dict[int, tuple[bool, int]], sparse: bool):
            picked = [(i, slots[vb][1]) for i, vb in enumerate(vbs) if slots[vb][0] == sparse]
            if not picked:
                return None, None
            cols = torch.tensor([i for i, _ in picked], device=self.device)
            rows = (torch.tensor([s for _, s in picked], device=self.device)[None, :] * h + heads[:, None]).reshape(-1)
            return cols, rows

        cols, rows = split(self._k_slot, False)
        if cols is not None:
            self._put("k_dense", layer, rows, k_blocks[:, cols].reshape(-1, *k_blocks.shape[2:]))
        picked = [(i, self._k_slot[vb][1]) for i, vb in enumerate(vbs) if self._k_slot[vb][0]]
        if picked:  # K-sparse blocks: the layer's mapped heads 2:4, the others dense (module docstring)
            cols = torch.tensor([i for i, _ in picked], device=self.device)
            slots = torch.tensor([s for _, s in picked], device=self.device)
            blocks, keep = k_blocks[:, cols], k_keep[:, cols]
            split_heads = self._k_head_split[layer]
            sparse_blocks, sparse_keep = (blocks, keep) if split_heads is None else (blocks[split_heads[0]],
                                                                                   keep[split_heads[0]])  # fmt: skip
            n_s = sparse_blocks.shape[0]
            if n_s:
                rows = (slots[None, :] * n_s + torch.arange(n_s, device=self.device)[:, None]).reshape(-1)
                values, meta = pack_2to4(sparse_blocks, sparse_keep)
                self._put("k_values", layer, rows, values.reshape(-1, *values.shape[2:]))
                self.k_meta[layer][rows] = meta.reshape(-1, *meta.shape[2:])
            if n_s < h:
                n_d = h - n_s
                ranks = torch.arange(n_d, device=self.device)
                rows = (self.capacity.k_dense * h + slots[None, :] * n_d + ranks[:, None]).reshape(-1)
                self._put("k_dense", layer, rows, blocks[split_heads[1]].reshape(-1, *k_blocks.shape[2:]))
        cols, rows = split(self._v_slot, False)
        if cols is not None:
            self._put("v_dense", layer, rows, v_blocks[:, cols].reshape(-1, *v_blocks.shape[2:]))
        cols, rows = split(self._v_slot, True)
        if cols is not None:
            v_t, keep_t = v_blocks[:, cols].transpose(-1, -2), v_keep[:, cols].transpose(-1, -2)
            values, meta = pack_2to4(v_t, keep_t)
            self._put("v_values", layer, rows, values.reshape(-1, *values.shape[2:]))
            self.v_meta[layer][rows] = meta.reshape(-1, *meta.shape[2:])

    def _put(self, name: str, layer: int, rows: torch.Tensor, x: torch.Tensor) -> None:
        """Write 16-bit rows ``x`` into value pool ``name`` (FP8: quantized, each row's scale beside)."""
        if self.quantized:
            x, scale = quantize_rows(x)
            getattr(self, f"{name}_scale")[layer][rows] = scale
        getattr(self, name)[layer][rows] = x


def prefix_blocks(buffer: torch.Tensor, slots: torch.Tensor, block_size: int, kv_heads: int) -> torch.Tensor:
    """``[H, n, B, D]`` blocks of one layer's ``[slots, H, D]`` buffer at page-aligned token ``slots``;
    SGLang's FP8 pages (``--kv-cache-dtype fp8_e4m3``, unit scales) are read as float32."""
    n = slots.numel() // block_size
    rows = buffer[slots]
    if rows.element_size() == 1:
        rows = rows.float()
    return rows.reshape(n, block_size, kv_heads, -1).permute(2, 0, 1, 3)


def block_losses(
    pruner: Pruner,
    k_buffers: list[torch.Tensor],
    v_buffers: list[torch.Tensor],
    slots: torch.Tensor,
    block_size: int,
    kv_heads: int,
    k_sparse_heads: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``[n]`` K and V ranking keys of the prefix's blocks: each block's pruning loss
    (``Pruner.operand_loss``) summed over all layers and KV heads (the compressor's first pass); with a
    K head map (bool ``[L, H]``) the K loss only over the heads that store K 2:4."""
    n = slots.numel() // block_size
    loss: dict[Operand, torch.Tensor] = {op: torch.zeros(n, dtype=torch.float32, device=slots.device) for op in "kv"}
    for layer, (k_buffer, v_buffer) in enumerate(zip(k_buffers, v_buffers)):
        for op, buffer in (("k", k_buffer), ("v", v_buffer)):
            blocks = prefix_blocks(buffer, slots, block_size, kv_heads)
            per_head = pruner.operand_loss(blocks, op, pruner.element_mask(blocks, op))
            if op == "k" and k_sparse_heads is not None:
                per_head = per_head[k_sparse_heads[layer].to(per_head.device)]
            loss[op] += per_head.sum(0)
    return loss["k"], loss["v"]


LossReducer = Callable[[torch.Tensor], torch.Tensor]
"""Sums a float32 ``[2, n]`` tensor of block losses (K, V) over the tensor-parallel ranks, with the
same bits on every rank. Each rank
holds a share of the KV heads; ranking by the sum over every rank's heads gives all ranks the same
sparse blocks (the same choice as one GPU holding all heads), so their stores' pools fill alike and
their radix trees stay in step."""


def needs_ranking(groups: list[tuple[torch.Tensor, float, float]]) -> bool:
    """Whether any group's block choice depends on the losses: S = 0 and S = 1 do not."""
    return any(0.0 < s < 1.0 for _, sk, sv in groups for s in (sk, sv))


def compress_prefix(
    store: CompressedStore,
    pruner: Pruner,
    k_buffers: list[torch.Tensor],
    v_buffers: list[torch.Tensor],
    slots: torch.Tensor,
    groups: list[tuple[torch.Tensor, float, float]],
    *,
    reduce_losses: LossReducer | None = None,
) -> list[int]:
    """Prune and compress ``n`` whole blocks of dense KV (token ``slots``, ``n·B`` of them, page
    aligned) from SGLang's per-layer buffers into the store. Returns their virtual block ids.

    ``groups`` partitions the blocks into ``(mask [n] bool, S_K, S_V)`` sets (prompt blocks and
    generated blocks use different sparsities). Within each set the blocks whose pruning loss,
    summed over all layers and KV heads, is lowest become sparse. Two passes over the layers keep the
    temporary memory at one layer's blocks.
    ``reduce_losses`` (tensor parallelism) sums the losses over the ranks before a fractional S ranks them.
    """
    loss_k, loss_v = block_losses(pruner, k_buffers, v_buffers, slots, store.block_size, store.kv_heads,
                                  store.k_sparse_heads)  # fmt: skip
    if reduce_losses is not None and needs_ranking(groups):
        loss_k, loss_v = reduce_losses(torch.stack([loss_k, loss_v])).unbind(0)
    sparse_k = torch.zeros(loss_k.shape, dtype=torch.bool, device=slots.device)
    sparse_v = torch.zeros_like(sparse_k)
    for mask, sk, sv in groups:
        mask = mask.to(slots.device)
        sparse_k |= rank_sparse(loss_k, mask, sk)
        sparse_v |= rank_sparse(loss_v, mask, sv)
    vbs = store.allocate(sparse_k.tolist(), sparse_v.tolist())  # host sync: one small mask per prefix
    for layer, (k_buffer, v_buffer) in enumerate(zip(k_buffers, v_buffers)):
        k, v = (prefix_blocks(b, slots, store.block_size, store.kv_heads) for b in (k_buffer, v_buffer))
        store.write_layer(layer, vbs, k, v, pruner.element_mask(k, "k"), pruner.element_mask(v, "v"))
    return vbs
