"""Checkpoint sources: a format of the user's own, what transformers saves, and bad inputs.

Multi-rank scenarios run in one 2-rank spawn (``isolated``). References are plain PyTorch
(``load_state_dict`` of the same values) and transformers itself (``from_pretrained``), never
our own materializers.

The transformers models are GPT-2 (``Conv1D``, tied head, no buffers in transformers 5) and
BERT (tied MLM decoder, non-persistent ``position_ids`` / ``token_type_ids``). Loading is the
point here, not buffers: BERT is built on meta and its two buffers are set by hand before the
build (their values as ``BertEmbeddings`` computes them), so the load does not depend on how
non-persistent buffers are computed. (``accelerate.init_empty_weights()`` would keep the buffers
real, but in transformers 5 it unties the MLM decoder from the embeddings.)
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Hashable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from helpers import assert_reads, full_state_dict
from isolated import Results, Spawns, run_each, values
from torch import nn

from fsdp_builder import (
    ConfigurationError,
    CPUDevice,
    FromCheckpoint,
    FromStateDict,
    FSDPBuilder,
    FullyShardBuilder,
    MaterializationError,
    ShardingBuilder,
)
from fsdp_builder.sources import (
    CheckpointSource,
    TensorMeta,
    formats,
    register_format,
    unregister_format,
)
from fsdp_builder.sources.base import Index

BACKENDS = ["fsdp1", "fsdp2"]

# -- a toy model and a format of the user's own (.npz) ----------------------------------------


class ToyBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(13, 8)  # 13 rows: uneven shards at 2 ranks
        self.blocks = nn.ModuleList(ToyBlock() for _ in range(2))
        self.head = nn.Linear(8, 5)


def toy_values() -> dict[str, np.ndarray]:
    gen = torch.Generator().manual_seed(7)
    return {k: torch.randn(v.shape, generator=gen).numpy() for k, v in Toy().state_dict().items()}


class NpzSource:
    """A user's format: numpy's .npz archive, one array per state name."""

    def __init__(self, path: Path) -> None:
        self.describe = f"the npz archive '{path}'"
        self._file: Any = np.load(path)
        self._meta = {
            k: TensorMeta(tuple(self._file[k].shape), torch.from_numpy(self._file[k][:0]).dtype)
            for k in self._file.files
        }

    def tensors(self) -> dict[str, TensorMeta]:
        return self._meta

    def read(self, key: str, index: Index | None = None) -> torch.Tensor:
        tensor = torch.from_numpy(self._file[key])
        return tensor[index] if index else tensor

    def close(self) -> None:
        self._file.close()


def register_npz() -> None:
    register_format("npz", lambda path: path.suffix == ".npz", NpzSource)


# -- transformers checkpoints ------------------------------------------------------------------


def gpt2_config() -> Any:
    from transformers import GPT2Config

    return GPT2Config(
        n_embd=32, n_layer=2, n_head=2, vocab_size=61, n_positions=16, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip


def bert_config() -> Any:
    from transformers import BertConfig

    return BertConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=61,
        max_position_embeddings=16,
    )


def eager(kind: str, seed: int = 0) -> Any:
    from transformers import BertForMaskedLM, GPT2LMHeadModel

    torch.manual_seed(seed)
    if kind == "bert":
        return BertForMaskedLM(bert_config())
    return GPT2LMHeadModel(gpt2_config())


def write_torch_bin(model: Any, folder: Path, shards: int) -> None:
    """What ``save_pretrained(..., safe_serialization=False)`` wrote before transformers 5 (which
    writes safetensors only): ``pytorch_model.bin``, or ``.bin`` shards and their index; tied
    weights saved once."""
    folder.mkdir(parents=True)
    model.config.save_pretrained(folder)
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    if shards == 1:
        torch.save(state, folder / "pytorch_model.bin")
        return
    keys = list(state)
    weight_map = {}
    for i in range(shards):
        name = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = keys[i::shards]
        torch.save({k: state[k] for k in part}, folder / name)
        weight_map.update(dict.fromkeys(part, name))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(index))


def write_folders(root: Path) -> dict[str, str]:
    gpt2 = eager("gpt2")
    folders = {
        "shards": root / "gpt2-shards",
        "single": root / "gpt2-single",
        "bin": root / "gpt2-bin",
        "bin_shards": root / "gpt2-bin-shards",
        "bf16_file": root / "gpt2-bf16",
        "bert": root / "bert",
    }
    gpt2.save_pretrained(folders["shards"], max_shard_size="20KB")
    gpt2.save_pretrained(folders["single"])
    write_torch_bin(gpt2, folders["bin"], 1)
    write_torch_bin(gpt2, folders["bin_shards"], 3)
    eager("gpt2").to(torch.bfloat16).save_pretrained(folders["bf16_file"], max_shard_size="20KB")
    eager("bert").save_pretrained(folders["bert"], max_shard_size="20KB")
    return {k: str(v) for k, v in folders.items()}


def tokens() -> torch.Tensor:
    return torch.arange(3, 33).remainder(61).view(2, 15)


# Which folder each load case reads, the model kind and the model's dtype.
HF_CASES: dict[str, tuple[str, str, torch.dtype]] = {
    "shards": ("shards", "gpt2", torch.float32),
    "single": ("single", "gpt2", torch.float32),
    "bin": ("bin", "gpt2", torch.float32),
    "bin_shards": ("bin_shards", "gpt2", torch.float32),
    "bf16_into_fp32": ("bf16_file", "gpt2", torch.float32),
    "fp32_into_bf16": ("shards", "gpt2", torch.bfloat16),
    "bert": ("bert", "bert", torch.float32),
}


def reference_logits(folder: str, kind: str, dtype: torch.dtype) -> torch.Tensor:
    """transformers' own load of the folder, on one process."""
    from transformers import BertForMaskedLM, GPT2LMHeadModel

    cls: Any = BertForMaskedLM if kind == "bert" else GPT2LMHeadModel
    model = cls.from_pretrained(folder, dtype=dtype).eval()
    with torch.no_grad():
        return model(tokens()).logits


