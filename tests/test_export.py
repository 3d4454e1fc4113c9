"""save_hf_checkpoint: a sharded model written as an HF safetensors folder, unit by unit.

One spawn of 2 ranks runs every scenario (see ``isolated``): the docs Llama is built from a
source file with each backend, exported (model names, and HF names through a key map), written
the plain PyTorch way next to it (``get_model_state_dict(full_state_dict=True)`` then
``save_file``), and loaded back with ``FromCheckpoint`` into a new build.
"""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import json
import re
import sys
from collections.abc import Callable, Hashable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import full_state_dict
from isolated import Results, Spawns, run_each, values
from torch import nn

from fsdp_builder import (
    ConfigurationError,
    CPUDevice,
    FromCheckpoint,
    FSDPBuilder,
    FullyShardBuilder,
    save_hf_checkpoint,
)


def _load_llama() -> Any:
    path = Path(__file__).resolve().parents[1] / "docs" / "recipes" / "llama_model.py"
    spec = importlib.util.spec_from_file_location("llama_model", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("llama_model", module)
    spec.loader.exec_module(module)
    return module


llama = _load_llama()
ARGS = llama.ModelArgs(dim=32, n_layers=3, n_heads=4, vocab_size=61, multiple_of=16)
BACKENDS = ["fsdp1", "fsdp2"]
# Small enough for several files: a block holds 53 KB, the whole model 175 KB.
MAX_SHARD_BYTES = 40_000

# Model (torchtitan) names → HF names, and back (what FromCheckpoint takes).
TO_HF = [
    (r"^tok_embeddings\.", "model.embed_tokens."),
    (r"^norm\.", "model.norm."),
    (r"^output\.", "lm_head."),
    (r"^layers\.", "model.layers."),
    (r"\.attention\.w([qkvo])\.", r".self_attn.\1_proj."),
    (r"\.feed_forward\.w1\.", ".mlp.gate_proj."),
    (r"\.feed_forward\.w2\.", ".mlp.down_proj."),
    (r"\.feed_forward\.w3\.", ".mlp.up_proj."),
    (r"\.attention_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
]
FROM_HF = [
    (r"^model\.embed_tokens\.", "tok_embeddings."),
    (r"^model\.norm\.", "norm."),
    (r"^lm_head\.", "output."),
    (r"^model\.layers\.", "layers."),
    (r"\.self_attn\.([qkvo])_proj\.", r".attention.w\1."),
    (r"\.mlp\.gate_proj\.", ".feed_forward.w1."),
    (r"\.mlp\.down_proj\.", ".feed_forward.w2."),
    (r"\.mlp\.up_proj\.", ".feed_forward.w3."),
    (r"\.input_layernorm\.", ".attention_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
]


def source_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(321)
    model = llama.Transformer(ARGS)
    model.init_weights()
    with torch.no_grad():  # RMSNorm weights start at one: make them tell layers apart
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def unit_bytes() -> int:
    """The largest unit: a block, or what the root owns (embeddings, norm, output)."""
    model = llama.Transformer(ARGS)
    block = sum(p.numel() * 4 for p in model.layers["0"].parameters())
    root = sum(p.numel() * 4 for n, p in model.named_parameters() if not n.startswith("layers."))
    return max(block, root)


# -- inside the ranks ------------------------------------------------------------------------


def meta_llama() -> nn.Module:
    with torch.device("meta"):
        model = llama.Transformer(ARGS)
    model.freqs_cis = model._precompute_freqs_cis("cpu")
    return model


def build(
    backend: str, path: str, key_map: Any = None, configure: Callable[[Any], Any] | None = None
) -> nn.Module:
    kind = FSDPBuilder if backend == "fsdp1" else FullyShardBuilder
    b = kind().device(CPUDevice()).wrap(llama.TransformerBlock)
    if configure is not None:
        configure(b)
    return b.materialize(FromCheckpoint(path, key_map=key_map)).build(meta_llama())


# Options that change where and in which dtype the states live between steps.
VARIANTS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "fsdp1_use_orig_params": ("fsdp1", lambda b: b.use_orig_params(True)),
    "fsdp1_grad_op": ("fsdp1", lambda b: b.sharding("grad_op")),
    "fsdp1_bf16": ("fsdp1", lambda b: b.mixed_precision(param_dtype=torch.bfloat16)),
    "fsdp2_grad_op": ("fsdp2", lambda b: b.sharding("grad_op")),
    "fsdp2_bf16": ("fsdp2", lambda b: b.mixed_precision(param_dtype=torch.bfloat16)),
}


def variant_case(name: str, source: str, folder: str) -> tuple[str, ...]:
    """Build with the variant's option, run a forward and backward (no step: the weights stay
    the source's), export."""
    backend, configure = VARIANTS[name]
    model = build(backend, source, configure=configure)
    tokens = torch.randint(0, ARGS.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    model(tokens).float().sum().backward()
    return save_hf_checkpoint(model, folder, max_shard_bytes=MAX_SHARD_BYTES).files


def export_case(backend: str, source: str, root: str) -> dict[str, Any]:
    """Export with model names and with HF names; the plain PyTorch file; both loaded back."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    model = build(backend, source)
    plain = save_hf_checkpoint(model, f"{root}/{backend}", max_shard_bytes=MAX_SHARD_BYTES)
    hf = save_hf_checkpoint(
        model, f"{root}/{backend}_hf", key_map=TO_HF, max_shard_bytes=MAX_SHARD_BYTES
    )
    # cpu_offload=True is what a GPU job would pass; on CPU ranks torch's FSDP1 offload fails.
    options = StateDictOptions(full_state_dict=True)
    reference = get_model_state_dict(model, options=options)
    if dist.get_rank() == 0:
        tensors = {k: v.contiguous() for k, v in reference.items() if isinstance(v, torch.Tensor)}
        save_file(tensors, f"{root}/{backend}_reference.safetensors")
    dist.barrier()
    again = full_state_dict(build(backend, f"{root}/{backend}"))
    again_hf = full_state_dict(build(backend, f"{root}/{backend}_hf", key_map=FROM_HF))
    first = dist.get_rank() == 0
    return {
        "plain": plain,
        "hf": hf,
        "again": again if first else None,
        "again_hf": again_hf if first else None,
    }


def collision_case(source: str, folder: str) -> tuple[str, str, bool]:
    model = build("fsdp2", source)
    try:
        save_hf_checkpoint(model, folder, key_map=lambda name: "same")
    except Exception as exc:
        return type(exc).__name__, str(exc), any(Path(folder).iterdir())
    raise AssertionError("no error")


def dropped_case(source: str, folder: str) -> list[str]:
    """A key_map returning None leaves the state out."""
    model = build("fsdp1", source)
    drop = partial(re.sub, r"^output\..*", "")

    def mapping(name: str) -> str | None:
        return drop(name) or None

    return list(save_hf_checkpoint(model, folder, key_map=mapping).files)


def unwrapped_root_case(folder: str) -> dict[str, torch.Tensor]:
    """FSDP1 applied by hand to one child: the root's other child is in no unit."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3), nn.BatchNorm1d(3))
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model[0] = FullyShardedDataParallel(model[0], device_id=torch.device("cpu"))
    save_hf_checkpoint(model, folder)
    return want


def _raise(error: BaseException) -> Callable[..., Any]:
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise error

    return fail


FAILURES = [
    "existing file",
    "under a file",
    "unwritable",
    "disk full",
    "index write fails",
    "meta model",
    "key_map raises",
    "key_map returns a number",
]


def failure_case(root: str, source: str) -> dict[str, dict[str, Any]]:
    """Each way an export can fail, on the same built model: what every rank raised and the
    files left behind."""
    from unittest import mock

    import fsdp_builder.export as export

    model = build("fsdp2", source)
    out: dict[str, dict[str, Any]] = {}
    for kind in FAILURES:
        folder = Path(root) / "failures" / kind.replace(" ", "_")
        target: Path = folder
        key_map: Any = None
        patch: Any = contextlib.nullcontext()
        if dist.get_rank() == 0:
            folder.parent.mkdir(exist_ok=True)
            if kind in ("existing file", "under a file"):
                folder.write_text("the user's notes\n")
        dist.barrier()  # the file exists before any rank looks
        if kind == "under a file":
            target = folder / "export"
        elif kind == "unwritable":
            denied = PermissionError(errno.EACCES, "Permission denied", str(folder))
            patch = mock.patch("safetensors.torch.save_file", _raise(denied))
        elif kind == "disk full":
            full = OSError(errno.ENOSPC, "No space left on device", str(folder))
            patch = mock.patch("safetensors.torch.save_file", _raise(full))
        elif kind == "index write fails":
            full = OSError(errno.ENOSPC, "No space left on device", str(folder))
            patch = mock.patch.object(export, "_write_index", _raise(full))
        elif kind == "key_map raises":
            key_map = {}.__getitem__
        elif kind == "key_map returns a number":
            key_map = len
        exported = meta_llama() if kind == "meta model" else model
        try:
            with patch:
                save_hf_checkpoint(exported, target, key_map=key_map, max_shard_bytes=20_000)
            out[kind] = {"type": None}
            continue
        except Exception as exc:
            out[kind] = {
                "type": type(exc).__name__,
                "message": str(exc),
                "cause": type(exc.__cause__).__name__,
            }
        dist.barrier()  # rank 0 removed its files before anyone looks
        out[kind]["left"] = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
        out[kind]["file"] = folder.read_text() if folder.is_file() else None
    return out


def cases(source: str, root: str) -> Iterator[tuple[Hashable, Callable[[], Any]]]:
    for backend in BACKENDS:
        yield ("export", backend), partial(export_case, backend, source, root)
    for name in VARIANTS:
        yield ("variant", name), partial(variant_case, name, source, f"{root}/{name}")
    yield "unwrapped_root", partial(unwrapped_root_case, f"{root}/unwrapped_root")
    yield "collision", partial(collision_case, source, f"{root}/collision")
    yield "dropped", partial(dropped_case, source, f"{root}/dropped")
    yield "failures", partial(failure_case, root, source)


def scenarios(source: str, root: str) -> Results:
    return run_each(cases(source, root))


# -- the test process -------------------------------------------------------------------------

SPAWNS = Spawns(scenarios, timeout=300)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("export")
    save_file(source_state(), str(folder / "source.safetensors"))
    return folder


def scenario(root: Path, key: Hashable) -> list[Any]:
    return values(SPAWNS(2, str(root / "source.safetensors"), str(root)), key)


def read_folder(folder: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, int]]:
    """The index, every tensor, and each file's tensor bytes."""
    from safetensors.torch import load_file

    if (folder / "model.safetensors").exists():  # one file, no index (as save_pretrained)
        assert not (folder / "model.safetensors.index.json").exists()
        single = load_file(str(folder / "model.safetensors"))
        size = sum(t.numel() * t.element_size() for t in single.values())
        return {}, single, {"model.safetensors": size}
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    sizes: dict[str, int] = {}
    for name in sorted(set(index["weight_map"].values())):
        part = load_file(str(folder / name))
        assert {k for k, v in index["weight_map"].items() if v == name} == part.keys()
        tensors.update(part)
        sizes[name] = sum(t.numel() * t.element_size() for t in part.values())
    return index, tensors, sizes


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: Any) -> None:
    assert got.keys() == want.keys(), what
    for k in want:
        assert got[k].dtype == want[k].dtype, (what, k)
        assert torch.equal(got[k], want[k]), (what, k)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_export_loads_back_bit_exact(root: Path, backend: str) -> None:
    ranks = scenario(root, ("export", backend))
    want = source_state()
    assert_same(ranks[0]["again"], want, backend)
    assert_same(ranks[0]["again_hf"], want, backend)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_files_match_the_plain_pytorch_export(root: Path, backend: str) -> None:
    from safetensors.torch import load_file

    ranks = scenario(root, ("export", backend))
    reference = load_file(str(root / f"{backend}_reference.safetensors"))
    index, tensors, sizes = read_folder(root / backend)
    assert_same(tensors, reference, backend)
    assert index["metadata"]["total_size"] == sum(sizes.values())
    assert ranks[0]["plain"].total_size == sum(sizes.values())
    count = len(sizes)
    assert count >= 4, sizes
    assert list(sizes) == [f"model-{k:05d}-of-{count:05d}.safetensors" for k in range(1, count + 1)]
    assert all(size <= MAX_SHARD_BYTES for size in sizes.values()), sizes
    for rank in ranks:
        assert rank["plain"].files == tuple(sizes)
    assert {p.name for p in (root / backend).iterdir()} == {*sizes, "model.safetensors.index.json"}

    hf_index, hf_tensors, _ = read_folder(root / f"{backend}_hf")
    assert "model.layers.2.self_attn.q_proj.weight" in hf_index["weight_map"]
    assert "lm_head.weight" in hf_index["weight_map"]
    back = {re.sub(r"^model\.", "", k): v for k, v in hf_tensors.items()}
    assert len(back) == len(reference) and "freqs_cis" not in hf_tensors


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_rank0_holds_one_unit_and_one_file_buffer(root: Path, backend: str) -> None:
    ranks = scenario(root, ("export", backend))
    total = ranks[0]["plain"].total_size
    bound = unit_bytes() + MAX_SHARD_BYTES
    assert bound < total  # the bound means something: less than the whole model
    assert 0 < ranks[0]["plain"].peak_bytes <= bound, (ranks[0]["plain"], bound)
    assert ranks[1]["plain"].peak_bytes == 0


@pytest.mark.timeout(600)
def test_two_names_mapped_to_one_fail_on_every_rank_and_leave_no_file(root: Path) -> None:
    ranks = scenario(root, "collision")
    for kind, message, left in ranks:
        assert kind == ConfigurationError.__name__
        assert "to 'same'" in message and not left, message
    assert ranks[0][:2] == ranks[1][:2]


@pytest.mark.timeout(600)
def test_key_map_none_leaves_a_state_out(root: Path) -> None:
    (files,) = set(map(tuple, scenario(root, "dropped")))
    _, tensors, _ = read_folder(root / "dropped")
    assert files == ("model.safetensors",)
    assert "output.weight" not in tensors and "tok_embeddings.weight" in tensors


def test_bad_arguments_are_refused_before_any_collective(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="max_shard_bytes"):
        save_hf_checkpoint(nn.Linear(2, 2), tmp_path, max_shard_bytes=0)
    with pytest.raises(ConfigurationError, match="key_map"):
        save_hf_checkpoint(nn.Linear(2, 2), tmp_path, key_map=3)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="not a regex"):
        save_hf_checkpoint(nn.Linear(2, 2), tmp_path, key_map=[("(", "")])


