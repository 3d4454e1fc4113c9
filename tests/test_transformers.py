"""Hugging Face transformers models through the builder, on 2 gloo ranks and both backends,
compared with transformers itself: ``Model(config)`` for a fresh init, ``from_pretrained`` for a
load, eager training for the steps after it. Tiny random configs; no hub access.

One spawn runs every scenario (see ``isolated``); the tests compare each scenario's values with
what transformers gives in the test process.
"""

from __future__ import annotations

import functools
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

pytest.importorskip("transformers", reason="transformers is part of the test extra")
import transformers
from helpers import full_state_dict

from fsdp_builder import (
    ConfigurationError,
    DeterministicInit,
    FromCheckpoint,
    FSDPBuilder,
    FullyShardBuilder,
    MaterializationError,
    ShardFirstReset,
    ShardingBuilder,
    StreamInit,
    save_hf_checkpoint,
)
from fsdp_builder.planning.ignored import clean_name
from fsdp_builder.runtime.tree import local_tensor

pytestmark = pytest.mark.timeout(420)

SMALL = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2}
ATTN = {"num_attention_heads": 4, "num_key_value_heads": 2}


def _configs() -> dict[str, tuple[Any, type[nn.Module]]]:
    t: Any = transformers  # its configs' keyword types are stricter than tiny test configs
    return {
        "llama_tied": (
            t.LlamaConfig(**SMALL, **ATTN, tie_word_embeddings=True),
            t.LlamaForCausalLM,
        ),
        "llama": (t.LlamaConfig(**SMALL, **ATTN, tie_word_embeddings=False), t.LlamaForCausalLM),
        "qwen2": (t.Qwen2Config(**SMALL, **ATTN), t.Qwen2ForCausalLM),
        "mistral": (t.MistralConfig(**SMALL, **ATTN), t.MistralForCausalLM),
        "gemma": (t.GemmaConfig(**SMALL, **ATTN, head_dim=16), t.GemmaForCausalLM),
        "gpt2": (
            t.GPT2Config(
                vocab_size=96,
                n_embd=64,
                n_layer=2,
                n_head=4,
                n_positions=32,
                bos_token_id=0,
                eos_token_id=0,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
            ),
            t.GPT2LMHeadModel,
        ),
        "mixtral": (
            t.MixtralConfig(**SMALL, **ATTN, num_local_experts=4, num_experts_per_tok=2),
            t.MixtralForCausalLM,
        ),
        "qwen3_moe": (
            t.Qwen3MoeConfig(
                **SMALL, **ATTN, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48
            ),
            t.Qwen3MoeForCausalLM,
        ),
        "bert": (
            t.BertConfig(
                vocab_size=96,
                hidden_size=64,
                intermediate_size=96,
                num_hidden_layers=2,
                num_attention_heads=4,
                max_position_embeddings=32,
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
            ),
            t.BertForMaskedLM,
        ),
        "t5": (
            t.T5Config(
                vocab_size=96,
                d_model=64,
                d_kv=16,
                d_ff=96,
                num_layers=2,
                num_heads=4,
                decoder_start_token_id=0,
                dropout_rate=0.0,
            ),
            t.T5ForConditionalGeneration,
        ),
    }


# Loaded only (see LOADED): its init is transformers' as for the families above.
LOAD_ONLY = {"qwen3_moe"}
FAMILIES = [f for f in _configs() if f not in LOAD_ONLY]
# Mixture-of-experts models: save_pretrained writes their experts one by one, the model fuses
# them; a load of these is also exported (one file with FSDP1, several with FSDP2).
MOE = ["mixtral", "qwen3_moe"]
EXPORT_SHARD_BYTES = {"fsdp1": 5 * 10**9, "fsdp2": 60_000}
BACKENDS: dict[str, Callable[[], ShardingBuilder]] = {
    "fsdp1": FSDPBuilder,
    "fsdp2": FullyShardBuilder,
}
SEEDS = [0, 1, 2, 3]
# The statistics need 4 seeds; FSDP1's run checks constants, buffers and world-size invariance.
DETERMINISTIC_SEEDS = {"fsdp2": [11, 12, 13, 14], "fsdp1": [11]}
STREAM_SEED = 11
STEPS = 3


