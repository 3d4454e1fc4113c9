"""Mixture-of-experts checkpoints: per-expert tensors read as the model's fused ones.

transformers 5 holds a MoE layer's experts in fused parameters (``mlp.experts.gate_up_proj``,
``down_proj``) but ``save_pretrained`` writes one tensor per expert and projection. These tests
run in the test process (one rank, or no process group): the derived source against
``from_pretrained``, the reads a rank makes, bad checkpoints and bad rules. The 2-rank loads,
training and export round trip are in ``test_transformers.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("transformers", reason="transformers is part of the test extra")
import transformers
from helpers import full_state_dict

from fsdp_builder import (
    ConfigurationError,
    FromCheckpoint,
    FromStateDict,
    FSDPBuilder,
    FullyShardBuilder,
    MergeExperts,
    Rename,
    register_checkpoint_rules,
)
from fsdp_builder.sources import checkpoint_rules, derive, open_source, unregister_checkpoint_rules
from fsdp_builder.sources.model_rules import _BUILT_IN

SMALL = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 40, "num_hidden_layers": 2}
ATTN = {"num_attention_heads": 4, "num_key_value_heads": 2}


def _models() -> dict[str, tuple[Any, Any]]:
    t: Any = transformers
    moe = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24}
    return {
        "mixtral": (
            t.MixtralConfig(**SMALL, **ATTN, num_local_experts=4, num_experts_per_tok=2),
            t.MixtralForCausalLM,
        ),
        "qwen2_moe": (
            t.Qwen2MoeConfig(**SMALL, **ATTN, **moe, shared_expert_intermediate_size=32),
            t.Qwen2MoeForCausalLM,
        ),
        "qwen3_moe": (t.Qwen3MoeConfig(**SMALL, **ATTN, **moe), t.Qwen3MoeForCausalLM),
    }


MODELS = list(_models())


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    out = {}
    for name, (config, cls) in _models().items():
        torch.manual_seed(4)
        cls(config).save_pretrained(root / name)
        out[name] = root / name
    return out


def meta_model(name: str) -> nn.Module:
    config, cls = _models()[name]
    with torch.device("meta"):
        model: nn.Module = cls(config)
    return model


class Counting:
    """A source that records each key it reads and the index of the read."""

    def __init__(self, source: Any) -> None:
        self.source = source
        self.describe = source.describe
        self.reads: list[tuple[str, Any]] = []

    def tensors(self) -> Any:
        return self.source.tensors()

    def read(self, key: str, index: Any = None) -> torch.Tensor:
        self.reads.append((key, index))
        return self.source.read(key, index)

    def close(self) -> None:
        self.source.close()


@pytest.mark.parametrize("name", MODELS)
def test_the_per_expert_files_read_as_from_pretrained_fuses_them(
    saved: dict[str, Path], name: str
) -> None:
    _, cls = _models()[name]
    want = cls.from_pretrained(saved[name]).state_dict()
    from safetensors import safe_open

    with safe_open(str(saved[name] / "model.safetensors"), "pt") as f:
        assert any(".experts.0." in k for k in f.keys())  # save_pretrained unfused them
    # transformers' own mapping and the rules written here give the same tensors.
    model = meta_model(name)
    for rules in (checkpoint_rules(model), _BUILT_IN[name]):
        source = derive(open_source(saved[name]), rules)
        try:
            assert set(source.tensors()) == set(want)
            for key, value in want.items():
                meta = source.tensors()[key]
                assert (meta.shape, meta.dtype) == (tuple(value.shape), value.dtype), key
                assert torch.equal(source.read(key), value), key
        finally:
            source.close()


def test_a_slice_of_a_merged_tensor_reads_only_its_experts(saved: dict[str, Path]) -> None:
    want = transformers.MixtralForCausalLM.from_pretrained(saved["mixtral"]).state_dict()
    counting = Counting(open_source(saved["mixtral"]))
    source = derive(counting, checkpoint_rules(meta_model("mixtral")))
    key = "model.layers.1.mlp.experts.gate_up_proj"
    # What FSDP2 gives rank 1 of 2: experts 2 and 3.
    assert torch.equal(source.read(key, (slice(2, 4),)), want[key][2:4])
    read = {k for k, _ in counting.reads}
    prefix = "model.layers.1.block_sparse_moe.experts"
    assert read == {f"{prefix}.{e}.{w}.weight" for e in (2, 3) for w in ("w1", "w3")}
    # Rows across the gate/up boundary (40 gate rows, then 40 up rows): both halves read.
    counting.reads.clear()
    assert torch.equal(source.read(key, (slice(1, 2), slice(30, 50))), want[key][1:2, 30:50])
    assert sorted(counting.reads) == [
        (f"{prefix}.1.w1.weight", (slice(30, 40), slice(0, 32))),
        (f"{prefix}.1.w3.weight", (slice(0, 10), slice(0, 32))),
    ]
    # Only the up half: the gate tensors are not read at all.
    counting.reads.clear()
    assert torch.equal(source.read(key, (slice(0, 4), slice(45, 80))), want[key][:, 45:80])
    assert {k.rsplit(".", 2)[1] for k, _ in counting.reads} == {"w3"}
    # An empty shard (more ranks than experts) reads nothing.
    counting.reads.clear()
    assert source.read(key, (slice(4, 4),)).shape == (0, 80, 32)
    assert counting.reads == []
    source.close()


@pytest.mark.parametrize("loader", ["FromStateDict", "FromCheckpoint(shared_filesystem=False)"])
def test_the_rank0_loaders_merge_the_experts_too(
    world1: None, saved: dict[str, Path], loader: str
) -> None:
    folder = saved["qwen3_moe"]
    want = transformers.Qwen3MoeForCausalLM.from_pretrained(folder).state_dict()
    materializer = (
        FromStateDict(str(folder))
        if loader == "FromStateDict"
        else FromCheckpoint(folder, shared_filesystem=False)
    )
    state = full_state_dict(FSDPBuilder().materialize(materializer).build(meta_model("qwen3_moe")))
    assert state.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(state[key], value), key


def _rewrite(folder: Path, out: Path, change: Any) -> Path:
    """A copy of a save_pretrained folder with its tensors changed by ``change(dict)``."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, out)
    tensors = load_file(str(out / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _load_error(path: Path | str, name: str = "mixtral") -> str:
    with pytest.raises(ConfigurationError) as info:
        FullyShardBuilder().materialize(FromCheckpoint(path)).build(meta_model(name))
    return str(info.value)


def test_a_bad_moe_checkpoint_is_refused_naming_what_is_wrong(
    world1: None, saved: dict[str, Path], tmp_path: Path
) -> None:
    prefix = "model.layers.0.block_sparse_moe.experts"
    # A path that is not there: the path error, as for any checkpoint.
    message = _load_error(tmp_path / "nowhere")
    assert "`FromCheckpoint` got an invalid `path`" in message and "does not exist" in message
    # One expert's up projection missing: named, with the expert.
    lacking = _rewrite(
        saved["mixtral"], tmp_path / "lacking", lambda t: t.pop(f"{prefix}.1.w3.weight")
    )
    message = _load_error(lacking)
    assert (
        "`path`" in message and "lacks the '.experts.*.w3.weight' tensors of expert(s) 1" in message
    )

    # One expert of another shape: named, with both keys.
    def widen(tensors: dict[str, torch.Tensor]) -> None:
        tensors[f"{prefix}.2.w2.weight"] = torch.zeros(32, 41)

    odd = _rewrite(saved["mixtral"], tmp_path / "odd", widen)
    message = _load_error(odd)
    assert (
        f"'{prefix}.0.w2.weight' is [32, 40]" in message
        and f"'{prefix}.2.w2.weight' is [32, 41]" in message
    )
    # A checkpoint of another config: the merged shapes are compared as any other.
    _, cls = _models()["mixtral"]
    t: Any = transformers  # its configs' keyword types are stricter than tiny test configs
    other = t.MixtralConfig(**{**SMALL, "intermediate_size": 48}, **ATTN, num_local_experts=4)
    cls(other).save_pretrained(tmp_path / "other")
    message = _load_error(tmp_path / "other")
    assert "wrong shape(s)" in message
    assert (
        "'model.layers.0.mlp.experts.gate_up_proj' is [4, 96, 32] in the checkpoint but [4, 80, 32]"
        in message
    )

    # Integer experts where the model has floats: the dtype check as for any checkpoint.
    def as_int(tensors: dict[str, torch.Tensor]) -> None:
        for e in range(4):
            tensors[f"{prefix}.{e}.w2.weight"] = tensors[f"{prefix}.{e}.w2.weight"].to(torch.int32)

    message = _load_error(_rewrite(saved["mixtral"], tmp_path / "ints", as_int))
    assert "integer/float mismatch" in message and "experts.down_proj' is torch.int32" in message


class TinyMoE(nn.Module):
    """A model of the user's own, with a ``config.model_type`` and fused experts."""

    def __init__(self) -> None:
        super().__init__()
        self.config = type("Config", (), {"model_type": "tiny_moe_test"})()
        self.up = nn.Parameter(torch.empty(3, 10, 4))
        self.norm = nn.LayerNorm(4)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.up)


def test_rules_registered_for_a_model_type_are_used_and_checked(
    world1: None, tmp_path: Path
) -> None:
    from safetensors.torch import save_file

    torch.manual_seed(0)
    gate = [torch.randn(6, 4) for _ in range(3)]
    lin = [torch.randn(4, 4) for _ in range(3)]
    norm = nn.LayerNorm(4)
    tensors = {f"ffn.{e}.gate.weight": gate[e] for e in range(3)}
    tensors |= {f"ffn.{e}.lin.weight": lin[e] for e in range(3)}
    tensors |= {f"ln.{k}": v.detach() for k, v in norm.state_dict().items()}
    save_file(tensors, str(tmp_path / "tiny.safetensors"))
    register_checkpoint_rules(
        "tiny_moe_test",
        [Rename(r"^ln\.", "norm."), MergeExperts(("ffn.*.gate.weight", "ffn.*.lin.weight"), "up")],
    )
    try:
        with torch.device("meta"):
            model = TinyMoE()
        built = FullyShardBuilder().materialize(FromCheckpoint(tmp_path / "tiny.safetensors"))
        state = full_state_dict(built.build(model))
        want = torch.stack([torch.cat([g, w]) for g, w in zip(gate, lin, strict=True)])
        assert torch.equal(state["up"], want)
        assert torch.equal(state["norm.weight"], norm.weight.detach())
    finally:
        unregister_checkpoint_rules("tiny_moe_test")
    # Without the rules the checkpoint's own names do not match.
    with torch.device("meta"):
        model = TinyMoE()
    with pytest.raises(ConfigurationError, match="missing key"):
        FullyShardBuilder().materialize(FromCheckpoint(tmp_path / "tiny.safetensors")).build(model)


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: Rename("(", "x"), "`Rename` got an invalid `pattern`"),
        (lambda: MergeExperts(("experts.w1",), "up"), "one '\\*' where the expert"),
        (lambda: MergeExperts(("e.*.w",), "up", dim=0), "`MergeExperts` got an invalid `dim`"),
        (lambda: register_checkpoint_rules("", []), "`model_type`"),
        (
            lambda: register_checkpoint_rules("x", [("a", "b")]),  # type: ignore[list-item]
            "expected Rename and MergeExperts",
        ),
    ],
)
def test_bad_rules_are_refused_naming_the_argument(make: Any, words: str) -> None:
    with pytest.raises(ConfigurationError, match=words):
        make()