# -- inside the ranks --------------------------------------------------------------------------


def builder(backend: str) -> ShardingBuilder:
    kind = FSDPBuilder if backend == "fsdp1" else FullyShardBuilder
    return kind().device(CPUDevice())


def meta_toy() -> Toy:
    with torch.device("meta"):
        return Toy()


def toy_load(backend: str, materializer: Any) -> dict[str, torch.Tensor]:
    built = builder(backend).wrap(ToyBlock).materialize(materializer).build(meta_toy())
    return full_state_dict(built)


def meta_hf(kind: str, dtype: torch.dtype) -> Any:
    from transformers import BertForMaskedLM, GPT2LMHeadModel

    model: Any
    if kind == "bert":  # buffers set by hand (see the module doc)
        with torch.device("meta"):
            model = BertForMaskedLM(bert_config())
        model.to(dtype)
        embeddings = model.bert.embeddings
        positions = torch.arange(bert_config().max_position_embeddings).expand((1, -1))
        embeddings.position_ids = positions
        embeddings.token_type_ids = torch.zeros_like(positions)
        return model
    with torch.device("meta"):
        model = GPT2LMHeadModel(gpt2_config())
    return model.to(dtype)


def hf_load(backend: str, folder: str, kind: str, dtype: torch.dtype) -> torch.Tensor:
    from transformers.models.bert.modeling_bert import BertLayer
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    block = BertLayer if kind == "bert" else GPT2Block
    model = meta_hf(kind, dtype)
    built = builder(backend).wrap(block).materialize(FromCheckpoint(folder)).build(model)
    built.eval()
    with torch.no_grad():
        return built(tokens()).logits.detach().clone()


def refused(build: Callable[[nn.Module], Any]) -> tuple[str, str, bool]:
    """The error a build raised on this rank, and whether the model stayed all on meta."""
    model = meta_toy()
    try:
        build(model)
    except Exception as exc:
        return type(exc).__name__, str(exc), all(p.is_meta for p in model.parameters())
    return "built", "", False


