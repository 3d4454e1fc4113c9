"""Ignored parameters (``ignore(states=[param])``) on both backends, with CLIP's scalar
``logit_scale`` (which neither backend can shard): what a build on meta gives them, what it
gives the rest of the ignoring module, and what a checkpoint load writes into them. The
expected values come from transformers: ``CLIPModel(config)`` and ``from_pretrained``."""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from isolated import Results, Spawns, run_each, values
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel
from transformers import CLIPConfig, CLIPModel
from transformers.models.clip.modeling_clip import CLIPEncoderLayer

from fsdp_builder import (
    ConfigurationError,
    CPUDevice,
    DeterministicInit,
    FromCheckpoint,
    FromStateDict,
    FSDPBuilder,
    FullyShardBuilder,
    InitFn,
    KeepAsIs,
    MaterializationError,
)

BACKENDS = ("fsdp1", "fsdp2")
# Not the config's default (log(1/0.07) = 2.6592): a value left unloaded is seen.
SAVED_SCALE = 1.2345
PROJECTION = ("visual_projection.weight", "text_projection.weight")


def config() -> CLIPConfig:
    return CLIPConfig(
        text_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "vocab_size": 64,
            "max_position_embeddings": 16,
            "bos_token_id": 0,
            "eos_token_id": 1,
            "pad_token_id": 1,
        },
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": 8,
            "patch_size": 4,
        },
        # 64 x 32 = 2048 draws per projection: its standard deviation is known to about 1.6 %.
        projection_dim=64,
    )


def on_meta(how: str) -> CLIPModel:
    if how == "accelerate":
        from accelerate import init_empty_weights

        with init_empty_weights():
            return CLIPModel(config())
    with torch.device("meta"):
        return CLIPModel(config())


def builder(backend: str) -> Any:
    made = FSDPBuilder() if backend == "fsdp1" else FullyShardBuilder()
    return made.device(CPUDevice()).wrap(CLIPEncoderLayer)


def full_state(model: nn.Module, backend: str) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, whole, gathered with torch's own calls."""
    if backend == "fsdp1":
        with FullyShardedDataParallel.summon_full_params(model, writeback=False):
            named = [*model.named_parameters(), *model.named_buffers()]
            return {_clean(n): t.detach().clone() for n, t in named}
    out = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        out[name] = full.detach().clone()
    return out


def _clean(name: str) -> str:
    for prefix in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module."):
        name = name.replace(prefix, "")
    return name


def train_step(model: nn.Module) -> float:
    """One forward and backward of the contrastive loss through ``logit_scale``."""
    ids = torch.tensor([[0, 5, 7, 1], [0, 9, 3, 1]])
    pixels = torch.linspace(-1, 1, 2 * 3 * 8 * 8).view(2, 3, 8, 8)
    out = model(input_ids=ids, pixel_values=pixels, return_loss=True)
    out.loss.backward()
    return float(out.loss.detach())


def built_facts(model: nn.Module, backend: str, scale: nn.Parameter) -> dict[str, Any]:
    """What the tests check of a built model: its full state, and how it holds logit_scale."""
    state = full_state(model, backend)
    held = model.get_parameter("logit_scale")
    facts: dict[str, Any] = {
        "state": state,
        "same_object": held is scale,
        "plain": type(held) is nn.Parameter and held.dim() == 0,
        "device": str(held.device),
    }
    if backend == "fsdp1":
        assert isinstance(model, FullyShardedDataParallel)
        facts["fsdp_ignores"] = scale in model._ignored_params
    facts["loss"] = train_step(model)
    facts["grad"] = held.grad is not None
    return facts


# -- scenarios, run on every rank --------------------------------------------------------------


def init_on_meta(backend: str, how: str, materializer: Any = None) -> dict[str, Any]:
    model = on_meta(how)
    scale = model.logit_scale
    made = builder(backend).ignore(states=[scale])
    if materializer is not None:
        made = made.materialize(materializer)
    return built_facts(made.build(model), backend, scale)


def real_scale_kept(backend: str) -> dict[str, Any]:
    model = on_meta("meta")
    model.logit_scale = nn.Parameter(torch.tensor(3.5))
    scale = model.logit_scale
    return built_facts(builder(backend).ignore(states=[scale]).build(model), backend, scale)


def from_checkpoint(backend: str, folder: str, shared: bool) -> dict[str, Any]:
    model = on_meta("meta")
    scale = model.logit_scale
    made = builder(backend).ignore(states=[scale])
    made = made.materialize(FromCheckpoint(folder, shared_filesystem=shared))
    return built_facts(made.build(model), backend, scale)