def make(family: str, meta: bool = True) -> nn.Module:
    config, cls = _configs()[family]
    if meta:
        with torch.device("meta"):
            return cls(config)
    return cls(config)


def inputs(family: str) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(5))
    if family == "t5":
        return {"input_ids": ids, "decoder_input_ids": ids.flip(1)}
    return {"input_ids": ids}


def buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every buffer by its clean name (persistent or not), on the CPU."""
    return {clean_name(n): b.detach().cpu().clone() for n, b in model.named_buffers()}


def tied(model: Any) -> bool:
    """Whether the output embedding still shares the input embedding's parameter."""
    out = model.get_output_embeddings()
    return out is not None and out.weight is model.get_input_embeddings().weight


def check_embeddings(family: str, state: dict[str, torch.Tensor], still_tied: bool) -> None:
    """The input embedding's padding row is eager's (zero), and a tied output embedding holds
    the input embedding's values, as after eager's "initialize, then tie"."""
    model: Any = eager(family, 0)
    names = {id(m): clean_name(n) for n, m in model.named_modules()}
    embedding, output = model.get_input_embeddings(), model.get_output_embeddings()
    weight = f"{names[id(embedding)]}.weight"
    pad = embedding.padding_idx
    if getattr(model.config, "pad_token_id", None) is not None and pad is not None:
        assert torch.equal(state[weight][pad], embedding.weight[pad].detach()), (
            f"{family}: the padding row of {weight} differs from eager's"
        )
    if output is not None and output.weight is embedding.weight:
        assert still_tied, f"{family}: the output embedding is no longer tied"
        head = f"{names[id(output)]}.weight"
        assert torch.equal(state[head], state[weight]), f"{family}: {head} != {weight}"


def logits(model: nn.Module, family: str) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs(family)).logits.detach().cpu()


def train(model: nn.Module, family: str) -> list[float]:
    """``STEPS`` AdamW steps on a fixed batch (the same on every rank, so the averaged gradient
    is the single-process one)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = inputs(family)
    losses = []
    for _ in range(STEPS):
        out = model(**batch, labels=batch.get("decoder_input_ids", batch["input_ids"]))
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(out.loss.detach()))
    return losses


# -- the ranks ---------------------------------------------------------------------------------


def fresh_case(family: str, backend: str, seed: int) -> dict[str, Any] | None:
    """A build with no .wrap and no .materialize: the transformers model's own init."""
    torch.manual_seed(seed)
    model = make(family)
    sharded = BACKENDS[backend]().build(model)
    state = full_state_dict(sharded)
    found = buffers(sharded)
    out = {"state": state, "buffers": found, "tied": tied(sharded)}
    return out if dist.get_rank() == 0 else None


def deterministic_case(family: str, backend: str, seed: int) -> dict[str, Any] | None:
    sharded = BACKENDS[backend]().materialize(DeterministicInit(seed)).build(make(family))
    state = full_state_dict(sharded)
    out = {"state": state, "buffers": buffers(sharded), "tied": tied(sharded)}
    return out if dist.get_rank() == 0 else None


def stream_case(family: str, whole_below: int | None) -> dict[str, Any] | None:
    """``whole_below=0``: every unit shard by shard; None: the default, which fills these small
    units whole before sharding them."""
    kw = {} if whole_below is None else {"whole_below": whole_below}
    builder = FullyShardBuilder().materialize(StreamInit(seed=STREAM_SEED, **kw))
    sharded = builder.build(make(family))
    first: dict[str, str] = {}
    for record in builder.report.records:
        first.setdefault(record.unit, record.stage)
    state = full_state_dict(sharded)
    out = {"state": state, "buffers": buffers(sharded), "tied": tied(sharded), "first": first}
    return out if dist.get_rank() == 0 else None


def load_case(family: str, backend: str, folder: str) -> dict[str, Any]:
    def load() -> nn.Module:
        return BACKENDS[backend]().materialize(FromCheckpoint(folder)).build(make(family))

    sharded = load()
    out = {"logits": logits(sharded, family), "buffers": buffers(sharded)}
    if family in MOE:
        export = save_hf_checkpoint(
            sharded, exported(folder, backend), max_shard_bytes=EXPORT_SHARD_BYTES[backend]
        )
        out["files"] = export.files
    # A fresh build for training: after a forward under no_grad, fully_shard keeps the root's
    # parameters gathered and the next steps train on stale values (plain torch does the same).
    out["losses"] = train(load(), family)
    return out