def differing_paths(paths: dict[str, str]) -> tuple[str, str, bool]:
    own = Path(paths["npz"] if dist.get_rank() == 0 else paths["npz_copy"])
    return refused(
        lambda m: builder("fsdp2").wrap(ToyBlock).materialize(FromCheckpoint(own)).build(m)
    )


def swap_on(rank: int) -> Callable[[str], str]:
    """A key_map that swaps the two blocks' weights on ``rank`` only: each rank's checkpoint
    fits alone, but the ranks would stitch rows of different tensors."""
    swap = {"blocks.0.linear.weight": "blocks.1.linear.weight"}
    swap.update({v: k for k, v in swap.items()})

    def mapping(key: str) -> str:
        return swap.get(key, key) if dist.get_rank() == rank else key

    return mapping


def differing_key_maps(paths: dict[str, str]) -> tuple[str, str, bool]:
    load = FromCheckpoint(paths["npz"], key_map=swap_on(1))
    return refused(lambda m: builder("fsdp2").wrap(ToyBlock).materialize(load).build(m))


def dcp_missing_file(paths: dict[str, str], backend: str) -> tuple[str, str, bool]:
    load = FromCheckpoint(paths["dcp_broken"])
    return refused(lambda m: builder(backend).wrap(ToyBlock).materialize(load).build(m))


def in_own_folder(prepare: Callable[[Path], None], path: str) -> tuple[str, str, bool]:
    """Build from a relative ``path`` in a working folder of this rank's own, which
    ``prepare`` fills: what ranks on different nodes see when their local disks differ."""
    here = os.getcwd()
    own = Path(tempfile.mkdtemp())
    prepare(own)
    os.chdir(own)
    try:
        load = FromCheckpoint(path)
        return refused(lambda m: builder("fsdp1").wrap(ToyBlock).materialize(load).build(m))
    finally:
        os.chdir(here)


def only_on_rank0(paths: dict[str, str]) -> tuple[str, str, bool]:
    def prepare(own: Path) -> None:
        if dist.get_rank() == 0:
            shutil.copy(paths["npz"], own / "toy.npz")

    return in_own_folder(prepare, "toy.npz")


def dcp_missing_file_on_rank1(paths: dict[str, str]) -> tuple[str, str, bool]:
    def prepare(own: Path) -> None:
        shutil.copytree(paths["dcp"], own / "dcp")
        if dist.get_rank() == 1:
            for data in (own / "dcp").glob("*.distcp"):
                data.unlink()

    return in_own_folder(prepare, "dcp")


def cases(paths: dict[str, str]) -> Iterator[tuple[Hashable, Callable[[], Any]]]:
    register_npz()
    rank0 = paths["npz"] if dist.get_rank() == 0 else None
    for backend in BACKENDS:
        yield ("npz", "local", backend), partial(toy_load, backend, FromCheckpoint(paths["npz"]))
        yield ("npz", "rank0", backend), partial(toy_load, backend, FromStateDict(rank0))
        yield (
            ("npz", "rank0-fallback", backend),
            partial(toy_load, backend, FromCheckpoint(paths["npz"], shared_filesystem=False)),
        )
    for name, (folder, kind, dtype) in HF_CASES.items():
        for backend in BACKENDS:
            yield ("hf", name, backend), partial(hf_load, backend, paths[folder], kind, dtype)
    yield "differing_paths", partial(differing_paths, paths)
    yield "differing_key_maps", partial(differing_key_maps, paths)
    for backend in BACKENDS:
        yield ("dcp_missing_file", backend), partial(dcp_missing_file, paths, backend)
    yield "only_on_rank0", partial(only_on_rank0, paths)
    yield "dcp_missing_file_on_rank1", partial(dcp_missing_file_on_rank1, paths)


def scenarios(paths: dict[str, str]) -> Results:
    return run_each(cases(paths))


