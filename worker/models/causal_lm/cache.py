"""The KV cache: one pool of fixed-size pages shared by all running sequences, each with its own list.

It must never decide who gets pages (the SequenceScheduler does) and never pad sequences to each other in
memory: a sequence holds ceil(its cached tokens / page_tokens) pages, whatever the others hold. torch is
imported only when a pool is made, so the page arithmetic can be imported anywhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class PagePool:
    """Keys and values, each [layers, pages, page_tokens, heads, head_dim], of one shared pool of pages.

    Token-major within a page, so a sequence's gathered pages are already its keys in order, [tokens,
    heads, dim]: attention reads them through a transposed view, with no second copy (on the CPU that copy
    cost as much as the gather itself).
    """

    def __init__(
        self,
        *,
        layers: int,
        heads: int,
        head_dim: int,
        pages: int,
        page_tokens: int,
        dtype: torch.dtype,
        device: str,
    ) -> None:
        import torch

        shape = (layers, pages, page_tokens, heads, head_dim)
        # Zeros, not empty: masked-out cache positions still meet the attention weights (as 0 * value),
        # and 0 * NaN from uninitialised memory would poison the whole row.
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.page_tokens = page_tokens
        self.pages = pages
        # A stack: the most recently freed page is reused first, while it may still be in a CPU cache.
        self._free = list(range(pages - 1, -1, -1))

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise RuntimeError(f"KV cache: {count} pages asked for, {len(self._free)} free")
        taken = self._free[len(self._free) - count :]
        del self._free[len(self._free) - count :]
        return taken

    def release(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))

    def write(
        self,
        layer: int,
        page_ids: torch.Tensor,
        offsets: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
    ) -> None:
        """Store the keys and values [n, heads, dim] of n tokens at (page, offset) pairs [n], [n]."""
        slots = page_ids * self.page_tokens + offsets
        self.keys[layer].flatten(0, 1).index_copy_(0, slots, keys)
        self.values[layer].flatten(0, 1).index_copy_(0, slots, values)

    def write_slots(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store the keys and values [n, heads, dim] of n tokens at flat slots (page * size + offset)."""
        self.keys[layer].flatten(0, 1).index_copy_(0, slots, keys)
        self.values[layer].flatten(0, 1).index_copy_(0, slots, values)

    def gather(self, layer: int, table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [batch, heads, length, dim] of the sequences whose pages are the rows of ``table``.

        Rows shorter than ``length`` hold whatever their padding pages hold; the caller masks them out.
        """
        return self._rows(self.keys[layer], table, length), self._rows(self.values[layer], table, length)

    def _rows(self, store: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
        batch, pages = table.shape
        # index_select, not store[table]: on the CPU advanced indexing was 4x slower for the same copy.
        gathered = store.index_select(0, table.flatten())  # [batch * pages, tokens, heads, dim]
        tokens = gathered.view(batch, pages * self.page_tokens, *store.shape[2:])
        return tokens[:, :length].transpose(1, 2)
