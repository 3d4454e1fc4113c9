"""Tied weights as a transformers model declares them, for models built with Accelerate's
``init_empty_weights`` (the tie target is a parameter of its own there) and on the meta device
(one tensor), on both backends, at one and two ranks.

References come from transformers alone: ``Model(config)`` for a fresh init (per-tensor spread,
constants, padding rows, ties), ``Model.from_pretrained(folder)`` for a load.
"""

from __future__ import annotations

import functools
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

pytest.importorskip("transformers", reason="transformers is part of the test extra")
pytest.importorskip("accelerate", reason="accelerate is part of the test extra")
import transformers
from accelerate import init_empty_weights
from helpers import full_state_dict

from fsdp_builder import (
    BroadcastFromRank0,
    ConfigurationError,
    FromCheckpoint,
    FSDPBuilder,
    FullyShardBuilder,
    ResetParameters,
    ShardingBuilder,
)

pytestmark = pytest.mark.timeout(300)

VOCAB = 96


def _configs() -> dict[str, tuple[Any, type[nn.Module]]]:
    t: Any = transformers  # its configs' keyword types are stricter than tiny test configs
    small = {"vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 2}
    attention = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
    return {
        "gemma2": (
            t.Gemma2Config(**small, **attention, intermediate_size=96, pad_token_id=0),
            t.Gemma2ForCausalLM,
        ),
        "gemma3": (
            t.Gemma3TextConfig(**small, **attention, intermediate_size=96, pad_token_id=0),
            t.Gemma3ForCausalLM,
        ),
        "whisper": (
            t.WhisperConfig(
                vocab_size=VOCAB,
                d_model=64,
                encoder_layers=2,
                decoder_layers=2,
                encoder_attention_heads=4,
                decoder_attention_heads=4,
                encoder_ffn_dim=96,
                decoder_ffn_dim=96,
                num_mel_bins=16,
                max_source_positions=16,
                max_target_positions=32,
                pad_token_id=0,
                bos_token_id=1,
                eos_token_id=2,
                decoder_start_token_id=1,
            ),
            t.WhisperForConditionalGeneration,
        ),
        # Its model-level _init_weights writes the decoder, which it ties to the embeddings.
        "modernbert": (
            t.ModernBertConfig(
                **small,
                intermediate_size=96,
                num_attention_heads=4,
                pad_token_id=0,
                bos_token_id=1,
                eos_token_id=2,
                cls_token_id=1,
                sep_token_id=2,
            ),
            t.ModernBertForMaskedLM,
        ),
        "falcon": (
            t.FalconConfig(**small, num_attention_heads=4, bos_token_id=1, eos_token_id=2),
            t.FalconForCausalLM,
        ),
        "mamba": (
            t.MambaConfig(**small, state_size=8, pad_token_id=0, bos_token_id=1, eos_token_id=2),
            t.MambaForCausalLM,
        ),
    }


FAMILIES = list(_configs())


def builder(backend: str, family: str) -> ShardingBuilder:
    if backend == "fsdp2":
        return FullyShardBuilder()
    # Whisper's sinusoidal position embeddings are frozen: FSDP1 needs use_orig_params to
    # keep them in one unit with trainable parameters.
    return FSDPBuilder().use_orig_params(family == "whisper")


BACKENDS = ["fsdp1", "fsdp2"]


def empty(family: str) -> nn.Module:
    """The model as Accelerate's ``init_empty_weights`` builds it (ties not held)."""
    config, cls = _configs()[family]
    with init_empty_weights():
        return cls(config)


def on_meta(family: str) -> nn.Module:
    config, cls = _configs()[family]
    with torch.device("meta"):
        return cls(config)


@functools.cache
def eager(family: str, seed: int) -> nn.Module:
    config, cls = _configs()[family]
    torch.manual_seed(seed)
    return cls(config)


def tie_pairs(family: str) -> list[tuple[str, str]]:
    """(target, source) names transformers ties in this model, as ``Model(config)`` holds
    them: one parameter under two names."""
    model: Any = eager(family, 0)
    pairs = list(model.all_tied_weights_keys.items())
    assert pairs, f"{family} declares no tie"
    for target, source in pairs:
        assert model.get_parameter(target) is model.get_parameter(source)
    return pairs


def _at(model: nn.Module, name: str) -> Any:
    # Attribute by attribute: FSDP1 wrappers forward them, and without use_orig_params it
    # holds views of its flat parameter there rather than Parameters.
    found: Any = model
    for part in name.split("."):
        found = getattr(found, part)
    return found


def held_tied(model: nn.Module, family: str) -> bool:
    """Whether every pair transformers ties is one tensor in ``model``."""
    return all(_at(model, t) is _at(model, s) for t, s in tie_pairs(family))


# -- the checks against transformers -----------------------------------------------------------


def check_ties(family: str, state: dict[str, torch.Tensor]) -> None:
    """Each tie target holds its source's full tensor; an embedding's padding row is zero
    exactly where ``Model(config)``'s is."""
    reference: Any = eager(family, 0)
    for target, source in tie_pairs(family):
        assert torch.equal(state[target], state[source]), f"{family}: {target} != {source}"
    embedding = reference.get_input_embeddings()
    pad = embedding.padding_idx
    if pad is not None:
        name = next(n for n, p in reference.named_parameters() if p is embedding.weight)
        want_zero = bool((embedding.weight[pad] == 0).all())
        got_zero = bool((state[name][pad] == 0).all())
        assert got_zero == want_zero, f"{family}: padding row of {name} zero={got_zero}"


def spread_tolerance(numel: int) -> float:
    """Relative tolerance on a sample std: two independent samples of ``numel`` values differ
    by about 1/sqrt(numel) of it (normal draws); six of those."""
    return 6 / math.sqrt(numel)


def check_like_eager(family: str, state: dict[str, torch.Tensor]) -> None:
    """Every state of ``Model(config)`` is there with its shape and dtype; what two seeds give
    alike (constants, sinusoids) is equal, the rest has the same spread and centre."""
    ref, other = eager(family, 0).state_dict(), eager(family, 1).state_dict()
    assert set(ref) <= set(state), f"{family}: missing {sorted(set(ref) - set(state))}"
    for name, want in ref.items():
        got = state[name]
        assert got.shape == want.shape and got.dtype == want.dtype, name
        if torch.equal(want, other[name]):
            assert torch.equal(got, want), f"{family} {name}: differs from Model(config)'s"
            continue
        want_std, got_std = float(want.float().std()), float(got.float().std())
        tolerance = spread_tolerance(want.numel())
        assert abs(got_std / want_std - 1) <= tolerance, (
            f"{family} {name}: std {got_std:.5f}, Model(config) {want_std:.5f}"
        )
        centre = abs(float(got.float().mean()) - float(want.float().mean()))
        assert centre <= tolerance * want_std, f"{family} {name}: mean differs by {centre}"


def modernbert_embedding_std() -> float:
    return float(
        eager("modernbert", 0).state_dict()["model.embeddings.tok_embeddings.weight"].std()
    )


# -- one rank ----------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_an_empty_weights_model_builds_tied_like_model_config(
    world1: None, family: str, backend: str
) -> None:
    model = empty(family)
    assert not held_tied(model, family)  # what init_empty_weights gives
    torch.manual_seed(0)
    sharded = builder(backend, family).build(model)
    assert held_tied(sharded, family)
    state = full_state_dict(sharded)
    check_ties(family, state)
    check_like_eager(family, state)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("make", [empty, on_meta], ids=["empty_weights", "meta"])