SPAWNS = Spawns(scenarios, timeout=420)


# -- the test process -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    import torch.distributed.checkpoint as dcp

    root = tmp_path_factory.mktemp("sources")
    arrays = toy_values()
    np.savez(root / "toy.npz", **arrays)  # type: ignore[arg-type]
    (root / "copy").mkdir()
    np.savez(root / "copy" / "toy.npz", **{k: v * 2 for k, v in arrays.items()})  # type: ignore[arg-type]
    with warnings.catch_warnings():  # saving on one process without a group is the point
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.save(
            {k: torch.from_numpy(v) for k, v in arrays.items()},
            checkpoint_id=str(root / "dcp"),
            no_dist=True,
        )
    broken = root / "dcp_broken"
    shutil.copytree(root / "dcp", broken)
    for data in broken.glob("*.distcp"):
        data.unlink()
    return {
        "npz": str(root / "toy.npz"),
        "npz_copy": str(root / "copy" / "toy.npz"),
        "dcp": str(root / "dcp"),
        "dcp_broken": str(broken),
        **write_folders(root),
    }


def scenario(paths: dict[str, str], key: Hashable) -> list[Any]:
    return values(SPAWNS(2, paths), key)


def plain_toy(path: str) -> dict[str, torch.Tensor]:
    """The plain PyTorch load of the same values."""
    model = Toy()
    with np.load(path) as data:
        model.load_state_dict({k: torch.from_numpy(data[k]) for k in data.files})
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loader", ["local", "rank0", "rank0-fallback"])
def test_a_registered_format_loads_through_both_loaders(
    paths: dict[str, str], loader: str, backend: str
) -> None:
    want = plain_toy(paths["npz"])
    for rank, got in enumerate(scenario(paths, ("npz", loader, backend))):
        assert got.keys() == want.keys(), rank
        for key in want:
            assert torch.equal(got[key], want[key]), (rank, key)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(HF_CASES))
def test_what_transformers_saves_loads_as_from_pretrained_does(
    paths: dict[str, str], case: str, backend: str
) -> None:
    folder, kind, dtype = HF_CASES[case]
    want = reference_logits(paths[folder], kind, dtype)
    for rank, got in enumerate(scenario(paths, ("hf", case, backend))):
        assert got.dtype == want.dtype, rank
        assert torch.equal(got, want), (rank, (got - want).abs().max())


def assert_refused_alike(ranks: list[tuple[str, str, bool]], kind: str, pattern: str) -> None:
    import re

    for rank, (got, message, untouched) in enumerate(ranks):
        assert got == kind, (rank, got, message)
        assert re.search(pattern, message, re.S), (rank, message)
        assert untouched, rank
    assert len({message for _, message, _ in ranks}) == 1, ranks


@pytest.mark.timeout(900)
def test_different_paths_on_the_ranks_are_refused(paths: dict[str, str]) -> None:
    ranks = scenario(paths, "differing_paths")
    assert_refused_alike(ranks, "RankDisagreementError", r"rank 1 has materializer=.*path=.*copy")


@pytest.mark.timeout(900)
def test_key_maps_that_differ_between_ranks_are_refused(paths: dict[str, str]) -> None:
    ranks = scenario(paths, "differing_key_maps")
    assert_refused_alike(
        ranks, "RankDisagreementError", r"key_map\('blocks.0.linear.weight'\)=.*blocks.1"
    )


@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_dcp_folder_missing_a_data_file_is_refused_before_any_unit(
    paths: dict[str, str], backend: str
) -> None:
    ranks = scenario(paths, ("dcp_missing_file", backend))
    assert_refused_alike(
        ranks, "ConfigurationError", r"invalid `path`.*lacks data file\(s\).*__0_0\.distcp"
    )


@pytest.mark.timeout(900)
def test_a_dcp_data_file_missing_on_one_rank_stops_every_rank(paths: dict[str, str]) -> None:
    ranks = scenario(paths, "dcp_missing_file_on_rank1")
    assert_refused_alike(
        ranks, "RankDisagreementError", r"failed on rank\(s\) 1\b.*rank 1: .*lacks data file"
    )


