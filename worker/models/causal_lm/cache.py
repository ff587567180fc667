"""The KV cache: one pool of fixed-size pages shared by all running sequences, each with its own list.

It must never decide who gets pages (the SequenceScheduler does) and never pad sequences to each other in
memory: a sequence holds ceil(its cached tokens / page_tokens) pages, whatever the others hold. torch is
imported only when a pool is made, so the page arithmetic can be imported anywhere.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class PagePool:
    """Keys and values, each [layers, heads, slots, head_dim] (slot = page * page_tokens + offset), of one
    shared pool of pages.

    Head-major, as transformers' own caches are: a sequence whose pages are consecutive has, for each head,
    its keys in one contiguous block of memory, which decode attention reads as a plain [heads, tokens, dim]
    view. Token-major pages ([pages, page_tokens, heads, dim]) made it read 256-byte pieces 2 KB apart: a
    decode step's attention took 1.6x as long (bench/README.md, bench.causal_lm).
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

        shape = (layers, heads, pages * page_tokens, head_dim)
        # Zeros, not empty: no read ever reaches past a sequence's own tokens today, but a padded or masked
        # read would still meet them (as 0 * value), and 0 * NaN from uninitialised memory poisons a row.
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.page_tokens = page_tokens
        self.pages = pages
        self._free = bytearray(b"\x01") * pages  # 1: the page is free
        self._free_count = pages

    @property
    def free_pages(self) -> int:
        return self._free_count

    def allocate(self, count: int, after: int | None = None) -> list[int]:
        """``count`` free pages: those right after page ``after`` (a sequence's last) when free, else a run
        in the middle of the widest free stretch, so that the sequence before it can grow too.

        A sequence whose pages are consecutive is one slice of the pool, which attention reads in place;
        any other is gathered first (a copy: on the CPU that copy cost twice the attention itself).
        """
        if count > self._free_count:
            raise RuntimeError(f"KV cache: {count} pages asked for, {self._free_count} free")
        free = self._free
        if after is not None and free[after + 1 : after + 1 + count] == b"\x01" * count:
            start = after + 1
        else:
            start, width = max(self._free_runs(), key=lambda run: run[1])
            if width < count:  # fragmented: the lowest free pages, wherever they are
                taken = [page for page, is_free in enumerate(free) if is_free][:count]
                for page in taken:
                    free[page] = 0
                self._free_count -= count
                return taken
            if start > 0:  # a sequence ends just before this stretch: leave it half of the room
                start += (width - count) // 2
        free[start : start + count] = bytes(count)
        self._free_count -= count
        return list(range(start, start + count))

    def release(self, pages: list[int]) -> None:
        for page in pages:
            self._free[page] = 1
        self._free_count += len(pages)

    def _free_runs(self) -> Iterator[tuple[int, int]]:
        """(first page, pages) of every maximal stretch of free pages."""
        free, at = self._free, self._free.find(1)
        while at >= 0:
            end = free.find(0, at)
            end = len(free) if end < 0 else end
            yield at, end - at
            at = free.find(1, end)

    def write_slots(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store the keys and values [heads, n, dim] of n tokens at flat slots [n] (page * size + offset)."""
        self.keys[layer].index_copy_(1, slots, keys)
        self.values[layer].index_copy_(1, slots, values)

    def context(
        self, layer: int, first: int, length: int, pages: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [1, heads, length, dim] of one sequence, as attention takes them: a view of the
        ``length`` slots from slot ``first`` (consecutive pages), or its ``pages`` gathered (any others)."""
        if pages is None:
            end = first + length
            return self.keys[layer, None, :, first:end], self.values[layer, None, :, first:end]
        return self._gather(self.keys[layer], pages, length), self._gather(self.values[layer], pages, length)

    def _gather(self, store: torch.Tensor, pages: torch.Tensor, length: int) -> torch.Tensor:
        heads, _slots, dim = store.shape
        paged = store.view(heads, self.pages, self.page_tokens * dim)  # a page a row, per head
        return paged.index_select(1, pages).view(1, heads, -1, dim)[:, :, :length]