def test_a_model_level_init_of_a_tie_target_does_not_reach_its_source(
    world1: None, backend: str, make: Callable[[str], nn.Module]
) -> None:
    # ModernBertForMaskedLM's _init_weights writes its decoder with the output-layer spread;
    # Model(config) ties after initializing, so the embeddings keep their own spread.
    torch.manual_seed(0)
    state = full_state_dict(builder(backend, "modernbert").build(make("modernbert")))
    got = float(state["model.embeddings.tok_embeddings.weight"].std())
    want = modernbert_embedding_std()
    numel = state["model.embeddings.tok_embeddings.weight"].numel()
    assert got == pytest.approx(want, rel=spread_tolerance(numel))
    check_ties("modernbert", state)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """``save_pretrained`` folders of ``Model(config)`` (tied: the target is not written)."""
    root = tmp_path_factory.mktemp("tied")
    out = {}
    for family in FAMILIES:
        model: Any = eager(family, 3)
        model.save_pretrained(root / family)
        out[family] = str(root / family)
    return out


def reference_load(family: str, folder: str) -> dict[str, torch.Tensor]:
    _, cls = _configs()[family]
    loaded: Any = cls.from_pretrained(folder)  # type: ignore[attr-defined]
    return {n: t.detach().clone() for n, t in loaded.state_dict().items()}


def check_loaded(
    family: str, state: dict[str, torch.Tensor], want: dict[str, torch.Tensor]
) -> None:
    assert state.keys() == want.keys(), f"{family}: {sorted(state.keys() ^ want.keys())}"
    for name, value in want.items():
        assert torch.equal(state[name], value), f"{family} {name}: differs from from_pretrained"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_a_save_pretrained_folder_loads_into_an_empty_weights_model_like_from_pretrained(
    world1: None, folders: dict[str, str], family: str, backend: str
) -> None:
    want = reference_load(family, folders[family])
    sharded = (
        builder(backend, family).materialize(FromCheckpoint(folders[family])).build(empty(family))
    )
    assert held_tied(sharded, family)
    check_loaded(family, full_state_dict(sharded), want)


def test_the_single_process_reference_ties_as_a_build_does() -> None:
    torch.manual_seed(0)
    model = ResetParameters().materialize_model(empty("modernbert"))
    assert held_tied(model, "modernbert")
    state = {n: t.detach().clone() for n, t in model.state_dict().items()}
    check_ties("modernbert", state)
    check_like_eager("modernbert", state)