def test_a_plain_module_without_a_process_group(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    out = save_hf_checkpoint(model, tmp_path, key_map={"0.weight": "first.weight"})
    _, tensors, _ = read_folder(tmp_path)
    want = {("first.weight" if k == "0.weight" else k): v for k, v in model.state_dict().items()}
    assert_same(tensors, want, "plain")
    assert out.files == ("model.safetensors",)
    assert {p.name for p in tmp_path.iterdir()} == {"model.safetensors"}


def test_one_file_or_several_replaces_what_an_earlier_export_wrote(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8))
    want = model.state_dict()
    several = save_hf_checkpoint(model, tmp_path, max_shard_bytes=300).files
    assert len(several) > 1 and "model.safetensors" not in several
    assert {p.name for p in tmp_path.iterdir()} == {*several, "model.safetensors.index.json"}
    assert_same(read_folder(tmp_path)[1], want, "several")
    # One file now: the earlier shards and index go (an index left behind would be read first).
    assert save_hf_checkpoint(model, tmp_path).files == ("model.safetensors",)
    assert {p.name for p in tmp_path.iterdir()} == {"model.safetensors"}
    assert_same(read_folder(tmp_path)[1], want, "one")
    # And back: the single file goes.
    assert save_hf_checkpoint(model, tmp_path, max_shard_bytes=300).files == several
    assert {p.name for p in tmp_path.iterdir()} == {*several, "model.safetensors.index.json"}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_after_a_step_with_other_options(root: Path, variant: str) -> None:
    files = scenario(root, ("variant", variant))
    _, tensors, _ = read_folder(root / variant)
    written = tuple(sorted(p.name for p in (root / variant).glob("*.safetensors")))
    assert files[0] == files[1] == written
    assert_same(tensors, source_state(), variant)  # full precision, not the compute dtype


