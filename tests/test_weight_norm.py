"""Weight-norm models (Wav2Vec2, HuBERT: ``parametrizations.weight_norm`` on the positional
convolution) initialized on meta and under accelerate's ``init_empty_weights``, compared with
``Model(config)``: the originals ``original0`` (g) / ``original1`` (v) as construction sets them
(v the convolution's ``reset_parameters`` draw, g its norm), the bias ``_init_weights`` zeroes
exact, every other state of eager's spread. Tiny configs; no hub access."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

pytest.importorskip("transformers", reason="transformers is part of the test extra")
import transformers
from helpers import full_state_dict

from fsdp_builder import (
    FromCheckpoint,
    FSDPBuilder,
    FullyShardBuilder,
    ResetParameters,
    StreamInit,
    register_initializer,
)
from fsdp_builder.tools.launch import run_ranks

pytestmark = pytest.mark.timeout(300)

AUDIO = {
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "intermediate_size": 48,
    "conv_dim": (16, 16),
    "conv_stride": (5, 2),
    "conv_kernel": (10, 3),
    "num_conv_pos_embeddings": 16,
    "num_conv_pos_embedding_groups": 2,
    "vocab_size": 32,
}
SEEDS = [0, 1, 2, 3, 4, 5]
POS = "encoder.pos_conv_embed.conv"
G, V = "parametrizations.weight.original0", "parametrizations.weight.original1"


def _configs() -> dict[str, tuple[Any, type[nn.Module]]]:
    t: Any = transformers
    # mask_time_prob is left at its default (0.05): the model then has masked_spec_embed.
    return {
        "wav2vec2": (t.Wav2Vec2Config(**AUDIO), t.Wav2Vec2ForCTC),
        "hubert": (t.HubertConfig(**AUDIO), t.HubertModel),
    }


FAMILIES = list(_configs())


def make(family: str, how: str = "meta", **changes: Any) -> nn.Module:
    config, cls = _configs()[family]
    for name, value in changes.items():
        setattr(config, name, value)
    if how == "meta":
        with torch.device("meta"):
            return cls(config)
    if how == "empty_weights":
        from accelerate import init_empty_weights

        with init_empty_weights():
            return cls(config)
    return cls(config)


def eager(family: str, seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return make(family, "eager").state_dict()


def prefix(family: str) -> str:
    return "wav2vec2." if family == "wav2vec2" else ""


def build(family: str, backend: str, seed: int, how: str = "meta") -> dict[str, torch.Tensor]:
    model = make(family, how)
    if backend == "fsdp1":
        torch.manual_seed(seed)  # ResetParameters draws from torch's generator
        sharded = FSDPBuilder().materialize(ResetParameters()).build(model)
    else:
        sharded = FullyShardBuilder().materialize(StreamInit(seed=seed)).build(model)
    return full_state_dict(sharded)


def check_like_eager(family: str, states: list[dict[str, torch.Tensor]]) -> None:
    refs = [eager(family, s) for s in SEEDS]
    assert set(states[0]) == set(refs[0])
    conv = prefix(family) + POS
    for name in sorted(refs[0]):
        ref = [r[name] for r in refs]
        got = [s[name] for s in states]
        assert got[0].shape == ref[0].shape and got[0].dtype == ref[0].dtype, name
        for g in got:
            assert torch.isfinite(g).all(), f"{family} {name}: not finite"
        if name == f"{conv}.{G}":
            continue  # checked against v below: g is v's norm, not a draw of its own
        if all(bool((r == r.flatten()[0]).all()) for r in ref):
            for g, r in zip(got, ref, strict=True):
                assert torch.equal(g, r), f"{family} {name}: a constant differs from eager's"
            continue
        ref_std = sum(float(r.float().std()) for r in ref) / len(ref)
        got_std = sum(float(g.float().std()) for g in got) / len(got)
        assert abs(got_std / ref_std - 1) <= 0.12, f"{family} {name}: std {got_std} vs {ref_std}"
    # Construction's weight_norm: v is the convolution's reset_parameters draw (uniform within
    # 1/sqrt(fan_in)), g the norm of v over every dim but 2.
    fan_in, _ = nn.init._calculate_fan_in_and_fan_out(refs[0][f"{conv}.{V}"])
    bound = 1 / math.sqrt(fan_in)
    for state, eager_state in zip(states, refs, strict=True):
        v, g = state[f"{conv}.{V}"], state[f"{conv}.{G}"]
        assert float(v.abs().max()) <= bound and float(v.abs().max()) > 0.9 * bound
        assert torch.equal(g, torch.norm_except_dim(v, 2, 2)), f"{family}: g is not v's norm"
        eager_v, eager_g = eager_state[f"{conv}.{V}"], eager_state[f"{conv}.{G}"]
        assert torch.allclose(eager_g, torch.norm_except_dim(eager_v, 2, 2))
        assert torch.equal(state[f"{conv}.bias"], eager_state[f"{conv}.bias"])  # zero in both
    # Different seeds, different draws.
    assert not torch.equal(states[0][f"{conv}.{V}"], states[1][f"{conv}.{V}"])


@pytest.mark.parametrize("how", ["meta", "empty_weights"])
@pytest.mark.parametrize("backend", ["fsdp1", "fsdp2"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_weight_norm_model_initializes_like_eager(
    world1: None, family: str, backend: str, how: str
) -> None:
    states = [build(family, backend, seed, how) for seed in SEEDS]
    check_like_eager(family, states)


def test_the_built_model_computes_what_its_states_give_in_eager(world1: None) -> None:
    """The originals are the ones the forward uses: eager with the built states, same logits."""
    built = FullyShardBuilder().materialize(StreamInit(seed=4)).build(make("wav2vec2"))
    state = full_state_dict(built)
    reference: Any = make("wav2vec2", "eager")
    reference.load_state_dict(state)
    audio = torch.randn(1, 400, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(built.eval()(audio).logits, reference.eval()(audio).logits)


def test_a_registered_initializer_of_the_parametrized_class_sets_the_plain_value(
    world1: None,
) -> None:
    """A registered Conv1d initializer writes the plain weight; the originals follow from it."""

    def ones(module: nn.Module) -> None:
        assert isinstance(module, nn.Conv1d)
        nn.init.ones_(module.weight)
        if module.bias is not None:
            nn.init.zeros_(module.bias)

    register_initializer(nn.Conv1d, ones)
    try:
        state = build("hubert", "fsdp1", 0)
    finally:
        from fsdp_builder.materializers import conventions

        conventions._REGISTERED.pop(nn.Conv1d)
        conventions._REGISTERED_BY_TYPE.clear()
    v = state[f"{POS}.{V}"]
    assert torch.equal(v, torch.ones_like(v))
    assert torch.equal(state[f"{POS}.{G}"], torch.norm_except_dim(v, 2, 2))


def test_a_save_pretrained_folder_loads_its_originals_bit_equal(
    world1: None, tmp_path: Path
) -> None:
    torch.manual_seed(7)
    model: Any = make("wav2vec2", "eager")
    model.save_pretrained(tmp_path)
    want = type(model).from_pretrained(tmp_path).state_dict()
    for backend in (FSDPBuilder, FullyShardBuilder):
        got = full_state_dict(
            backend().materialize(FromCheckpoint(tmp_path)).build(make("wav2vec2"))
        )
        assert set(got) == set(want)
        for name, value in want.items():
            assert torch.equal(got[name], value), name


def _shard_first(family: str) -> dict[str, torch.Tensor] | None:
    """Every unit sharded before it is initialized: the originals written shard by shard."""
    builder = FullyShardBuilder().materialize(StreamInit(seed=3, whole_below=0))
    # No masking, no masked_spec_embed: it is drawn at construction even under
    # torch.device("meta") (torch.Tensor(n)), and a model not wholly on meta is not shard-first.
    state = full_state_dict(builder.build(make(family, mask_time_prob=0.0)))
    return state if dist.get_rank() == 0 else None


def test_shard_first_init_gives_the_same_originals_on_one_and_two_ranks(world1: None) -> None:
    one = _shard_first("wav2vec2")
    assert one is not None
    two: Callable[..., Any] = run_ranks
    got = two(_shard_first, 2, "wav2vec2", timeout=240)[0]
    assert set(got) == set(one)
    for name, value in one.items():
        assert torch.equal(got[name], value), f"{name} depends on the world size"
    v = one[f"wav2vec2.{POS}.{V}"]
    assert torch.equal(one[f"wav2vec2.{POS}.{G}"], torch.norm_except_dim(v, 2, 2))


class Plain(nn.Module):
    """Plain torch: a weight-norm layer with no state of its own besides the originals."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.utils.parametrizations.weight_norm(nn.Linear(8, 6, bias=False))
        self.out = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def test_a_plain_weight_norm_model_on_meta_is_eagers_draw_for_draw(world1: None) -> None:
    """ResetParameters draws in construction's order: the same seed gives eager's values."""
    for seed in (0, 1):
        torch.manual_seed(seed)
        want = Plain().state_dict()
        with torch.device("meta"):
            model = Plain()
        torch.manual_seed(seed)
        got = full_state_dict(FSDPBuilder().materialize(ResetParameters()).build(model))
        assert set(got) == set(want)
        for name, value in want.items():
            assert torch.equal(got[name], value), f"seed {seed}: {name} differs from eager's"