def exported(folder: str, backend: str) -> str:
    return f"{folder}-export-{backend}"


def empty_weights_case(backend: str) -> dict[str, Any] | None:
    """accelerate's init_empty_weights: parameters on meta, buffers real."""
    from accelerate import init_empty_weights

    config, cls = _configs()["llama"]
    with init_empty_weights():
        model = cls(config)
    sharded = BACKENDS[backend]().build(model)
    return {"buffers": buffers(sharded)} if dist.get_rank() == 0 else None


def unknown_block_case(backend: str) -> dict[str, Any]:
    model = make("llama")
    before = {n: type(m) for n, m in model.named_modules()}
    try:
        BACKENDS[backend]().wrap(nn.TransformerEncoderLayer).build(model)
    except ConfigurationError as exc:
        after = {n: type(m) for n, m in model.named_modules()}
        return {"error": str(exc), "untouched": before == after}
    return {"error": None}


def cases(folders: dict[str, str]) -> Iterator[tuple[Hashable, Callable[[], Any]]]:
    for backend in BACKENDS:
        for family in FAMILIES:
            for seed in SEEDS:
                yield ("fresh", family, backend, seed), partial(fresh_case, family, backend, seed)
            for seed in DETERMINISTIC_SEEDS[backend]:
                key = ("deterministic", family, backend, seed)
                yield key, partial(deterministic_case, family, backend, seed)
        if backend == "fsdp2":
            for family in FAMILIES:
                yield ("stream", family), partial(stream_case, family, 0)
                yield ("stream_default", family), partial(stream_case, family, None)
        for family, folder in folders.items():
            yield ("load", family, backend), partial(load_case, family, backend, folder)
        yield ("empty_weights", backend), partial(empty_weights_case, backend)
        yield ("unknown_block", backend), partial(unknown_block_case, backend)


def scenarios(folders: dict[str, str]) -> Results:
    return run_each(cases(folders))


SPAWNS = Spawns(scenarios, timeout=400)
LOADED = ["llama_tied", "llama", "gpt2", "bert", "t5", *MOE]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """``save_pretrained`` folders: several shards (index) for most, one file for BERT."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for family in LOADED:
        torch.manual_seed(3)
        model: Any = make(family, meta=False)
        shard = "2000MB" if family == "bert" else "40KB"
        model.save_pretrained(root / family, max_shard_size=shard)
        out[family] = str(root / family)
    return out


def ranks(folders: dict[str, str], key: Hashable) -> list[Any]:
    return values(SPAWNS(2, folders), key)


# -- the checks --------------------------------------------------------------------------------


@functools.cache
def eager(family: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return make(family, meta=False)


def check_like_eager(family: str, states: list[dict[str, torch.Tensor]], seeds: list[int]) -> None:
    """Per parameter, the mean std over ``seeds`` within 10 % of eager's; constants exact."""
    refs = [eager(family, s).state_dict() for s in seeds]
    persistent = set(refs[0])
    assert persistent <= set(states[0]) | {k for k in persistent if "lm_head" in k}
    for name in sorted(persistent & set(states[0])):
        ref = [r[name] for r in refs]
        got = [s[name] for s in states]
        assert got[0].shape == ref[0].shape and got[0].dtype == ref[0].dtype, name
        if not ref[0].is_floating_point() or all(bool((r == r.flatten()[0]).all()) for r in ref):
            for g, r in zip(got, ref, strict=True):
                assert torch.equal(g, r), f"{family} {name}: a constant differs from eager's"
            continue
        ref_std = sum(float(r.float().std()) for r in ref) / len(ref)
        got_std = sum(float(g.float().std()) for g in got) / len(got)
        assert abs(got_std / ref_std - 1) <= 0.10, f"{family} {name}: std {got_std} vs {ref_std}"


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("family", FAMILIES)
def test_a_build_without_materializer_gives_the_models_own_init(
    folders: dict[str, str], family: str, backend: str
) -> None:
    results = [ranks(folders, ("fresh", family, backend, s))[0] for s in SEEDS]
    check_like_eager(family, [r["state"] for r in results], SEEDS)
    want = {n: b for n, b in eager(family, 0).named_buffers()}
    got = results[0]["buffers"]
    assert set(got) == set(want)
    for name, value in want.items():
        assert torch.equal(got[name], value), f"{family}: buffer {name} differs from eager's"
    for r in results:
        check_embeddings(family, r["state"], r["tied"])
    states = [r["state"] for r in results]
    # torch.manual_seed before the build decides the weights, as it does for an eager model.
    drawn = [n for n, v in states[0].items() if v.is_floating_point() and v.std() > 0]
    assert drawn and not torch.equal(states[0][drawn[0]], states[1][drawn[0]])


