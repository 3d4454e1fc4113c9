"""diffusers models (DiT, SD3, Flux, UNet2DCondition) through the builder, on 2 gloo ranks and
both backends, compared with diffusers itself: ``Model.from_config(config)`` built on meta
against ``Model(**config)`` (drawn states of eager's spread, the sincos positional embeddings
exact), ``save_pretrained`` folders (one file and indexed) against ``from_pretrained``, two SGD
steps against one process, and the export against ``from_pretrained`` of it. Tiny configs; no
hub access.

One spawn runs every scenario (see ``isolated``). ``python tests/test_diffusers.py OUT.md``
runs the same scenarios and checks and writes the family x backend x job table.
"""

from __future__ import annotations

import functools
import math
import sys
import tempfile
from collections.abc import Callable, Hashable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from isolated import Results, Spawns, run_each, values
from models import one_thread
from torch import nn

pytest.importorskip("diffusers", reason="diffusers is part of the test extra")
import diffusers
from helpers import full_state_dict

from fsdp_builder import (
    ConfigurationError,
    FromCheckpoint,
    FSDPBuilder,
    FullyShardBuilder,
    ShardingBuilder,
    save_hf_checkpoint,
)
from fsdp_builder.planning.ignored import clean_name

pytestmark = pytest.mark.timeout(420)

CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "dit": (
        "DiTTransformer2DModel",
        {
            "num_attention_heads": 2,
            "attention_head_dim": 8,
            "in_channels": 4,
            "out_channels": 8,
            "num_layers": 2,
            "sample_size": 8,
            "patch_size": 2,
            "num_embeds_ada_norm": 10,
            "norm_num_groups": 2,
        },
    ),
    "sd3": (
        "SD3Transformer2DModel",
        {
            "sample_size": 8,
            "patch_size": 2,
            "in_channels": 4,
            "num_layers": 2,
            "attention_head_dim": 8,
            "num_attention_heads": 2,
            "joint_attention_dim": 16,
            "caption_projection_dim": 16,
            "pooled_projection_dim": 16,
            "out_channels": 4,
            "pos_embed_max_size": 16,
        },
    ),
    "flux": (
        "FluxTransformer2DModel",
        {
            "patch_size": 1,
            "in_channels": 8,
            "num_layers": 1,
            "num_single_layers": 1,
            "attention_head_dim": 8,
            "num_attention_heads": 2,
            "joint_attention_dim": 16,
            "pooled_projection_dim": 16,
            "axes_dims_rope": (2, 2, 4),
        },
    ),
    "unet": (
        "UNet2DConditionModel",
        {
            "sample_size": 8,
            "in_channels": 4,
            "out_channels": 4,
            "block_out_channels": (8, 16),
            "layers_per_block": 1,
            "down_block_types": ("CrossAttnDownBlock2D", "DownBlock2D"),
            "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D"),
            "cross_attention_dim": 16,
            "attention_head_dim": 4,
            "norm_num_groups": 4,
        },
    ),
}
FAMILIES = list(CONFIGS)
# The units diffusers' own rule gives: _no_split_modules where declared, DiT's transformer
# blocks (it declares none).
UNIT_CLASSES = {
    "dit": {"BasicTransformerBlock"},
    "sd3": {"JointTransformerBlock"},
    "flux": {"FluxTransformerBlock", "FluxSingleTransformerBlock"},
    "unet": {"BasicTransformerBlock", "ResnetBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"},
}
BACKENDS: dict[str, Callable[[], ShardingBuilder]] = {
    "fsdp1": FSDPBuilder,
    "fsdp2": FullyShardBuilder,
}
SEEDS = [0, 1, 2, 3]
# Eager's spread from more seeds than the builds': its construction costs little.
REF_SEEDS = list(range(16))
STEPS = 2
LR = 0.1
# FSDP2's export in several files (an index), FSDP1's in one.
EXPORT_SHARD_BYTES = {"fsdp1": 5 * 10**9, "fsdp2": 30_000}


def model_class(family: str) -> Any:
    return getattr(diffusers, CONFIGS[family][0])


