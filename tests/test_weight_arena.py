"""The packed weights' arena on 2 MB pages: exact copies, one mapping for many tensors, freed with its last tensor."""

import copy
import gc
import re
from pathlib import Path

import pytest
import torch
from models import build, padded_batch

import lightgen
from lightgen.memory import ARENA_CHUNK, HUGE_PAGE, WEIGHT_ALIGNMENT, WeightArena

pytestmark = pytest.mark.skipif(not WeightArena.available(), reason="huge pages are advised on Linux only")

THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _mappings() -> list[tuple[int, int]]:
    """/proc/self/maps' address ranges."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        low, high = line.split()[0].split("-")
        ranges.append((int(low, 16), int(high, 16)))
    return ranges


def _mapping_of(tensor: torch.Tensor) -> tuple[int, int] | None:
    """The range holding the tensor's first byte."""
    return next((r for r in _mappings() if r[0] <= tensor.data_ptr() < r[1]), None)


def test_placed_tensors_are_exact_aligned_copies_sharing_one_mapping():
    arena = WeightArena()
    generator = torch.Generator().manual_seed(0)
    tensors = [torch.randn(37, 11, generator=generator), torch.randn(5, 3, 64, generator=generator).bfloat16(),
               torch.randint(-128, 127, (9, 576, 64), dtype=torch.int8, generator=generator),
               torch.randn(7, generator=generator).half(), torch.randint(0, 255, (3,), dtype=torch.uint8)]
    placed = [arena.place(t) for t in tensors]
    for original, copy_ in zip(tensors, placed):
        assert copy_.dtype == original.dtype and copy_.shape == original.shape and copy_.is_contiguous()
        assert torch.equal(copy_, original) and copy_.data_ptr() != original.data_ptr()
        assert copy_.data_ptr() % WEIGHT_ALIGNMENT == 0
    assert len({t.untyped_storage().data_ptr() for t in placed}) == 1
    assert placed[0].data_ptr() % HUGE_PAGE == 0


def test_mappings_grow_and_a_big_tensor_gets_its_own():
    arena = WeightArena()
    small = [arena.place(torch.full((HUGE_PAGE // 4 - 16,), float(i))) for i in range(4)]  # just under 2 MB each
    sizes = [t.untyped_storage().nbytes() for t in small]
    assert sizes[0] < sizes[1] < sizes[3] <= ARENA_CHUNK + HUGE_PAGE
    big = arena.place(torch.ones(ARENA_CHUNK // 4 + 1))
    assert big.untyped_storage().data_ptr() not in {t.untyped_storage().data_ptr() for t in small}
    assert all(torch.equal(t, torch.full_like(t, float(i))) for i, t in enumerate(small))


def test_a_mapping_lives_while_any_tensor_in_it_does():
    arena = WeightArena()
    first, second = (arena.place(torch.arange(1000.0) + i) for i in range(2))
    mapping = _mapping_of(second)
    assert mapping is not None
    del arena, first
    gc.collect()
    assert torch.equal(second, torch.arange(1000.0) + 1) and _mapping_of(second) == mapping
    del second
    gc.collect()
    assert mapping not in _mappings()


def test_tensors_it_cannot_hold_stay_where_they_are():
    arena = WeightArena()
    strided = torch.randn(8, 6).t()
    assert arena.place(strided) is strided
    meta = torch.empty(4, 4, device="meta")
    assert arena.place(meta) is meta


def _thp_faults() -> int:
    """Huge-page faults the kernel served or fell back from (4 KB pages: no free 2 MB page), all processes."""
    counts = dict(line.split() for line in Path("/proc/vmstat").read_text().splitlines())
    return int(counts.get("thp_fault_alloc", 0)) + int(counts.get("thp_fault_fallback", 0))


@pytest.mark.skipif(not THP_SETTING.exists() or "[never]" in THP_SETTING.read_text(),
                    reason="this kernel gives no transparent huge pages")
def test_the_arena_asks_for_huge_pages_and_the_kernel_sees_it():
    """The mapping is advised (VmFlags 'hg') and its first 2 MB is a huge-page fault: served (AnonHugePages) or, with
    memory too fragmented for a free 2 MB page, counted as a fallback; which one is the kernel's business."""
    faults = _thp_faults()
    arena = WeightArena()
    weight = arena.place(torch.randn(HUGE_PAGE // 4))
    assert weight.data_ptr() % HUGE_PAGE == 0
    low, _ = _mapping_of(weight)
    smaps = Path("/proc/self/smaps").read_text()
    entry = smaps[smaps.index(f"{low:x}-"):]
    assert "hg" in entry.split("VmFlags:")[1].split("\n")[0].split()
    huge_kb = int(re.search(r"AnonHugePages:\s+(\d+) kB", entry).group(1))
    assert huge_kb >= HUGE_PAGE // 1024 or _thp_faults() > faults


@pytest.mark.parametrize("quantize", [None, "int8", "int8-dynamic", "int4"])
def test_accelerate_model_packs_into_the_arena_and_generates_the_same(quantize):
    reference = build("llama").eval()
    model = lightgen.accelerate_model(copy.deepcopy(reference), quantize=quantize)
    weights = [m.__dict__["_lightgen_linear"] for m in model.modules() if "_lightgen_linear" in m.__dict__]
    assert weights
    storages = {w.weight.untyped_storage().data_ptr() for w in weights}
    assert len(storages) < len(weights)  # many linears to a mapping, not one allocation each
    assert all(w.dot is None or w.dot is w.weight for w in weights)
    ids, mask = padded_batch("llama", 2, 6)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        out = model.generate(**kwargs)
        copied = copy.deepcopy(model).generate(**kwargs)
        assert torch.equal(out, copied)
        if quantize is None:
            assert torch.equal(out, reference.generate(**kwargs))