@pytest.mark.parametrize("family", FAMILIES)
def test_stream_init_gives_the_same_full_weights_at_any_world_size_and_on_both_backends(
    world1: None, folders: dict[str, str], family: str
) -> None:
    # One rank and FSDP1 (whole units) against two ranks and FSDP2: every unit shard by shard,
    # and the default, which fills units under its whole_below whole and then shards them.
    single = FSDPBuilder().materialize(StreamInit(seed=STREAM_SEED)).build(make(family))
    want = full_state_dict(single)
    for case in ("stream", "stream_default"):
        got = ranks(folders, (case, family))[0]
        firsts = set(got["first"].values())
        # Shard by shard: every unit sharded first; the default: at least one unit (the small
        # ones; Mixtral's layers are larger) filled whole first.
        assert firsts == {"shard"} if case == "stream" else "materialize" in firsts, got["first"]
        check_embeddings(family, got["state"], got["tied"])
        assert set(want) == set(got["state"])
        for name, value in want.items():
            assert torch.equal(got["state"][name], value), f"{case} {family} {name} differs"
        for name, value in eager(family, 0).named_buffers():
            assert torch.equal(got["buffers"][name], value), name


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("family", FAMILIES)
def test_deterministic_init_is_like_eager_and_world_size_invariant(
    world1: None, folders: dict[str, str], family: str, backend: str
) -> None:
    seeds = DETERMINISTIC_SEEDS[backend]
    runs = [ranks(folders, ("deterministic", family, backend, s))[0] for s in seeds]
    got = runs[0]
    for r in runs:
        check_embeddings(family, r["state"], r["tied"])
    if len(runs) == len(SEEDS):
        check_like_eager(family, [r["state"] for r in runs], SEEDS)
    for name, value in eager(family, 0).named_buffers():
        assert torch.equal(got["buffers"][name], value), name
    # The same seed on one rank: bit-identical full weights.
    single = full_state_dict(
        BACKENDS[backend]().materialize(DeterministicInit(seed=11)).build(make(family))
    )
    assert set(single) == set(got["state"])
    for name, value in single.items():
        assert torch.equal(got["state"][name], value), f"{family} {name} depends on world size"


# Models whose _init_weights writes modules without reset_parameters (BERT's prediction-head
# bias, Gemma's RMSNorm weight): their writes must count on the local shards too.
SHARD_FIRST = ["bert", "gemma"]


@pytest.mark.parametrize("family", SHARD_FIRST)
def test_shard_first_reset_on_fsdp2_is_like_eager(world1: None, family: str) -> None:
    states = []
    for seed in SEEDS:
        sharded = FullyShardBuilder().materialize(ShardFirstReset(seed=seed)).build(make(family))
        for name, t in [*sharded.named_parameters(), *sharded.named_buffers()]:
            assert not local_tensor(t).is_meta, f"{family} {name} is still on meta"
        state = full_state_dict(sharded)
        check_embeddings(family, state, tied(sharded))
        if seed == SEEDS[0]:
            for name, value in eager(family, 0).named_buffers():
                assert torch.equal(buffers(sharded)[name], value), f"{family}: buffer {name}"
        states.append(state)
    # Norm weights and biases are constants: equal to eager's, not merely of the same spread.
    check_like_eager(family, states, SEEDS)