def make(family: str, how: str = "meta") -> nn.Module:
    """``how``: "meta" (``from_config`` under ``torch.device("meta")``), "empty_weights"
    (accelerate's ``init_empty_weights``: parameters on meta, buffers real) or "eager"."""
    cls, config = model_class(family), CONFIGS[family][1]
    if how == "meta":
        with torch.device("meta"):
            return cls.from_config(config)
    if how == "empty_weights":
        from accelerate import init_empty_weights

        with init_empty_weights():
            return cls.from_config(config)
    return cls(**config)


def inputs(family: str) -> dict[str, Any]:
    """A fixed batch of two (the same on every rank)."""
    g = torch.Generator().manual_seed(5)
    if family == "flux":
        ids = torch.zeros(16, 3)
        ids[:, 1], ids[:, 2] = torch.arange(16) // 4, torch.arange(16) % 4
        return {
            "hidden_states": torch.randn(2, 16, 8, generator=g),
            "encoder_hidden_states": torch.randn(2, 5, 16, generator=g),
            "pooled_projections": torch.randn(2, 16, generator=g),
            "timestep": torch.tensor([0.5, 0.25]),
            "img_ids": ids,
            "txt_ids": torch.zeros(5, 3),
        }
    latents = torch.randn(2, 4, 8, 8, generator=g)
    timestep = torch.tensor([10, 500])
    if family == "dit":
        return {
            "hidden_states": latents,
            "timestep": timestep,
            "class_labels": torch.tensor([1, 7]),
        }
    if family == "sd3":
        return {
            "hidden_states": latents,
            "timestep": timestep,
            "encoder_hidden_states": torch.randn(2, 5, 16, generator=g),
            "pooled_projections": torch.randn(2, 16, generator=g),
        }
    return {
        "sample": latents,
        "timestep": timestep,
        "encoder_hidden_states": torch.randn(2, 5, 16, generator=g),
    }


def buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every buffer by its clean name (persistent or not), on the CPU."""
    return {clean_name(n): b.detach().cpu().clone() for n, b in model.named_buffers()}


def train(model: nn.Module, family: str) -> list[float]:
    """``STEPS`` SGD steps of a mean-squared error against a fixed target. In eval mode, as
    ``from_pretrained`` returns a model: DiT's label embedding drops labels at random in
    training mode (classifier-free guidance), which no two processes would draw alike."""
    model.eval()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    batch = inputs(family)
    losses = []
    for _ in range(STEPS):
        out = model(**batch).sample
        target = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
        loss = torch.nn.functional.mse_loss(out, target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


# -- the ranks ---------------------------------------------------------------------------------


def init_case(family: str, backend: str, how: str, seed: int) -> dict[str, Any] | None:
    """A build with no .wrap and no .materialize: the model's own init, seeded as eager is."""
    torch.manual_seed(seed)
    builder = BACKENDS[backend]()
    sharded = builder.build(make(family, how))
    assert builder.plan is not None
    out = {
        "state": full_state_dict(sharded),
        "buffers": buffers(sharded),
        "units": [u.label for u in builder.plan],
    }
    return out if dist.get_rank() == 0 else None


def load_case(family: str, backend: str, folder: str) -> dict[str, Any] | None:
    model = make(family)
    if folder.endswith("-bf16"):
        model = model.to(torch.bfloat16)
    sharded = BACKENDS[backend]().materialize(FromCheckpoint(folder)).build(model)
    out = {"state": full_state_dict(sharded), "buffers": buffers(sharded)}
    return out if dist.get_rank() == 0 else None


def train_export_case(family: str, backend: str, folder: str) -> dict[str, Any]:
    """Loaded from ``folder``, trained ``STEPS`` steps, exported to ``exported(folder, ...)``."""
    sharded = BACKENDS[backend]().materialize(FromCheckpoint(folder)).build(make(family))
    losses = train(sharded, family)
    state = full_state_dict(sharded)
    export = save_hf_checkpoint(
        sharded, exported(folder, backend), max_shard_bytes=EXPORT_SHARD_BYTES[backend]
    )
    return {"losses": losses, "state": state, "files": export.files}


def exported(folder: str, backend: str) -> str:
    return f"{folder}-export-{backend}"


def cases(folders: dict[str, str]) -> Iterator[tuple[Hashable, Callable[[], Any]]]:
    for backend in BACKENDS:
        for family in FAMILIES:
            for how in ("meta", "empty_weights"):
                for seed in SEEDS:
                    key = (how, family, backend, seed)
                    yield key, partial(init_case, family, backend, how, seed)
            for kind in ("single", "sharded", "bf16"):
                folder = folders[f"{family}-{kind}"]
                yield ("load", family, backend, kind), partial(load_case, family, backend, folder)
            folder = folders[f"{family}-single"]
            yield ("train", family, backend), partial(train_export_case, family, backend, folder)