def test_a_refused_build_leaves_the_declared_tie_as_it_was(world1: None) -> None:
    model: Any = empty("gemma2")
    head = model.lm_head.weight
    with pytest.raises(ConfigurationError, match="TransformerEncoderLayer"):
        FullyShardBuilder().wrap(nn.TransformerEncoderLayer).build(model)
    assert model.lm_head.weight is head
    assert model.lm_head.weight is not model.model.embed_tokens.weight


def test_the_plan_of_an_empty_weights_model_is_that_of_the_tied_model(world1: None) -> None:
    for family in FAMILIES:
        model: Any = empty(family)
        before = dict(model.named_parameters(remove_duplicate=False))
        plan = FullyShardBuilder().plan_for(model)
        # The model as transformers ties it on meta plans alike; planning changed nothing.
        assert plan.signature() == FullyShardBuilder().plan_for(on_meta(family)).signature()
        after = dict(model.named_parameters(remove_duplicate=False))
        assert before.keys() == after.keys()
        assert all(after[n] is p for n, p in before.items()), family


# -- two ranks ---------------------------------------------------------------------------------

SPREAD_FAMILY = "modernbert"
LOAD_FAMILIES = ["modernbert", "gemma2"]


def fresh_case(backend: str, family: str) -> dict[str, Any] | None:
    torch.manual_seed(0)
    sharded = builder(backend, family).build(empty(family))
    out = {"state": full_state_dict(sharded), "tied": held_tied(sharded, family)}
    return out if dist.get_rank() == 0 else None


def load_case(backend: str, family: str, folder: str) -> dict[str, Any] | None:
    sharded = builder(backend, family).materialize(FromCheckpoint(folder)).build(empty(family))
    out = {"state": full_state_dict(sharded), "tied": held_tied(sharded, family)}
    return out if dist.get_rank() == 0 else None


def rank0_real_case(backend: str, family: str) -> dict[str, Any] | None:
    """Rank 0 holds ``Model(config)`` (tied by transformers), the others the empty-weights
    model (untied): rank 0's values reach every rank."""
    config, cls = _configs()[family]
    torch.manual_seed(5)
    model = cls(config) if dist.get_rank() == 0 else empty(family)
    # ResetParameters: the meta ranks' own init, which the broadcast replaces (what the shard-
    # first default does with a synchronizer is another matter, tested with the synchronizers).
    chosen = builder(backend, family).materialize(ResetParameters())
    sharded = chosen.synchronize(BroadcastFromRank0()).build(model)
    out = {"state": full_state_dict(sharded), "tied": held_tied(sharded, family)}
    return out if dist.get_rank() == 0 else None


def cases(folders: dict[str, str]) -> Iterator[tuple[Hashable, Callable[[], Any]]]:
    for backend in BACKENDS:
        yield ("fresh", backend), partial(fresh_case, backend, SPREAD_FAMILY)
        yield ("rank0_real", backend), partial(rank0_real_case, backend, SPREAD_FAMILY)
        for family in LOAD_FAMILIES:
            yield ("load", backend, family), partial(load_case, backend, family, folders[family])


def scenarios(folders: dict[str, str]) -> Results:
    return run_each(cases(folders))


SPAWNS = Spawns(scenarios, timeout=240)


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_ranks_build_the_empty_weights_model_tied_like_model_config(
    folders: dict[str, str], backend: str
) -> None:
    got = values(SPAWNS(2, folders), ("fresh", backend))[0]
    assert got["tied"]
    check_ties(SPREAD_FAMILY, got["state"])
    check_like_eager(SPREAD_FAMILY, got["state"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_rank0s_tied_model_reaches_ranks_holding_the_empty_weights_model(
    folders: dict[str, str], backend: str
) -> None:
    got = values(SPAWNS(2, folders), ("rank0_real", backend))[0]
    assert got["tied"]
    want = eager(SPREAD_FAMILY, 5).state_dict()
    assert set(want) <= set(got["state"])
    for name, value in want.items():
        assert torch.equal(got["state"][name], value), f"{name}: not rank 0's Model(config)"


@pytest.mark.parametrize("family", LOAD_FAMILIES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_two_ranks_load_the_empty_weights_model_like_from_pretrained(
    folders: dict[str, str], backend: str, family: str
) -> None:
    got = values(SPAWNS(2, folders), ("load", backend, family))[0]
    assert got["tied"]
    check_loaded(family, got["state"], reference_load(family, folders[family]))


def test_the_folders_hold_no_tie_target(folders: dict[str, str]) -> None:
    # save_pretrained writes a tied pair once: the loads above fill the target from its source.
    from safetensors.torch import load_file

    for family in FAMILIES:
        saved = load_file(str(Path(folders[family]) / "model.safetensors"))
        for target, source in tie_pairs(family):
            assert source in saved and target not in saved, family
