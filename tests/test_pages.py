"""Storage the builder gives a unit is faulted in with one call (``prefault`` in
``fsdp_builder.runtime.fast_storage``): the pages are there before the materializer writes
them, no value changes, and a system that refuses the call builds as before."""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from torch import nn

from fsdp_builder import CPUDevice, FromCheckpoint, FullyShardBuilder
from fsdp_builder.runtime import fast_storage as pages
from fsdp_builder.runtime.fast_storage import PREFAULT_MIN_BYTES, prefault
from fsdp_builder.runtime.tree import allocate_empty, allocate_unit, unit_modules

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the pages are faulted in on Linux only"
)

# Larger than glibc's largest mmap threshold (32 MiB): always a fresh mapping, never heap pages
# an earlier test already touched.
BIG = 48 << 20
PAGE = 4096


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _write_faults(tensor: torch.Tensor) -> int:
    before = _faults()
    with torch.no_grad():
        tensor.fill_(1.0)
    return _faults() - before


@pytest.fixture
def populate_works() -> Iterator[None]:
    probe = torch.empty(BIG // 4)
    prefault(probe)
    if pages._MADVISE.works is False:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    yield


def test_prefault_leaves_nothing_to_fault_when_written(populate_works: None) -> None:
    """A fresh tensor faults once per page when first written; after ``prefault`` writing it
    faults (almost) never, and ``prefault`` changes no value of a tensor that holds some."""
    pages_of = BIG // PAGE
    cold = torch.empty(BIG // 4)
    assert _write_faults(cold) > pages_of // 2  # the control: without it, every page faults
    warm = torch.empty(BIG // 4)
    prefault(warm)
    assert _write_faults(warm) < pages_of // 20
    values = torch.randn(BIG // 4)
    kept = values.clone()
    prefault(values)
    assert torch.equal(values, kept)


def test_small_or_refused_tensors_are_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Below ``PREFAULT_MIN_BYTES`` nothing is asked; a kernel that refuses the probe (one page
    of the process's own) turns the calls off for the process, and tensors still work."""
    calls: list[tuple[int, int]] = []

    def refuse(address: int, length: int, advice: int) -> int:
        calls.append((address, length))
        return -1

    monkeypatch.setattr(pages, "_MADVISE", pages._Madvise(call=refuse))
    prefault(torch.empty(PREFAULT_MIN_BYTES // 8))
    assert calls == []
    big = torch.empty(BIG // 4)
    prefault(big)
    prefault(big)
    assert len(calls) == 1 and pages._MADVISE.works is False
    address, length = calls[0]
    assert address % PAGE == 0 and length == PAGE
    assert not big.data_ptr() <= address < big.data_ptr() + BIG  # the probe, not the tensor
    big.fill_(2.0)
    assert float(big.sum()) == 2.0 * big.numel()


def test_one_refused_tensor_leaves_the_calls_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe passes, the kernel then refuses one tensor's range (as for a read-only file
    mapping): later tensors are still asked for, each by its own page-aligned range."""
    calls: list[tuple[int, int]] = []

    def probe_only(address: int, length: int, advice: int) -> int:
        calls.append((address, length))
        return 0 if len(calls) == 1 else -1

    monkeypatch.setattr(pages, "_MADVISE", pages._Madvise(call=probe_only))
    first, second = torch.empty(BIG // 4), torch.empty(BIG // 4)
    prefault(first)
    prefault(second)
    assert pages._MADVISE.works is True and len(calls) == 3
    for tensor, (address, length) in zip((first, second), calls[1:], strict=True):
        start = tensor.data_ptr()
        assert start <= address < start + PAGE and address % PAGE == 0
        assert address + length <= start + BIG and length % PAGE == 0


def test_allocation_faults_in_fresh_states(populate_works: None) -> None:
    """``allocate_empty`` gives a large meta parameter pages that are already there."""
    with torch.device("meta"):
        layer = nn.Linear(2048, BIG // 4 // 2048, bias=False)
    allocate_empty(unit_modules(layer, ()), torch.device("cpu"))
    assert _write_faults(layer.weight) < BIG // PAGE // 20


def _gpt2(vocab: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=vocab, n_positions=64, n_embd=256, n_layer=2, n_head=4, tie_word_embeddings=True
    )
    return cast(nn.Module, GPT2LMHeadModel(config))


def test_fsdp2_shards_of_a_transformers_model_are_faulted_in(
    world1: None, populate_works: None
) -> None:
    """The direct FSDP2 shard storage (``allocate_unit``) of a transformers GPT-2 whose
    embedding is ``BIG``: the shard's pages are there before it is written."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    pytest.importorskip("transformers")
    vocab = BIG // 4 // 256
    with torch.device("meta"):
        model = _gpt2(vocab)
    mesh = init_device_mesh("cpu", (1,))
    transformer = cast(Any, model).transformer
    fully_shard(transformer.wte, mesh=mesh)
    allocate_unit(transformer.wte, [transformer.wte], torch.device("cpu"), {})
    weight = transformer.wte.weight
    assert _write_faults(weight.to_local()) < BIG // PAGE // 20


def test_checkpoint_load_of_a_save_pretrained_folder_reads_every_value(
    world1: None, tmp_path: Path
) -> None:
    """A GPT-2 ``save_pretrained`` folder with tensors above ``PREFAULT_MIN_BYTES`` loads through
    the faulted-in shards with every value equal to the folder's (as ``from_pretrained``)."""
    pytest.importorskip("transformers")
    from helpers import full_state_dict
    from transformers import GPT2LMHeadModel

    vocab = 2 * PREFAULT_MIN_BYTES // 4 // 256
    torch.manual_seed(5)
    cast(Any, _gpt2(vocab)).save_pretrained(tmp_path)
    with torch.device("meta"):
        model = _gpt2(vocab)
    block = type(cast(Any, model).transformer.h[0])
    built = (
        FullyShardBuilder()
        .device(CPUDevice())
        .wrap(block)
        .materialize(FromCheckpoint(tmp_path))
        .build(model)
    )
    theirs = GPT2LMHeadModel.from_pretrained(tmp_path).state_dict()
    got = full_state_dict(built)
    assert set(got) <= set(theirs)
    assert got["transformer.wte.weight"].numel() * 4 >= 2 * PREFAULT_MIN_BYTES
    for name, value in got.items():
        assert torch.equal(value, theirs[name]), name
