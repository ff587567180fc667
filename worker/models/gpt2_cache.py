"""The GPT-2 KV cache: one pool of fixed-size pages shared by all running sequences, each with its own list.

It must never decide who gets pages (the SequenceScheduler does) and never pad sequences to each other in
memory: a sequence holds ceil(its cached tokens / page_tokens) pages, whatever the others hold. torch is
imported only when a pool is made, so the page arithmetic can be imported anywhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class PagePool:
    """Keys and values, each [layers, pages, heads, page_tokens, head_dim], of one shared pool of pages."""

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

        shape = (layers, pages, heads, page_tokens, head_dim)
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
        self.keys[layer][page_ids, :, offsets] = keys
        self.values[layer][page_ids, :, offsets] = values

    def gather(self, layer: int, table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [batch, heads, length, dim] of the sequences whose pages are the rows of ``table``.

        Rows shorter than ``length`` hold whatever their padding pages hold; the caller masks them out.
        """
        return self._rows(self.keys[layer], table, length), self._rows(self.values[layer], table, length)

    def _rows(self, store: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
        batch, pages = table.shape
        # [batch, pages, heads, tokens, dim] -> [batch, heads, pages * tokens, dim]
        gathered = store[table].transpose(1, 2)
        heads, dim = gathered.shape[1], gathered.shape[-1]
        return gathered.reshape(batch, heads, pages * self.page_tokens, dim)[:, :, :length]


def pages_for(tokens: int, page_tokens: int) -> int:
    """Pages that hold ``tokens`` tokens (ceiling division)."""
    return -(-tokens // page_tokens)