def scenarios(folders: dict[str, str]) -> Results:
    return run_each(cases(folders))


SPAWNS = Spawns(scenarios, timeout=400)


def save_folders(root: Path) -> dict[str, str]:
    """``save_pretrained`` folders of each family: one file, several with an index, and one
    bfloat16 file."""
    out = {}
    for family in FAMILIES:
        torch.manual_seed(3)
        model: Any = make(family, "eager")
        for kind, size in (("single", "10GB"), ("sharded", "20KB")):
            model.save_pretrained(root / f"{family}-{kind}", max_shard_size=size)
            out[f"{family}-{kind}"] = str(root / f"{family}-{kind}")
        model.to(torch.bfloat16).save_pretrained(root / f"{family}-bf16")
        out[f"{family}-bf16"] = str(root / f"{family}-bf16")
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return save_folders(tmp_path_factory.mktemp("diffusers"))


def ranks(folders: dict[str, str], key: Hashable) -> list[Any]:
    return values(SPAWNS(2, folders), key)


# -- the checks (shared by the tests and the table) --------------------------------------------


@functools.cache
def eager(family: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return make(family, "eager")


def check_like_eager(family: str, states: list[dict[str, torch.Tensor]]) -> None:
    """Per state, the values of all ``states`` pooled: their std within four standard errors
    (of a std of that many values, with eager's kurtosis) of eager's, pooled over
    ``REF_SEEDS``; deterministic states (constants, positional embeddings) exactly eager's;
    different seeds give different draws."""
    refs = [eager(family, s).state_dict() for s in REF_SEEDS]
    assert set(states[0]) == set(refs[0]), set(states[0]) ^ set(refs[0])
    for name in sorted(refs[0]):
        ref = [r[name] for r in refs]
        got = [s[name] for s in states]
        assert got[0].shape == ref[0].shape and got[0].dtype == ref[0].dtype, name
        assert all(bool(torch.isfinite(g).all()) for g in got), f"{family} {name}: not finite"
        if all(torch.equal(r, ref[0]) for r in ref):  # deterministic: a constant, pos_embed
            for g in got:
                assert torch.equal(g, ref[0]), f"{family} {name}: differs from eager's"
            continue
        pooled = torch.cat([r.flatten() for r in ref]).double()
        ref_std = float(pooled.std())
        kurtosis = float(((pooled - pooled.mean()) ** 4).mean()) / ref_std**4
        drawn = torch.cat([g.flatten() for g in got]).double()
        tolerance = max(0.03, 4 * math.sqrt((kurtosis - 1) / (4 * drawn.numel())))
        got_std = float(drawn.std())
        assert abs(got_std / ref_std - 1) <= tolerance, (
            f"{family} {name}: std {got_std} vs eager's {ref_std} (tolerance {tolerance:.2f})"
        )
        assert not torch.equal(got[0], got[1]), f"{family} {name}: the same for two seeds"


def check_init(family: str, results: list[dict[str, Any]]) -> None:
    check_like_eager(family, [r["state"] for r in results])
    # Every buffer (DiT's non-persistent pos_embed too) is eager's, exactly.
    want = dict(eager(family, 0).named_buffers())
    for r in results:
        assert set(r["buffers"]) == set(want)
        for name, value in want.items():
            assert torch.equal(r["buffers"][name], value), f"{family}: buffer {name} differs"
    model = eager(family, 0)
    units = {type(model.get_submodule(u)).__name__ for u in results[0]["units"] if u != "<root>"}
    assert units == UNIT_CLASSES[family], units


def check_load(family: str, folder: str, got: dict[str, Any]) -> None:
    dtype = torch.bfloat16 if folder.endswith("-bf16") else torch.float32
    reference = model_class(family).from_pretrained(folder, torch_dtype=dtype)
    want = reference.state_dict()
    assert set(got["state"]) == set(want)
    for name, value in want.items():
        assert torch.equal(got["state"][name], value), f"{family} {name}: differs"
    for name, value in reference.named_buffers():
        # A buffer has the built model's dtype (from_pretrained(torch_dtype=...) leaves DiT's
        # non-persistent pos_embed in float32, model.to(torch.bfloat16) casts it).
        buffer = got["buffers"][name]
        assert buffer.dtype == (value.dtype if name in want else dtype), name
        assert torch.equal(buffer, value.to(buffer.dtype)), f"{family}: buffer {name} differs"


@functools.cache
def one_process(family: str, folder: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """``STEPS`` steps of the ``from_pretrained`` model in this process, on one thread as a
    rank computes."""
    model = model_class(family).from_pretrained(folder)
    with one_thread():
        losses = train(model, family)
    return losses, {n: t.detach().clone() for n, t in model.state_dict().items()}


def check_train(family: str, folder: str, got: dict[str, Any]) -> None:
    want_losses, want_state = one_process(family, folder)
    assert got["losses"] == pytest.approx(want_losses, rel=1e-5, abs=1e-7)
    assert got["losses"][1] < got["losses"][0], "the loss did not go down"
    for name, value in want_state.items():
        assert torch.allclose(got["state"][name], value, rtol=1e-5, atol=1e-6), name


def check_export(family: str, folder: str, backend: str, got: dict[str, Any]) -> None:
    """The export holds diffusers' file names and config.json; from_pretrained loads it
    bit-equal to the trained model."""
    out = Path(exported(folder, backend))
    names = {p.name for p in out.iterdir()}
    files = tuple(got["files"])
    if backend == "fsdp1":
        assert files == ("diffusion_pytorch_model.safetensors",), files
        assert names == {"diffusion_pytorch_model.safetensors", "config.json"}, names
    else:
        assert len(files) > 1 and all(f.startswith("diffusion_pytorch_model-") for f in files)
        assert names == {*files, "diffusion_pytorch_model.safetensors.index.json", "config.json"}
    again = model_class(family).from_pretrained(out).state_dict()
    assert set(again) == set(got["state"])
    for name, value in got["state"].items():
        assert torch.equal(again[name], value), f"{family} {name}: from_pretrained differs"


# -- the tests ---------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["meta", "empty_weights"])
@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("family", FAMILIES)
def test_a_diffusers_model_built_without_weights_is_like_model_config(
    folders: dict[str, str], family: str, backend: str, how: str
) -> None:
    check_init(family, [ranks(folders, (how, family, backend, s))[0] for s in SEEDS])


@pytest.mark.parametrize("kind", ["single", "sharded", "bf16"])
@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("family", FAMILIES)
def test_a_save_pretrained_folder_loads_bit_equal_to_from_pretrained(
    folders: dict[str, str], family: str, backend: str, kind: str
) -> None:
    folder = folders[f"{family}-{kind}"]
    if kind == "sharded":
        assert (Path(folder) / "diffusion_pytorch_model.safetensors.index.json").is_file()
    check_load(family, folder, ranks(folders, ("load", family, backend, kind))[0])


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("family", FAMILIES)
def test_two_sgd_steps_are_one_process_steps(
    folders: dict[str, str], family: str, backend: str
) -> None:
    for got in ranks(folders, ("train", family, backend)):
        assert got["losses"] == ranks(folders, ("train", family, backend))[0]["losses"]
    check_train(family, folders[f"{family}-single"], ranks(folders, ("train", family, backend))[0])


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("family", FAMILIES)
def test_the_export_loads_in_from_pretrained_bit_equal(
    folders: dict[str, str], family: str, backend: str
) -> None:
    folder = folders[f"{family}-single"]
    check_export(family, folder, backend, ranks(folders, ("train", family, backend))[0])


def test_a_dit_is_not_one_unit_and_is_not_warned_about(
    world1: None, recwarn: pytest.WarningsRecorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DiT declares no _no_split_modules: its transformer blocks are units all the same, but
    the first, whose embedding DiT's forward calls for its output, stays with the root."""
    from fsdp_builder.planning import wrap

    monkeypatch.setattr(wrap, "ONE_UNIT_WARNING_BYTES", 0)  # a one-unit model would be warned
    assert model_class("dit")._no_split_modules is None
    builder = FullyShardBuilder()
    model = builder.build(make("dit", "meta"))
    assert builder.plan is not None
    assert [u.label for u in builder.plan] == ["transformer_blocks.1", "<root>"]
    assert not [w for w in recwarn if "shard unit" in str(w.message)]
    with torch.no_grad():
        out = model(**inputs("dit")).sample  # runs: block 0's embedding is gathered with the root
    assert out.shape == (2, 8, 8, 8)


def test_a_folder_with_variants_loads_the_weights_from_pretrained_loads(
    world1: None, tmp_path: Path
) -> None:
    """``save_pretrained(variant="fp16")`` beside the plain weights: from_pretrained(folder)
    reads the plain file, and so does FromCheckpoint(folder)."""
    torch.manual_seed(4)
    model: Any = make("sd3", "eager")
    model.save_pretrained(tmp_path)
    torch.manual_seed(5)
    make("sd3", "eager").to(torch.float16).save_pretrained(tmp_path, variant="fp16")  # type: ignore[operator]
    assert (tmp_path / "diffusion_pytorch_model.fp16.safetensors").is_file()
    want = model_class("sd3").from_pretrained(tmp_path).state_dict()
    got = full_state_dict(
        FullyShardBuilder().materialize(FromCheckpoint(tmp_path)).build(make("sd3"))
    )
    assert set(got) == set(want)
    for name, value in want.items():
        assert torch.equal(got[name], value), name


def test_a_pipeline_folder_is_refused_naming_its_model_folders(
    world1: None, tmp_path: Path
) -> None:
    """The folder of a whole pipeline holds each model in a folder of its own."""
    make("flux", "eager").save_pretrained(tmp_path / "transformer")  # type: ignore[operator]
    (tmp_path / "model_index.json").write_text("{}")
    with pytest.raises(ConfigurationError, match=r"pass one of them, e.g. '.*transformer'"):
        FullyShardBuilder().materialize(FromCheckpoint(tmp_path)).build(make("flux"))


def test_a_dit_of_one_block_is_one_unit_with_the_warning(
    world1: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its one block stays with the root: nothing is left to be a unit, which is said."""
    from fsdp_builder.planning import wrap

    monkeypatch.setattr(wrap, "ONE_UNIT_WARNING_BYTES", 0)
    with torch.device("meta"):
        model = model_class("dit").from_config({**CONFIGS["dit"][1], "num_layers": 1})
    builder = FullyShardBuilder()
    with pytest.warns(UserWarning, match="the whole model is one shard unit"):
        builder.build(model)
    assert builder.plan is not None and [u.label for u in builder.plan] == ["<root>"]


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_wrapping_dits_first_block_is_refused_and_the_fix_builds(
    world1: None, backend: str
) -> None:
    """``.wrap(BasicTransformerBlock)`` would make the block whose embedding DiT's forward
    calls a unit; the refusal names it, and the predicate it suggests builds and runs."""
    from diffusers.models.attention import BasicTransformerBlock

    model = make("dit")
    before = {n: type(m) for n, m in model.named_modules()}
    with pytest.raises(ConfigurationError, match=r"transformer_blocks\.0") as refused:
        BACKENDS[backend]().wrap(BasicTransformerBlock).build(model)
    assert "fqn != 'transformer_blocks.0'" in str(refused.value)
    assert {n: type(m) for n, m in model.named_modules()} == before
    builder = BACKENDS[backend]().wrap(
        lambda module, fqn: (
            isinstance(module, BasicTransformerBlock) and fqn != "transformer_blocks.0"
        )
    )
    built = builder.build(model)
    assert builder.plan is not None
    assert [u.label for u in builder.plan] == ["transformer_blocks.1", "<root>"]
    with torch.no_grad():
        assert built(**inputs("dit")).sample.shape == (2, 8, 8, 8)


def _embedding(name: str) -> nn.Module:
    """A small diffusers embedding module whose constructor computes a buffer."""
    from diffusers.models import embeddings as e

    made: dict[str, Callable[[], nn.Module]] = {
        "patch": lambda: e.PatchEmbed(height=12, width=8, patch_size=2, embed_dim=16),
        "patch_interpolated": lambda: e.PatchEmbed(
            height=8, width=8, patch_size=2, embed_dim=16, interpolation_scale=2
        ),
        "patch_max_size": lambda: e.PatchEmbed(
            height=8, width=8, patch_size=2, embed_dim=16, pos_embed_max_size=6
        ),
        "cogview3": lambda: e.CogView3PlusPatchEmbed(
            in_channels=4, hidden_size=16, text_hidden_size=8, pos_embed_max_size=6
        ),
        "cogvideox": lambda: e.CogVideoXPatchEmbed(
            in_channels=4,
            embed_dim=16,
            text_embed_dim=8,
            sample_width=8,
            sample_height=8,
            sample_frames=5,
            max_text_seq_length=4,
            use_learned_positional_embeddings=False,
        ),
        "sinusoidal": lambda: e.SinusoidalPositionalEmbedding(16, max_seq_length=10),
    }
    return _Holder(made[name]())


class _Holder(nn.Module):
    """An embedding and a layer with parameters to shard (fully_shard takes no ModuleDict)."""

    def __init__(self, embed: nn.Module) -> None:
        super().__init__()
        self.embed = embed
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x)


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize(
    "name",
    ["patch", "patch_interpolated", "patch_max_size", "cogview3", "cogvideox", "sinusoidal"],
)
def test_a_diffusers_embedding_on_meta_gets_its_constructors_buffer(
    world1: None, name: str, backend: str
) -> None:
    want = dict(_embedding(name).named_buffers())
    assert want and all(not b.is_meta for b in want.values())
    with torch.device("meta"):
        model = _embedding(name)
    got = buffers(BACKENDS[backend]().build(model))
    assert set(got) == set(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


# -- the table ---------------------------------------------------------------------------------

JOBS = {
    "init on meta": lambda f, b, fo, r: check_init(f, [v(r, ("meta", f, b, s)) for s in SEEDS]),
    "init under init_empty_weights": lambda f, b, fo, r: check_init(
        f, [v(r, ("empty_weights", f, b, s)) for s in SEEDS]
    ),
    "load one file": lambda f, b, fo, r: check_load(
        f, fo[f"{f}-single"], v(r, ("load", f, b, "single"))
    ),
    "load indexed": lambda f, b, fo, r: check_load(
        f, fo[f"{f}-sharded"], v(r, ("load", f, b, "sharded"))
    ),
    "load bf16": lambda f, b, fo, r: check_load(f, fo[f"{f}-bf16"], v(r, ("load", f, b, "bf16"))),
    "train 2 steps vs one process": lambda f, b, fo, r: check_train(
        f, fo[f"{f}-single"], v(r, ("train", f, b))
    ),
    "export -> from_pretrained": lambda f, b, fo, r: check_export(
        f, fo[f"{f}-single"], b, v(r, ("train", f, b))
    ),
}


def v(run: list[Results], key: Hashable) -> Any:
    """Rank 0's value of ``key``, or an AssertionError with rank 0's error."""
    outcome = run[0][key]
    if outcome.error is not None:
        raise AssertionError(outcome.error.strip().splitlines()[-1])
    return outcome.value


def write_table(out: Path) -> None:
    import test_diffusers  # the ranks import the scenarios by this module's name

    from fsdp_builder.tools.launch import run_ranks

    with tempfile.TemporaryDirectory() as root:
        folders = save_folders(Path(root))
        run = run_ranks(test_diffusers.scenarios, 2, folders, timeout=600)
        rows = []
        for family in FAMILIES:
            for backend in BACKENDS:
                for job, check in JOBS.items():
                    try:
                        check(family, backend, folders, run)
                        verdict = "pass"
                    except AssertionError as exc:
                        verdict = f"FAIL: {str(exc).splitlines()[0][:160]}"
                    rows.append(f"| {CONFIGS[family][0]} | {backend} | {job} | {verdict} |")
    versions = f"torch {torch.__version__}, diffusers {diffusers.__version__}"
    out.write_text(
        "# diffusers families: family x backend x job\n\n"
        f"Written by `python tests/test_diffusers.py {out}` ({versions}; 2 gloo ranks, tiny "
        "configs), from the scenarios and checks of `tests/test_diffusers.py`: init compared "
        "with `Model(**config)` over 4 seeds (drawn states by spread, positional embeddings "
        "and other deterministic states exactly), loads bit-equal to `from_pretrained`, 2 SGD "
        "steps against one process, the export loaded by diffusers' `from_pretrained` "
        "bit-equal to the trained model.\n\n"
        "| family | backend | job | result |\n|---|---|---|---|\n" + "\n".join(rows) + "\n"
    )


if __name__ == "__main__":
    write_table(Path(sys.argv[1]))
