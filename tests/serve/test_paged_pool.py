"""The paged pool is the per-row pool re-addressed: with shuffled, non-contiguous page ids, every
step's logits equal the contiguous pool's (``model.setup_caches`` + the cached step) bit for bit
when the step shapes match, for float and FP8 caches (the FP8 pages at FlashMLA's padded page
stride, as an engine allocating its pools FlashMLA's way hands them over)."""
import random

import pytest
import torch

from dsv4_ops import DSV4Config, DeepseekV4ForCausalLM
from dsv4_ops.sampling import SamplingParams
from dsv4_ops.serve.pool import PagedKVPool
from dsv4_ops.serve.prefix_cache import OutOfPages, PageAllocator
from dsv4_ops.serve.step import pool_step
from paged_cases import fp8_pages

# MAX_LEN 512: the per-row FP8 pools are whole 64-entry pages (as many entries as the paged view holds)
PAGE, CHUNK, MAX_LEN = 32, 16, 512
CONFIGS = {"auto": DSV4Config.tiny(), "fp8": DSV4Config.tiny(head_dim=144, num_hidden_layers=3, hca_ratio=8)}


def _greedy(B):
    z = torch.zeros(B)
    return SamplingParams(z, z.long(), torch.ones(B), z.long())


def _paged_pool(model, kv_cache_dtype, rows, rng):
    pages_per_row = MAX_LEN // PAGE
    pool = PagedKVPool(model, rows + 1, MAX_LEN, rows * pages_per_row + 1, PAGE, kv_cache_dtype)
    if kv_cache_dtype == "fp8":  # FlashMLA's allocation: every page's bytes padded to a multiple of 576
        for lp in pool.layers:
            for name in ("pool", "idx_pool"):
                if getattr(lp, name) is not None:
                    setattr(lp, name, fp8_pages(*getattr(lp, name).shape))
    ids = list(range(1, pool.num_pages))
    rng.shuffle(ids)  # every row's pages scattered over the pool, in no order
    pool.block_table[:rows] = torch.tensor(ids, dtype=torch.int32).view(rows, pages_per_row)
    return pool


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_shuffled_pages_give_the_contiguous_pools_logits_bit_for_bit(kv_cache_dtype):
    rng = random.Random(7)
    model = DeepseekV4ForCausalLM(CONFIGS[kv_cache_dtype]).eval()
    B = 2
    model.setup_caches(B, MAX_LEN, kv_cache_dtype=kv_cache_dtype)
    pool = _paged_pool(model, kv_cache_dtype, B, rng)
    lens = [70, 45]  # across 4-, 16- and page boundaries, longer than the window
    prompt = torch.randint(0, 256, (B, 80))
    lengths = torch.zeros(B, dtype=torch.int32)
    rows = torch.arange(B)
    for start in range(0, max(lens), CHUNK):  # prefill: concat mode, rows through `rows`
        n_new = torch.tensor([max(0, min(CHUNK, n - start)) for n in lens], dtype=torch.int32)
        ids = prompt[:, start:start + CHUNK]
        want = model(ids, lengths.clone(), n_new, last_only=True)
        _, got = pool_step(model, pool, ids, rows, n_new, _greedy(B), False)
        assert torch.equal(got, want)
        lengths += n_new
    assert pool.slot_len[:B].tolist() == lengths.tolist()
    for _ in range(40):  # decode: ring mode over slots 0..B-1 (views), crossing a page boundary
        ids = torch.randint(0, 256, (B, 1))
        n_new = torch.ones(B, dtype=torch.int32)
        want = model(ids, lengths.clone(), n_new, last_only=True)
        _, got = pool_step(model, pool, ids, None, n_new, _greedy(B), False)
        assert torch.equal(got, want)
        lengths += n_new


def test_padding_rows_write_nothing_a_real_row_reads():
    """Padding rows (n_new = 0, the dummy slot, page 0) leave every real slot's state alone."""
    model = DeepseekV4ForCausalLM(DSV4Config.tiny()).eval()
    pool = _paged_pool(model, "auto", 2, random.Random(3))
    before = [t.clone() for t in pool.buffers()]
    ids = torch.randint(0, 256, (4, CHUNK))
    rows = torch.full((4,), 2)  # every row is padding: the dummy slot
    pool_step(model, pool, ids, rows, torch.zeros(4, dtype=torch.int32), _greedy(4), False)
    pool_step(model, pool, ids[:2, :1], None, torch.zeros(2, dtype=torch.int32), _greedy(2), False)
    after = pool.buffers()
    for i, (a, b) in enumerate(zip(before, after)):
        if a.dim() >= 1 and a.shape[0] == pool.num_pages:  # paged: all but the dummy page unchanged
            assert torch.equal(a[1:], b[1:]), i
        elif a.dim() >= 1 and a.shape[0] == pool.slots:  # per slot: all but the dummy slot unchanged
            assert torch.equal(a[:2], b[:2]), i


def test_page_allocator_hands_out_each_page_once_and_never_the_dummy():
    alloc = PageAllocator(6)
    pages = [alloc.take() for _ in range(5)]
    assert sorted(pages) == [1, 2, 3, 4, 5]
    with pytest.raises(OutOfPages):
        alloc.take()
    alloc.ref(pages[0])
    assert not alloc.unref(pages[0]) and alloc.unref(pages[0])
    alloc.give_back(pages[0])
    assert alloc.take() == pages[0]


def test_page_bytes_sizes_the_pool_from_a_memory_budget():
    model = DeepseekV4ForCausalLM(CONFIGS["fp8"])
    for dtype in ("auto", "fp8"):
        pool = PagedKVPool(model, 3, 128, 5, PAGE, dtype)
        assert PagedKVPool.page_bytes(model, PAGE, dtype) == pool.nbytes()["page"]
    assert PagedKVPool.page_bytes(model, PAGE, "fp8") < PagedKVPool.page_bytes(model, PAGE, "auto")
