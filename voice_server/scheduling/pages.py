"""KV page bookkeeping for the AR scheduler: a fixed page pool and a prefix cache over full pages.

The scheduler only decides which page ids a request's keys/values go to; the runner owns the
memory. A page is in exactly one of three states:

- free: on the allocator's free list;
- held: in the page table of at least one request (a private page has one holder; a cached full
  page may have many, read-only);
- evictable: a cached full page no request holds (refcount 0), kept for a future prefix hit and
  reclaimed in LRU order when the free list runs dry.

So `num_free + num_held + num_evictable == num_pages` at all times.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence

PageKey = bytes
"""Hash chain of a full page: digest(parent key, the page's token ids)."""

_ROOT_KEY: PageKey = b""


def page_key(parent: PageKey, token_ids: Sequence[int]) -> PageKey:
    # NOTE: a stable hash (not Python's salted `hash`) so keys mean the same in every process, and
    # 128 bits so a collision (which would hand a request another prompt's keys/values) is moot.
    data = struct.pack(f"<{len(token_ids)}q", *token_ids)
    return hashlib.blake2b(parent + data, digest_size=16).digest()


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages and page_size must be >= 1, got {num_pages} and {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        # NOTE: a stack, so a just-freed (likely still hot) page is reused first.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._is_free = [True] * num_pages

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        """Pages not on the free list (held by requests or kept by the prefix cache)."""
        return self.num_pages - len(self._free)

    def is_free(self, page_id: int) -> bool:
        return self._is_free[page_id]

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("no free KV page")
        page_id = self._free.pop()
        self._is_free[page_id] = False
        return page_id

    def free(self, page_id: int) -> None:
        if not 0 <= page_id < self.num_pages:
            raise ValueError(f"page {page_id} is not in [0, {self.num_pages})")
        if self._is_free[page_id]:
            raise RuntimeError(f"double free of KV page {page_id}")
        self._is_free[page_id] = True
        self._free.append(page_id)


class PrefixCache:
    """Full pages by hash chain, with refcounts and LRU eviction; hands out pages for the pool.

    With `is_enabled=False` nothing is ever registered: `match` finds nothing and every released
    page goes straight back to the free list.
    """

    def __init__(self, allocator: PageAllocator, is_enabled: bool = True) -> None:
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.is_enabled = is_enabled
        self._page_by_key: dict[PageKey, int] = {}
        self._key_by_page: dict[int, PageKey] = {}
        self._refcount: dict[int, int] = {}
        """Registered pages only: how many requests hold each."""
        self._evictable: OrderedDict[int, None] = OrderedDict()
        """Registered pages with refcount 0, least recently released first."""
        self.num_query_tokens = 0
        self.num_hit_tokens = 0
        self.num_queries = 0

    # -- counters ----------------------------------------------------------------------------------

    @property
    def num_cached_pages(self) -> int:
        return len(self._key_by_page)

    @property
    def num_evictable_pages(self) -> int:
        return len(self._evictable)

    @property
    def num_available_pages(self) -> int:
        """Pages `allocate` can hand out: free ones plus evictable cached ones."""
        return self.allocator.num_free_pages + len(self._evictable)

    def is_cached(self, page_id: int) -> bool:
        return page_id in self._key_by_page

    def refcount(self, page_id: int) -> int:
        return self._refcount.get(page_id, 0)

    def evictable_pages(self) -> list[int]:
        return list(self._evictable)

    # -- lookup ------------------------------------------------------------------------------------

    def match(self, token_ids: Sequence[int]) -> list[int]:
        """Pages of the longest cached chain of full pages that prefixes `token_ids` (no refs taken).

        Capped at `(len - 1) // page_size` pages: at least one token is left to compute, so the
        request has logits to sample from.
        """
        if not self.is_enabled:
            return []
        num_max = (len(token_ids) - 1) // self.page_size
        pages: list[int] = []
        key = _ROOT_KEY
        for i in range(num_max):
            key = page_key(key, token_ids[i * self.page_size:(i + 1) * self.page_size])
            page_id = self._page_by_key.get(key)
            if page_id is None:
                break
            pages.append(page_id)
        return pages

    def record_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.num_queries += 1
        self.num_query_tokens += num_query_tokens
        self.num_hit_tokens += num_hit_tokens

    def key_of(self, page_id: int) -> PageKey:
        return self._key_by_page[page_id]

    # -- refs --------------------------------------------------------------------------------------

    def acquire(self, page_ids: Iterable[int]) -> None:
        """Take a read-only reference on cached pages (a prefix hit); they stop being evictable."""
        for page_id in page_ids:
            count = self._refcount[page_id]
            if count == 0:
                del self._evictable[page_id]
            self._refcount[page_id] = count + 1

    def commit(self, parent: PageKey, token_ids: Sequence[int], page_id: int) -> PageKey:
        """A request filled `page_id` with `token_ids`: register it (held once, by that request)
        unless the same chain is cached already (then the page stays private). Returns its key."""
        key = page_key(parent, token_ids)
        if self.is_enabled and key not in self._page_by_key and page_id not in self._key_by_page:
            self._page_by_key[key] = page_id
            self._key_by_page[page_id] = key
            self._refcount[page_id] = 1
        return key

    def release(self, page_ids: Sequence[int]) -> None:
        """A request let go of its page table: cached pages lose a ref, private pages are freed."""
        # NOTE: last page first, so among pages released together the deepest is evicted first:
        # evicting a parent first would strand its (unreachable) children in the cache.
        for page_id in reversed(page_ids):
            if page_id in self._key_by_page:
                count = self._refcount[page_id] - 1
                if count < 0:
                    raise RuntimeError(f"KV page {page_id} released more often than acquired")
                self._refcount[page_id] = count
                if count == 0:
                    self._evictable[page_id] = None
            else:
                self.allocator.free(page_id)

    def allocate(self, num_pages: int) -> list[int] | None:
        """`num_pages` fresh pages, evicting LRU cached pages as needed; None (and nothing taken)
        when there are not that many."""
        if num_pages > self.num_available_pages:
            return None
        pages = []
        for _ in range(num_pages):
            if self.allocator.num_free_pages == 0:
                self._evict_one()
            pages.append(self.allocator.allocate())
        return pages

    def _evict_one(self) -> None:
        page_id, _ = self._evictable.popitem(last=False)
        del self._page_by_key[self._key_by_page.pop(page_id)]
        del self._refcount[page_id]
        self.allocator.free(page_id)