@pytest.mark.timeout(900)
def test_a_path_only_rank0_has_points_to_shared_filesystem_false(paths: dict[str, str]) -> None:
    ranks = scenario(paths, "only_on_rank0")
    assert_refused_alike(
        ranks, "RankDisagreementError", r"rank 1: .*does not exist.*shared_filesystem=False"
    )


# -- one process -------------------------------------------------------------------------------


@pytest.fixture
def npz_format() -> Iterator[None]:
    register_npz()
    try:
        yield
    finally:
        unregister_format("npz")


def build_toy(materializer: Any, model: nn.Module | None = None) -> nn.Module:
    return (
        FSDPBuilder()
        .device(CPUDevice())
        .wrap(ToyBlock)
        .materialize(materializer)
        .build(model if model is not None else meta_toy())
    )


def test_registered_formats_come_first_and_can_be_removed(npz_format: None) -> None:
    assert formats()[0] == "npz"
    assert "dcp-folder" in formats() and formats()[-1] == "torch-file"
    unregister_format("npz")
    assert "npz" not in formats()


def test_register_format_checks_its_arguments() -> None:
    with pytest.raises(ConfigurationError, match=r"`register_format` got an invalid `open`"):
        register_format("x", lambda p: False, "not callable")  # type: ignore[arg-type]


def test_a_format_must_open_a_checkpoint_source(world1: None, tmp_path: Path) -> None:
    path = tmp_path / "x.odd"
    path.write_text("")
    register_format("odd", lambda p: p.suffix == ".odd", lambda p: object())  # type: ignore[arg-type,return-value]
    try:
        with pytest.raises(ConfigurationError, match=r"format 'odd' opened .* lacks"):
            build_toy(FromCheckpoint(path))
    finally:
        unregister_format("odd")


def test_a_user_format_is_a_checkpoint_source(paths: dict[str, str]) -> None:
    source = NpzSource(Path(paths["npz"]))
    try:
        assert isinstance(source, CheckpointSource)
        assert source.read("embed.weight", (slice(2, 5),)).shape == (3, 8)
    finally:
        source.close()


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"path": None}, r"invalid `path`: expected a str or os.PathLike.*NoneType.*FromStateDict"),
        ({"path": "x", "strict": "yes"}, r"invalid `strict`: expected True or False, got 'yes'"),
        ({"path": "x", "shared_filesystem": 1}, r"`shared_filesystem`: expected .*, got 1.*=False"),
    ],
)  # fmt: skip
def test_from_checkpoint_arguments_are_checked_with_our_error(
    kwargs: dict[str, Any], pattern: str
) -> None:
    with pytest.raises(ConfigurationError, match=pattern):
        FromCheckpoint(**kwargs)


def test_the_path_is_compared_by_its_value() -> None:
    a, b = FromCheckpoint(Path("/ckpt/a")), FromCheckpoint(Path("/ckpt/b"))
    assert "'/ckpt/a'" in a.describe() and a.describe() != b.describe()
    assert a.describe() == FromCheckpoint("/ckpt/a").describe()
    # Only rank 0 reads: other ranks' paths do not matter.
    assert "/ckpt" not in FromCheckpoint("/ckpt/a", shared_filesystem=False).describe()
    # A dict's order does not change what it does.
    one = FromCheckpoint("x", key_map={"a": "b", "c": "d"}).describe()
    assert one == FromCheckpoint("x", key_map={"c": "d", "a": "b"}).describe()


@pytest.mark.parametrize(
    ("key_map", "pattern"),
    [
        (lambda key: {}[key], r"invalid `key_map`: raised KeyError.*checkpoint key 'blocks"),
        (lambda key: 3, r"invalid `key_map`: returned 3 \(int\) for the checkpoint key"),
    ],
)
def test_a_failing_key_map_is_reported_as_a_key_map_problem(
    world1: None, npz_format: None, paths: dict[str, str], key_map: Any, pattern: str
) -> None:
    model = meta_toy()
    with pytest.raises(ConfigurationError, match=pattern) as info:
        build_toy(FromCheckpoint(paths["npz"], key_map=key_map), model)
    assert "invalid `path`" not in str(info.value)
    assert all(p.is_meta for p in model.parameters())