def test_shard_first_reset_refuses_an_init_weights_that_skips_a_module(world1: None) -> None:
    config, cls = _configs()["bert"]
    head = transformers.models.bert.modeling_bert.BertLMPredictionHead

    class Skipping(cls):  # type: ignore[valid-type, misc]
        def _init_weights(self, module: nn.Module) -> None:
            if not isinstance(module, head):
                super()._init_weights(module)

    with torch.device("meta"):
        model = Skipping(config)
    with pytest.raises(
        MaterializationError, match=r"_init_weights does not set bias of BertLMPredictionHead"
    ):
        FullyShardBuilder().materialize(ShardFirstReset(seed=0)).build(model)


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("family", LOADED)
def test_a_save_pretrained_folder_loads_like_from_pretrained_and_trains_like_eager(
    folders: dict[str, str], family: str, backend: str
) -> None:
    _, cls = _configs()[family]
    reference = cls.from_pretrained(folders[family])  # type: ignore[attr-defined]
    # As the ranks compute: run_ranks gives each rank one thread, and the sums of a
    # mixture-of-experts forward (its grouped matmuls) depend on the thread count.
    with one_thread():
        want_logits = logits(reference, family)
        want_buffers = {n: b.clone() for n, b in reference.named_buffers()}
        want_losses = train(reference, family)
    for rank, got in enumerate(ranks(folders, ("load", family, backend))):
        assert torch.equal(got["logits"], want_logits), f"rank {rank}: logits differ"
        for name, value in want_buffers.items():
            assert torch.equal(got["buffers"][name], value), name
        assert got["losses"] == pytest.approx(want_losses, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_a_model_from_accelerates_init_empty_weights_builds_with_eagers_buffers(
    folders: dict[str, str], backend: str
) -> None:
    got = ranks(folders, ("empty_weights", backend))[0]
    for name, value in eager("llama", 0).named_buffers():
        assert torch.equal(got["buffers"][name], value), name


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_a_wrap_class_the_model_lacks_is_refused_naming_its_blocks(
    folders: dict[str, str], backend: str
) -> None:
    for got in ranks(folders, ("unknown_block", backend)):
        assert got["error"] is not None, "the build went on with a one-unit plan"
        assert "TransformerEncoderLayer" in got["error"]
        assert "`.wrap(LlamaDecoderLayer)`" in got["error"]
        assert got["untouched"]


def test_the_default_wrap_of_a_transformers_model_is_its_no_split_modules(world1: None) -> None:
    builder = FullyShardBuilder()
    builder.build(make("t5"))
    assert builder.plan is not None
    units = [u.label for u in builder.plan]
    assert units == [
        "encoder.block.0",
        "encoder.block.1",
        "decoder.block.0",
        "decoder.block.1",
        "<root>",
    ]


def test_several_classes_in_one_wrap_call(world1: None) -> None:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    builder = FSDPBuilder().wrap(LlamaDecoderLayer, nn.Embedding)
    builder.build(make("llama"))
    assert builder.plan is not None
    labels = [u.label for u in builder.plan]
    assert labels == ["model.embed_tokens", "model.layers.0", "model.layers.1", "<root>"]


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("family", MOE)
def test_a_moe_export_loads_bit_exact_in_from_pretrained_and_from_checkpoint(
    world1: None, folders: dict[str, str], family: str, backend: str
) -> None:
    _, cls = _configs()[family]
    want = cls.from_pretrained(folders[family]).state_dict()  # type: ignore[attr-defined]
    files = {tuple(got["files"]) for got in ranks(folders, ("load", family, backend))}
    folder = Path(exported(folders[family], backend))
    names = {p.name for p in folder.iterdir()} - {"config.json"}
    if backend == "fsdp1":  # the default size: one file, no index, as save_pretrained writes
        assert files == {("model.safetensors",)} and names == {"model.safetensors"}
    else:
        (several,) = files
        assert len(several) > 1 and names == {*several, "model.safetensors.index.json"}
    again = cls.from_pretrained(folder).state_dict()  # type: ignore[attr-defined]
    assert again.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(again[name], value), f"{family} {name}: from_pretrained differs"
    # The library's own loader reads the export back (fused names, one file or several).
    ours = full_state_dict(
        FullyShardBuilder().materialize(FromCheckpoint(folder)).build(make(family))
    )
    assert ours.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(ours[name], value), f"{family} {name}: FromCheckpoint differs"
