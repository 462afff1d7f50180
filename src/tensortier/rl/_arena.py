"""Arena: the RAM copies of items as slices of a few large chunks.

Why: an item kept as its own ``bytes`` object costs an allocation of fresh heap (page faults on
every 4 KiB) plus a join copy per add. Here an item is copied once, from its encoded parts
straight into a slice of a chunk, and the slice of an item that leaves RAM is reused by the next
item of the same rounded size, so a buffer running at capacity writes into memory it has already
touched.

Layout. Slices are rounded up to 64 bytes; an address is ``chunk_index * chunk_size + offset``.
A freed slice goes to the free list of its rounded size (LIFO: the warmest memory is reused
first); new space comes from the end of the newest chunk. A new chunk is made only while all
chunks together stay within ``limit`` (the store's RAM budget): :meth:`alloc` returns -1 past it
(or for a slice larger than a chunk) and the store keeps that item as a ``bytes`` object instead.
With items of one size (fixed-shape transitions) nothing is wasted; with mixed sizes, free slices
of sizes no longer added stay in their lists (bounded by ``limit``).

Views from :meth:`view` alias memory that a later :meth:`alloc` may hand out again once the slice
is released: callers copy what they hand out of the owner's lock, or :meth:`pin` the arena (a
save), which defers reuse until :meth:`unpin`. Not thread-safe (the owner holds a lock).
"""

from __future__ import annotations

import numpy as np

_ROUND = 64


class Arena:
    def __init__(self, chunk_size: int, limit: int):
        self.chunk_size = chunk_size
        self.limit = limit
        self.chunks: list[memoryview] = []
        self.free: dict[int, list[int]] = {}
        self.top = 0  # next free address in the newest chunk
        self.end = 0  # end of the newest chunk
        self.pinned = 0
        self._deferred: list[tuple[int, int]] = []

    @staticmethod
    def for_budget(budget: int) -> Arena:
        """Chunks of about 1/16 of ``budget`` (a power of two from 4 KiB to 16 MiB)."""
        size = 1 << max(12, min(24, (max(budget, 1) // 16).bit_length() - 1))
        return Arena(size, budget)

    @property
    def footprint(self) -> int:
        return len(self.chunks) * self.chunk_size

    def alloc(self, size: int) -> int:
        """Address of a slice of at least ``size`` bytes, or -1 if the arena cannot hold it."""
        r = (size + _ROUND - 1) & -_ROUND
        fl = self.free.get(r)
        if fl:
            return fl.pop()
        a = self.top
        if a + r > self.end:
            if r > self.chunk_size or self.footprint + self.chunk_size > self.limit:
                return -1
            self.chunks.append(memoryview(np.empty(self.chunk_size, np.uint8)))  # (THP-advised)
            a = (len(self.chunks) - 1) * self.chunk_size
            self.end = a + self.chunk_size
        self.top = a + r
        return a

    def view(self, addr: int, size: int) -> memoryview:
        c, o = divmod(addr, self.chunk_size)
        return self.chunks[c][o : o + size]

    def put(self, parts: list, size: int) -> tuple[int, memoryview | None]:
        """Copy ``parts`` (byte buffers, ``size`` bytes together) into a new slice: (address,
        view), or (-1, None) if the arena cannot hold it."""
        fl = self.free.get((size + _ROUND - 1) & -_ROUND)
        addr = fl.pop() if fl else self.alloc(size)
        if addr < 0:
            return -1, None
        c, o = divmod(addr, self.chunk_size)
        mv = self.chunks[c]
        start = o
        for p in parts:
            e = o + len(p)
            mv[o:e] = p
            o = e
        return addr, mv[start:o]

    def release(self, addr: int, size: int) -> None:
        r = (size + _ROUND - 1) & -_ROUND
        if self.pinned:
            self._deferred.append((addr, r))
            return
        fl = self.free.get(r)
        if fl is None:
            self.free[r] = [addr]
        else:
            fl.append(addr)

    @staticmethod
    def cost(size: int) -> int:
        """Bytes a slice of ``size`` takes (counted against the RAM budget)."""
        return (size + _ROUND - 1) & -_ROUND

    def pin(self) -> None:
        """Defer reuse of released slices (views handed out stay valid) until :meth:`unpin`."""
        self.pinned += 1

    def unpin(self) -> None:
        self.pinned -= 1
        if not self.pinned:
            deferred, self._deferred = self._deferred, []
            for addr, r in deferred:
                self.release(addr, r)

    def clear(self) -> None:
        self.chunks = []
        self.free = {}
        self.top = self.end = 0
        self._deferred = []