def test_a_typo_in_the_folder_names_the_near_miss(world1: None, paths: dict[str, str]) -> None:
    typo = paths["shards"].replace("gpt2-shards", "gpt2-shrads")
    with pytest.raises(
        ConfigurationError, match=r"does not exist on rank 0; did you mean '.*gpt2-shards'"
    ):
        build_toy(FromCheckpoint(typo))


@pytest.mark.parametrize("folder", ["shards", "bin_shards"])
def test_one_shard_file_instead_of_the_folder_says_pass_the_folder(
    world1: None, paths: dict[str, str], folder: str
) -> None:
    shard = sorted(p for p in Path(paths[folder]).iterdir() if "-00002-of-" in p.name)[0]
    with pytest.raises(ConfigurationError, match=r"is one of the \d+ shard files.*pass the folder"):
        build_toy(FromCheckpoint(shard))


def test_a_checkpoint_of_another_config_names_keys_and_shapes_once(
    world1: None, paths: dict[str, str]
) -> None:
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    config = gpt2_config()
    config.n_embd, config.n_layer = 48, 3
    from transformers import GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(config)
    with pytest.raises(ConfigurationError) as info:
        FSDPBuilder().device(CPUDevice()).wrap(GPT2Block).materialize(
            FromCheckpoint(paths["shards"])
        ).build(model)
    message = str(info.value)
    assert "invalid `path`" in message
    assert "missing key(s): transformer.h.2." in message
    assert "'transformer.h.0.attn.c_attn.weight' is [32, 96] in the checkpoint but [48, 144]" in (
        message
    )
    assert "another config" in message
    listed = [part.split(" is ")[0] for part in message.split("; ") if " in the checkpoint" in part]
    assert len(listed) == len(set(listed)), listed
    assert all(p.is_meta for p in model.parameters())


