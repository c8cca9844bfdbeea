"""PageAllocator and PrefixCache on their own."""

from __future__ import annotations

import hashlib
import struct

import pytest

from voice_server.scheduling.pages import PageAllocator, PrefixCache, page_key


def test_allocator_counts_and_refuses_double_free() -> None:
    alloc = PageAllocator(num_pages=3, page_size=4)
    pages = [alloc.allocate() for _ in range(3)]
    assert sorted(pages) == [0, 1, 2]
    assert (alloc.num_free_pages, alloc.num_used_pages) == (0, 3)
    with pytest.raises(RuntimeError, match="no free"):
        alloc.allocate()
    alloc.free(pages[1])
    assert (alloc.num_free_pages, alloc.num_used_pages) == (1, 2)
    with pytest.raises(RuntimeError, match="double free"):
        alloc.free(pages[1])
    with pytest.raises(ValueError):
        alloc.free(7)


def test_page_key_is_a_stable_chain() -> None:
    root = page_key(b"", [1, 2])
    assert root == hashlib.blake2b(struct.pack("<2q", 1, 2), digest_size=16).digest()
    assert page_key(root, [3, 4]) != page_key(b"", [3, 4])  # the parent is part of the key


def fill(cache: PrefixCache, tokens: list[int]) -> list[int]:
    """Allocate and commit full pages for `tokens` like a request would; returns its page table."""
    size = cache.page_size
    pages = cache.allocate(-(-len(tokens) // size))
    assert pages is not None
    key = b""
    for i in range(len(tokens) // size):
        key = cache.commit(key, tokens[i * size:(i + 1) * size], pages[i])
    return pages


def test_match_finds_the_longest_chain_but_leaves_a_token_to_compute() -> None:
    cache = PrefixCache(PageAllocator(num_pages=8, page_size=2))
    pages = fill(cache, [1, 2, 3, 4, 5, 6, 7])  # 3 full pages, 1 partial
    assert cache.num_cached_pages == 3
    assert cache.match([1, 2, 3, 4, 5, 6, 7, 8]) == pages[:3]
    assert cache.match([1, 2, 3, 4, 5, 6]) == pages[:2]  # a whole-prompt hit would leave nothing to sample
    assert cache.match([1, 2, 3, 9, 5, 6, 7]) == pages[:1]
    assert cache.match([9, 2, 3, 4]) == []
    assert cache.match([1]) == []


def test_release_keeps_full_pages_cached_and_frees_the_rest() -> None:
    alloc = PageAllocator(num_pages=4, page_size=2)
    cache = PrefixCache(alloc)
    pages = fill(cache, [1, 2, 3])
    cache.acquire(pages[:1])  # a second request hits the first page
    assert cache.refcount(pages[0]) == 2
    cache.release(pages)
    assert alloc.num_free_pages == 3  # the partial page went back
    assert cache.refcount(pages[0]) == 1 and cache.evictable_pages() == []
    cache.release(pages[:1])
    assert cache.evictable_pages() == [pages[0]]
    assert cache.num_available_pages == 4
    with pytest.raises(RuntimeError, match="released more often"):
        cache.release(pages[:1])


def test_lru_eviction_takes_the_least_recently_released_and_deepest_first() -> None:
    alloc = PageAllocator(num_pages=4, page_size=1)
    cache = PrefixCache(alloc)
    a = fill(cache, [1, 2])
    b = fill(cache, [7, 8])
    cache.release(a)
    cache.release(b)
    assert cache.evictable_pages() == [a[1], a[0], b[1], b[0]]
    hit = cache.match([7, 8, 9])
    cache.acquire(hit)  # b's chain is used again: a is now the older one
    assert hit == b
    cache.release(hit)
    fresh = cache.allocate(1)
    assert fresh == [a[1]] and not cache.is_cached(a[1])
    assert cache.match([1, 2, 3]) == [a[0]]
    assert cache.allocate(4) is None  # refused whole: nothing taken
    assert cache.num_available_pages == 3


def test_a_duplicate_full_page_stays_private() -> None:
    alloc = PageAllocator(num_pages=4, page_size=2)
    cache = PrefixCache(alloc)
    first = fill(cache, [1, 2])
    second = fill(cache, [1, 2])  # computed concurrently, before the first was committed
    assert cache.is_cached(first[0]) and not cache.is_cached(second[0])
    cache.release(second)
    assert alloc.is_free(second[0])


def test_disabled_cache_never_registers() -> None:
    alloc = PageAllocator(num_pages=2, page_size=2)
    cache = PrefixCache(alloc, is_enabled=False)
    pages = fill(cache, [1, 2, 3, 4])
    assert cache.num_cached_pages == 0 and cache.match([1, 2, 3, 4, 5]) == []
    cache.release(pages)
    assert alloc.num_free_pages == 2