@pytest.mark.timeout(600)
def test_fsdp1_states_outside_every_unit_are_written(root: Path) -> None:
    want = scenario(root, "unwrapped_root")[0]
    _, tensors, _ = read_folder(root / "unwrapped_root")
    assert_same(tensors, want, "unwrapped root")


# The error every rank raises, the cause rank 0 keeps, and words of the message: what was wrong
# and the fix.
EXPECTED = {
    "existing file": ("ExportError", "FileExistsError", "it is a file, not a folder"),
    "under a file": ("ExportError", "NotADirectoryError", "Pass a folder path"),
    "unwritable": ("ExportError", "PermissionError", "no permission to write there"),
    "disk full": ("ExportError", "OSError", "the disk is full.*Free space"),
    "index write fails": ("ExportError", "OSError", "the disk is full.*were removed"),
    "meta model": ("ConfigurationError", "NoneType", "meta device.*builder.build"),
    "key_map raises": ("ConfigurationError", "KeyError", "`key_map`: raised KeyError"),
    "key_map returns a number": ("ConfigurationError", "NoneType", r"returned \d+ \(int\).*a str"),
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", FAILURES)
def test_a_failed_export_raises_one_library_error_everywhere_and_removes_its_files(
    root: Path, kind: str
) -> None:
    ranks = [rank[kind] for rank in scenario(root, "failures")]
    kind_name, cause, words = EXPECTED[kind]
    for rank in ranks:
        assert rank["type"] == kind_name, rank
        assert re.search(words, rank["message"], re.S), rank["message"]
        assert rank["left"] == [], rank  # every file it wrote removed, nothing else there
    assert ranks[0]["message"] == ranks[1]["message"]
    # Rank 0 raises its own error with its cause; the other ranks get rank 0's message through
    # the agreement (as every rank-0 failure of a build reaches them), and the message names it.
    assert ranks[0]["cause"] == cause, ranks[0]
    assert ranks[1]["cause"] == "NoneType", ranks[1]
    if cause != "NoneType":
        assert cause in ranks[1]["message"], ranks[1]["message"]
    if kind in ("existing file", "under a file"):
        assert ranks[0]["file"] == "the user's notes\n"  # the user's file is left alone
