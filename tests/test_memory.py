"""lightgen's caching CPU allocator: generate calls take no memory from the system in steady state."""

import pytest
import torch
from models import build, padded_batch

import lightgen
from lightgen import _build, memory

pytestmark = pytest.mark.skipif(not _build.load().compiled, reason="the CPU cache is part of the compiled library")

FIXED_LENGTH = dict(max_new_tokens=12, min_new_tokens=12)
DECODINGS = [FIXED_LENGTH, dict(FIXED_LENGTH, num_beams=3), dict(FIXED_LENGTH, do_sample=True, top_k=5),
             dict(max_new_tokens=12, decoding="iad")]


def _accelerated(family: str):
    return lightgen.accelerate_model(build(family))


@pytest.mark.parametrize("family", ["bart", "gpt2"])
@pytest.mark.parametrize("decoding", DECODINGS, ids=["greedy", "beam", "sample", "iad"])
def test_steady_state_generate_takes_no_memory_from_the_system(family, decoding):
    model = _accelerated(family)
    ids, mask = padded_batch(family, 3, 7)
    kwargs = dict(input_ids=ids, attention_mask=mask, pad_token_id=0, **decoding)
    # Warm-up: the first call takes the blocks; from the second, a call's result is alive while the next runs.
    for _ in range(2):
        torch.manual_seed(0)
        result = model.generate(**kwargs)
    first = result.tolist()
    before = memory.cache_stats()
    for _ in range(3):
        torch.manual_seed(0)
        result = model.generate(**kwargs)
    after = memory.cache_stats()
    assert after.system_allocations == before.system_allocations
    assert after.reused - before.reused >= 3 * 20  # the steps' tensors did come from the cache
    assert result.tolist() == first


def test_the_cache_serves_only_inside_generate():
    model = _accelerated("bart")
    ids, mask = padded_batch("bart", 2, 6)
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4)
    before = memory.cache_stats()
    outside = [torch.empty(1000 + i) for i in range(10)]
    del outside
    assert memory.cache_stats() == before


def test_a_failed_generate_gives_torch_its_allocator_back():
    model = _accelerated("bart")
    with pytest.raises(ValueError):
        model.generate(input_ids=torch.tensor([[3, 4, 5]]), max_new_tokens=4, num_beams=2, num_return_sequences=3)
    before = memory.cache_stats()
    torch.empty(12345)
    assert memory.cache_stats() == before


def test_tensors_outlive_the_block_and_return_to_the_cache():
    with memory.cached_cpu_memory():
        kept = torch.arange(50_000, dtype=torch.float32)
        with memory.cached_cpu_memory():  # nested: still the cache until the outer block ends
            inner = torch.ones(777)
    before = memory.cache_stats()
    assert torch.equal(kept, torch.arange(50_000, dtype=torch.float32)) and inner.sum() == 777
    del kept, inner
    after = memory.cache_stats()
    assert after.cached_bytes >= before.cached_bytes + 50_000 * 4 + 777 * 4
    assert after.live_bytes < before.live_bytes


def test_empty_cpu_cache_returns_the_free_blocks():
    with memory.cached_cpu_memory():
        torch.empty(100_000)
    assert memory.cache_stats().cached_bytes > 0
    freed = memory.empty_cpu_cache()
    assert freed >= 400_000 and memory.cache_stats().cached_bytes == 0


def test_limit_zero_turns_the_cache_off(monkeypatch):
    monkeypatch.setenv("LIGHTGEN_CPU_CACHE_MB", "0")
    before = memory.cache_stats()
    with memory.cached_cpu_memory():
        torch.empty(5000)
    assert memory.cache_stats() == before


def test_blocks_over_the_limit_go_back_to_the_system(monkeypatch):
    memory.empty_cpu_cache()
    monkeypatch.setenv("LIGHTGEN_CPU_CACHE_MB", "1")
    with memory.cached_cpu_memory():
        big = [torch.empty(200_000) for _ in range(3)]  # 2.4 MB: more than the 1 MiB kept
        del big
    assert 0 < memory.cache_stats().cached_bytes <= 1 << 20
    monkeypatch.delenv("LIGHTGEN_CPU_CACHE_MB")
    with memory.cached_cpu_memory():  # the default limit applies again
        pass


@pytest.mark.parametrize("value", ["-1", "lots"])
def test_a_bad_limit_is_a_clear_error(monkeypatch, value):
    monkeypatch.setenv("LIGHTGEN_CPU_CACHE_MB", value)
    with pytest.raises(ValueError, match="LIGHTGEN_CPU_CACHE_MB"):
        with memory.cached_cpu_memory():
            pass


def test_memory_profiling_sees_the_cache():
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with memory.cached_cpu_memory():
            block = torch.ones(50_000)
            del block
    # The allocation counts toward the op that made it, the free (outside any op) is an event of its own;
    # both in the block's size class.
    usage = [event.cpu_memory_usage for event in prof.events()]
    assert max(usage) >= 200_000 and min(usage) == -max(usage)


def test_a_forked_child_can_use_the_cache():
    import multiprocessing

    def child(queue):
        with memory.cached_cpu_memory():
            queue.put(float(torch.arange(1000.0).sum()))

    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    with memory.cached_cpu_memory():
        process = context.Process(target=child, args=(queue,))
        process.start()
    try:
        assert queue.get(timeout=60) == 499500.0
    finally:
        process.join(timeout=60)
        if process.is_alive():
            process.kill()
    assert process.exitcode == 0