class NeedsBuffer(nn.Module):
    """A module whose non-persistent buffer nothing in the library knows how to compute."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Toy()
        self.register_buffer("table", torch.empty(4), persistent=False)


def test_a_buffer_problem_is_never_reported_as_a_bad_path(
    world1: None, npz_format: None, paths: dict[str, str]
) -> None:
    with torch.device("meta"):
        model = NeedsBuffer()
    key_map = [(r"^", "inner.")]
    with pytest.raises(MaterializationError) as info:
        build_toy(FromCheckpoint(paths["npz"], key_map=key_map), model)
    assert "invalid `path`" not in str(info.value)
    assert "table" in str(info.value)


def test_a_dcp_folder_missing_a_data_file_is_refused(world1: None, paths: dict[str, str]) -> None:
    model = meta_toy()
    with pytest.raises(ConfigurationError, match=r"lacks data file\(s\).*Copy the whole folder"):
        build_toy(FromCheckpoint(paths["dcp_broken"]), model)
    assert all(p.is_meta for p in model.parameters())


def test_a_dcp_folder_loads_through_the_rank0_loader(world1: None, paths: dict[str, str]) -> None:
    got = build_toy(FromStateDict(paths["dcp"])).state_dict()
    want = plain_toy(paths["npz"])
    for key in want:
        assert torch.equal(got[key].cpu(), want[key]), key


def test_the_format_example_in_the_docs_runs(world1: None, tmp_path: Path) -> None:
    import re

    page = Path(__file__).resolve().parents[1] / "docs" / "checkpoint_formats.md"
    block = re.search(
        r"<!-- runnable: npz-format -->\s*\n```python\n(.*?)\n```", page.read_text(), re.S
    )
    assert block is not None
    namespace: dict[str, Any] = {"folder": tmp_path}
    try:
        exec(compile(block[1], str(page), "exec"), namespace)
    finally:
        unregister_format("npz")
    got = {k: v.full_tensor() for k, v in namespace["loaded"].state_dict().items()}
    want = namespace["saved"].state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


# -- the safetensors reader itself ------------------------------------------------------------


def _stored_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(7, 5, generator=g),
        "bf16": torch.randn(5, 3, 4, generator=g).bfloat16(),
        "f16": torch.randn(9, generator=g).half(),
        "i64": torch.randint(-(10**12), 10**12, (4, 3), generator=g),
        "bool": torch.rand(5, 2, generator=g) > 0.5,
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "empty_inner": torch.empty(3, 0, 2),
    }


def test_the_safetensors_reader_is_bit_equal_to_safetensors_load_file(tmp_path: Path) -> None:
    """Whole tensors, every row range (empty ones too), slices of inner dims and strided rows,
    read as a new tensor and into a destination (of the stored dtype, and converted)."""
    from safetensors.torch import load_file, save_file

    from fsdp_builder.sources.hf_safetensors import SafetensorsSource

    file = tmp_path / "m.safetensors"
    save_file(_stored_tensors(), str(file), metadata={"format": "pt"})
    want = load_file(str(file))
    source = SafetensorsSource(f"'{file}'", {file: None})
    try:
        assert source.tensors() == {k: TensorMeta(tuple(t.shape), t.dtype) for k, t in want.items()}
        for key, full in want.items():
            indexes: list[Index | None] = [None]
            if full.dim():
                rows = range(full.shape[0] + 1)
                indexes += [(slice(a, b),) for a in rows for b in rows]
                indexes += [(slice(0, None, 2),)]
            if full.dim() > 1:
                indexes += [(slice(1, 3), slice(1, 2)), (slice(None), slice(0, 1))]
            assert_reads(source, key, full, indexes)
    finally:
        source.close()


@pytest.mark.parametrize(
    "damage",
    ["empty", "short header", "not json", "past the end", "wrong length", "unknown dtype"],
)
def test_the_safetensors_reader_refuses_a_damaged_file(tmp_path: Path, damage: str) -> None:
    from safetensors.torch import save_file

    from fsdp_builder.sources import SourceError
    from fsdp_builder.sources.hf_safetensors import SafetensorsSource

    file = tmp_path / "m.safetensors"
    save_file({"w": torch.ones(4, 4)}, str(file))
    data = file.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])

    def rewritten(**changes: Any) -> bytes:
        text = json.dumps({**header, "w": {**header["w"], **changes}}).encode()
        return len(text).to_bytes(8, "little") + text + data[8 + length :]

    damaged = {
        "empty": b"",
        "short header": (1000).to_bytes(8, "little") + b"{}",
        "not json": (4).to_bytes(8, "little") + b"{{{{" + data[8 + length :],
        "past the end": data[:-8],
        "wrong length": rewritten(shape=[4, 3]),
        # A dtype name no safetensors release knows (C64, once refused here, now loads).
        "unknown dtype": rewritten(dtype="Q9"),
    }[damage]
    file.write_bytes(damaged)
    with pytest.raises(SourceError, match="not a state dict"):
        SafetensorsSource(f"'{file}'", {file: None})


@pytest.mark.parametrize(("seed", "raised"), [(2, IndexError), (20, KeyError)])
def test_bytes_torch_load_chokes_on_are_not_a_state_dict(
    tmp_path: Path, seed: int, raised: type[Exception]
) -> None:
    import io
    import random

    from fsdp_builder.sources.base import SourceError
    from fsdp_builder.sources.torch_files import load_state_dict_file

    data = random.Random(seed).randbytes(4096)
    # The premise: torch.load fails on these bytes with an exception of its own choosing.
    with pytest.raises(raised), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    path = tmp_path / "random.pt"
    path.write_bytes(data)
    with pytest.raises(SourceError, match=r"is not a state dict \(torch\.load failed"):
        load_state_dict_file(path, f"'{path}'")


@pytest.mark.parametrize("backend", ["fsdp1", "fsdp2"])
@pytest.mark.parametrize("poisoned", [False, True])
def test_checks_for_nonfinite_run_by_run_as_a_gpt2_folder_is_read(
    world1: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str, poisoned: bool
) -> None:
    """Tensors are read in runs of rows, each checked for NaN/inf right after its read: a NaN
    in a late run of one tensor is named, and the values are the folder's, bit for bit."""
    from transformers import GPT2LMHeadModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    import fsdp_builder.materializers.checkpoints as checkpoints
    import fsdp_builder.materializers.nonfinite as nonfinite

    torch.manual_seed(0)
    saved = GPT2LMHeadModel(gpt2_config())
    poisoned_name = "transformer.h.1.mlp.c_fc.weight"  # Conv1D: 32 rows of 128
    if poisoned:
        with torch.no_grad():
            saved.get_parameter(poisoned_name)[29, 5] = float("nan")
    saved.save_pretrained(tmp_path)
    # Four rows (2 KiB) per run: that weight is read in eight runs, the NaN in the last one.
    monkeypatch.setattr(checkpoints, "CHECK_RUN_BYTES", 4 * 128 * 4)
    checked: list[tuple[int, ...]] = []

    def holds_nonfinite(tensor: torch.Tensor) -> bool:
        checked.append(tuple(tensor.shape))
        return nonfinite.holds_nonfinite(tensor)

    monkeypatch.setattr(checkpoints, "holds_nonfinite", holds_nonfinite)
    model = meta_hf("gpt2", torch.float32)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as launchers set it per rank: the checks then go run by run
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            built = (
                builder(backend).wrap(GPT2Block).materialize(FromCheckpoint(tmp_path)).build(model)
            )
    finally:
        torch.set_num_threads(threads)
    # Each c_fc weight (32 rows of 128) was checked in eight runs of four rows.
    assert checked.count((4, 128)) >= 2 * 8, checked
    named = [str(w.message) for w in caught if "NaN or inf" in str(w.message)]
    if poisoned:
        assert len(named) == 1 and poisoned_name in named[0], named
    else:
        assert not named, named
    state = full_state_dict(built)
    expected = saved.state_dict()
    for name, value in state.items():
        assert torch.equal(value.isnan(), expected[name].isnan()), name
        assert torch.equal(value.nan_to_num(), expected[name].nan_to_num()), name


