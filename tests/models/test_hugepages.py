"""Weights copied into transparent huge pages: equal copies, aligned, alive as long as they are used, and a quantized
model that gives the same logits bit for bit from either kind of page."""

from __future__ import annotations

import gc
import mmap

import pytest
import torch

from specdraft.models import hugepages, rowgemm
from specdraft.models.native_llama import NativeLlama
from specdraft.models.quantized import quantize
from specdraft.models.quantized_llama import QuantizedLlama, _in_huge_pages
from toys import tiny_llama


@pytest.fixture
def huge(monkeypatch):
    """Huge pages asked for, whatever this machine's THP setting (the advice is harmless where THP is off)."""
    monkeypatch.setenv("SPECDRAFT_HUGE_PAGES", "1")
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        pytest.skip("no MADV_HUGEPAGE on this OS")
    monkeypatch.setattr(hugepages, "enabled", lambda: True)


def test_copies_are_equal_aligned_and_outlive_their_mapping(huge):
    tensors = [torch.randn(3, 5), torch.arange(7, dtype=torch.uint8), torch.randn(4, 33).half()[:, 1:],
               torch.tensor(2.5), torch.empty(0, 8)]
    copies = hugepages.huge_page_copies(tensors)
    gc.collect()  # the mapping has no name left but the copies' storage
    for tensor, copy in zip(tensors, copies, strict=True):
        assert copy is not tensor and copy.dtype == tensor.dtype and torch.equal(copy, tensor)
        assert copy.is_contiguous() and copy.data_ptr() % hugepages.ALIGN == 0
    assert copies[0].data_ptr() % hugepages.HUGE_PAGE == 0  # the arena starts on a huge page
    tensors[0].add_(1)  # copies, not views of the originals
    assert not torch.equal(copies[0], tensors[0])


def test_off_or_nothing_to_copy_returns_the_tensors_themselves(monkeypatch):
    tensor = torch.randn(4)
    monkeypatch.setenv("SPECDRAFT_HUGE_PAGES", "0")
    assert not hugepages.enabled()
    assert hugepages.huge_page_copies([tensor])[0] is tensor
    assert hugepages.huge_page_copies([]) == []


@pytest.mark.skipif(not rowgemm.available(), reason="no AVX2/F16C CPU or C++ compiler for the kernels")
def test_a_quantized_model_gives_the_same_logits_from_either_kind_of_page(huge, monkeypatch):
    dense = NativeLlama.from_hf(tiny_llama(0, std=0.1))
    in_huge = QuantizedLlama.from_dense(dense, "int4")
    monkeypatch.setenv("SPECDRAFT_HUGE_PAGES", "0")
    monkeypatch.setattr(hugepages, "enabled", lambda: False)
    in_small = QuantizedLlama.from_dense(dense, "int4")
    packed = in_huge.layers[0].quantized["qkv"].packed
    assert packed.data_ptr() != in_small.layers[0].quantized["qkv"].packed.data_ptr()
    tied = in_huge.head_quantized is in_huge.embed_quantized  # a tied table stays one table
    assert tied == (in_small.head_quantized is in_small.embed_quantized)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    assert torch.equal(in_huge(ids, in_huge.new_cache(16)), in_small(ids, in_small.new_cache(16)))


def test_a_weight_named_twice_is_copied_once(huge):
    weight = quantize(torch.randn(16, 64), "q8_0")
    moved = _in_huge_pages({"embed": weight, "lm_head": weight})
    assert moved["embed"].packed is moved["lm_head"].packed
    assert moved["embed"].packed.data_ptr() != weight.packed.data_ptr()
    assert torch.equal(moved["embed"].packed, weight.packed) and moved["embed"].kind == weight.kind


@pytest.mark.skipif(not rowgemm.available(), reason="no AVX2/F16C CPU or C++ compiler for the kernels")
def test_a_dense_models_packed_weights_give_the_same_logits_from_either_kind_of_page(huge, monkeypatch):
    in_huge = NativeLlama.from_hf(tiny_llama(0, std=0.1))
    in_huge.prepack("rows")
    monkeypatch.setattr(hugepages, "enabled", lambda: False)
    in_small = NativeLlama.from_hf(tiny_llama(0, std=0.1))
    in_small.prepack("rows")
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    assert in_huge.packed_head.tensor.data_ptr() != in_small.packed_head.tensor.data_ptr()
    assert torch.equal(in_huge.packed_head.tensor, in_small.packed_head.tensor)
    assert torch.equal(in_huge(ids, in_huge.new_cache(16)), in_small(ids, in_small.new_cache(16)))


def test_a_refused_advice_still_gives_equal_copies(huge, monkeypatch):
    """A kernel without THP (or a sandbox) refuses MADV_HUGEPAGE: the copies are made in ordinary pages."""

    class Refusing(mmap.mmap):
        def madvise(self, *args):
            raise OSError(22, "Invalid argument")

    monkeypatch.setattr(hugepages.mmap, "mmap", Refusing)
    tensor = torch.randn(5, 7)
    assert torch.equal(hugepages.huge_page_copies([tensor])[0], tensor)