def from_state_dict(backend: str, folder: str) -> dict[str, Any]:
    model = on_meta("meta")
    scale = model.logit_scale
    source = str(Path(folder) / "model.safetensors") if dist.get_rank() == 0 else None
    made = builder(backend).ignore(states=[scale]).materialize(FromStateDict(source))
    return built_facts(made.build(model), backend, scale)


def cases(folder: str) -> Iterator[tuple[Hashable, Callable[[], Any]]]:
    for backend in BACKENDS:
        yield ("init", backend, "meta"), partial(init_on_meta, backend, "meta")
        yield ("init", backend, "accelerate"), partial(init_on_meta, backend, "accelerate")
        yield ("real", backend), partial(real_scale_kept, backend)
        yield ("load", backend, True), partial(from_checkpoint, backend, folder, True)
        yield ("load", backend, False), partial(from_checkpoint, backend, folder, False)
        yield ("state_dict", backend), partial(from_state_dict, backend, folder)


def rank_main(folder: str) -> Results:
    torch.manual_seed(dist.get_rank())  # ranks draw differently: only the builder may agree
    return run_each(cases(folder))


SPAWNS = Spawns(rank_main, timeout=300)


# -- the references --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ``save_pretrained`` folder whose logit_scale is not the config's."""
    folder = tmp_path_factory.mktemp("clip")
    torch.manual_seed(7)
    model = CLIPModel(config())
    with torch.no_grad():
        model.logit_scale.fill_(SAVED_SCALE)
    model.save_pretrained(folder)
    return folder


def pretrained(folder: Path) -> dict[str, torch.Tensor]:
    model = CLIPModel.from_pretrained(folder)
    assert model.logit_scale.item() == pytest.approx(SAVED_SCALE)
    return {n: t.detach() for n, t in [*model.named_parameters(), *model.named_buffers()]}


def eager_reference() -> CLIPModel:
    torch.manual_seed(0)
    return CLIPModel(config())


def assert_projections_like_eager(state: dict[str, torch.Tensor]) -> None:
    eager = eager_reference()
    for name in PROJECTION:
        want = float(eager.get_parameter(name).detach().std())
        got = float(state[name].std())
        # Each estimate is off by about 1/sqrt(2n) of the true value; allow six of those for
        # both (the skipped model initializer gives 1.0 instead of 0.18).
        tolerance = 6 * math.sqrt(2) / math.sqrt(2 * state[name].numel())
        assert abs(got - want) <= tolerance * want, (name, got, want)


def assert_holds_it_like_torch(facts: dict[str, Any], backend: str) -> None:
    # The user's own Parameter, unsharded, on the compute device, its gradient local.
    assert facts["same_object"] and facts["plain"] and facts["device"] == "cpu"
    assert facts["grad"] and math.isfinite(facts["loss"])
    if backend == "fsdp1":
        assert facts["fsdp_ignores"]