@pytest.mark.parametrize(
    "dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64]
)
def test_the_nonfinite_check_agrees_with_torchs_exact_answer(dtype: torch.dtype) -> None:
    """The one-sum check says what ``~torch.isfinite(t).all()`` says: for finite tensors
    whose sum overflows (it must then look exactly), a NaN or inf in any place (either part of
    a complex value), single values (0-d) and tensors with no elements."""
    from fsdp_builder.materializers.nonfinite import holds_nonfinite

    real = torch.float32 if dtype.is_complex else dtype
    big = torch.finfo(real).max
    cases = [
        torch.randn(64, 8, generator=torch.Generator().manual_seed(0)).to(dtype),
        torch.full((16,), big / 2, dtype=real).to(dtype),  # finite, but its sum overflows
        torch.full((16,), -big / 2, dtype=real).to(dtype),
        torch.empty(0, 4, dtype=dtype),
        torch.tensor(1.5).to(dtype),
        torch.tensor(float("nan")).to(dtype),
    ]
    for bad in (float("nan"), float("inf"), float("-inf")):
        for place in (0, 511):
            t = torch.randn(512).to(dtype)
            t[place] = bad
            cases.append(t)
            if dtype.is_complex:
                t = t.clone()
                t[place] = torch.tensor(complex(0.5, bad))
                cases.append(t)
    for case in cases:
        exact = bool(case.numel()) and not bool(torch.isfinite(case).all())
        assert holds_nonfinite(case) is exact, (case.dtype, case.flatten()[:3])
    assert holds_nonfinite(torch.arange(4)) is False  # integers hold no NaN or inf