def assert_equal_states(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    different = [n for n in want if not torch.equal(got[n], want[n].to(got[n].dtype))]
    assert not different, different


# -- two ranks -------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("how", ["meta", "accelerate"])
def test_meta_build_initializes_like_the_model(saved: Path, backend: str, how: str) -> None:
    eager = eager_reference()
    for facts in values(SPAWNS(2, str(saved)), ("init", backend, how)):
        assert torch.equal(facts["state"]["logit_scale"], eager.logit_scale.detach())
        assert_projections_like_eager(facts["state"])
        assert_holds_it_like_torch(facts, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_real_ignored_parameter_keeps_its_value(saved: Path, backend: str) -> None:
    for facts in values(SPAWNS(2, str(saved)), ("real", backend)):
        assert facts["state"]["logit_scale"].item() == 3.5
        assert_projections_like_eager(facts["state"])
        assert_holds_it_like_torch(facts, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shared", [True, False])
def test_checkpoint_load_equals_from_pretrained(saved: Path, backend: str, shared: bool) -> None:
    want = pretrained(saved)
    for facts in values(SPAWNS(2, str(saved)), ("load", backend, shared)):
        assert_equal_states(facts["state"], want)
        assert_holds_it_like_torch(facts, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_state_dict_load_writes_the_ignored_parameter(saved: Path, backend: str) -> None:
    want = pretrained(saved)
    for facts in values(SPAWNS(2, str(saved)), ("state_dict", backend)):
        assert_equal_states(facts["state"], want)
        assert_holds_it_like_torch(facts, backend)


# -- one rank --------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_rank_meta_build_and_load(world1: None, saved: Path, backend: str) -> None:
    eager = eager_reference()
    facts = init_on_meta(backend, "accelerate")
    assert torch.equal(facts["state"]["logit_scale"], eager.logit_scale.detach())
    assert_projections_like_eager(facts["state"])
    assert_holds_it_like_torch(facts, backend)
    loaded = from_checkpoint(backend, str(saved), True)
    assert_equal_states(loaded["state"], pretrained(saved))


def test_one_rank_deterministic_init(world1: None) -> None:
    facts = init_on_meta("fsdp1", "meta", DeterministicInit(seed=3))
    assert torch.equal(facts["state"]["logit_scale"], eager_reference().logit_scale.detach())
    assert_projections_like_eager(facts["state"])
    assert_holds_it_like_torch(facts, "fsdp1")


def test_a_missing_ignored_key_is_refused_by_name(world1: None, tmp_path: Path) -> None:
    import safetensors.torch

    state = {k: v for k, v in CLIPModel(config()).state_dict().items() if k != "logit_scale"}
    safetensors.torch.save_file(state, tmp_path / "model.safetensors")
    model = on_meta("meta")
    made = builder("fsdp2").ignore(states=[model.logit_scale])
    with pytest.raises(ConfigurationError, match=r"FromCheckpoint.*missing key.*logit_scale"):
        made.materialize(FromCheckpoint(tmp_path)).build(model)


def test_keep_as_is_refuses_an_ignored_parameter_on_meta(world1: None) -> None:
    model = CLIPModel(config())
    model.logit_scale = nn.Parameter(torch.empty((), device="meta"))
    made = builder("fsdp1").ignore(states=[model.logit_scale]).materialize(KeepAsIs())
    with pytest.raises(MaterializationError, match=r"KeepAsIs.*meta device: logit_scale\."):
        made.build(model)
    assert model.logit_scale.is_meta
    assert not any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


class Scaled(nn.Linear):
    """A plain torch module whose temperature its reset_parameters() does not set."""

    def __init__(self) -> None:
        super().__init__(4, 4)
        self.temperature = nn.Parameter(torch.tensor(0.5))


def test_an_ignored_parameter_no_initializer_sets_is_refused_by_name(world1: None) -> None:
    with torch.device("meta"):
        model = nn.Sequential(Scaled(), nn.Linear(4, 4))
    made = FullyShardBuilder().device(CPUDevice()).ignore(states=[model[0].temperature])
    with pytest.raises(MaterializationError, match=r"'0\.temperature'.*register_initializer"):
        made.build(model)


def _param_init_fn(module: nn.Module) -> None:
    """FSDP1's ``param_init_fn`` pattern, which gives the module new Parameter objects."""
    if any(t.is_meta for t in module.parameters(recurse=False)):
        module.to_empty(device="cpu", recurse=False)
        module.reset_parameters()  # type: ignore[operator]


@pytest.mark.parametrize("backend", BACKENDS)
def test_init_fn_that_replaces_the_ignored_parameter(world1: None, backend: str) -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    bias = model[0].bias
    made = FSDPBuilder() if backend == "fsdp1" else FullyShardBuilder()
    made = made.device(CPUDevice()).ignore(states=[bias]).materialize(InitFn(_param_init_fn))
    built = made.build(model)
    # FSDP ignores the object the user passed: it must hold the values, not a stray copy.
    assert model[0].bias is bias and not bias.is_meta and type(bias) is nn.Parameter
    bound = 1 / math.sqrt(4)  # nn.Linear(4, 4)'s bias bound: 1 / sqrt(in_features)
    assert bool((bias.detach().abs() <= bound).all())
    if backend == "fsdp1":
        assert isinstance(built, FullyShardedDataParallel) and bias in built._ignored_params


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loader", ["FromStateDict", "FromCheckpoint", "FromCheckpoint-rank0"])
def test_ignored_module_states_are_loaded(
    world1: None, tmp_path: Path, backend: str, loader: str
) -> None:
    import safetensors.torch

    torch.manual_seed(11)
    saved = {
        k: v.clone()
        for k, v in nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).state_dict().items()
    }
    safetensors.torch.save_file(saved, tmp_path / "model.safetensors")
    with torch.device("meta"):
        head = nn.Linear(4, 4)
        model = nn.Sequential(nn.Linear(4, 4), head)
    head.to_empty(device="cpu")  # an ignored module must be real; its values are not
    nn.init.zeros_(head.weight)
    weight = head.weight
    materializer = {
        "FromStateDict": FromStateDict(saved),
        "FromCheckpoint": FromCheckpoint(tmp_path),
        "FromCheckpoint-rank0": FromCheckpoint(tmp_path, shared_filesystem=False),
    }[loader]
    made = FSDPBuilder() if backend == "fsdp1" else FullyShardBuilder()
    made.device(CPUDevice()).ignore(modules=[head]).materialize(materializer).build(model)
    assert head.weight is weight
    assert torch.equal(head.weight.detach(), saved["1.weight"])
    assert torch.equal(head.bias.detach(), saved["1.bias"])
