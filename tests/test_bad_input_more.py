"""Bad input that used to pass silently, change the model before its refusal, end in a raw
error, or be refused without naming what was passed: registered formats that read other shapes
or dtypes than they list, registries that differ between ranks, a transformers ``_init_weights``
that leaves a state unwritten, rule lists that are not lists, unreadable torch versions, broken
``config.json`` sizes for ``fsdp-builder plan``, and wrap / checkpointing policies."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import warnings
from collections.abc import Callable, Hashable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import full_state_dict
from isolated import Results, Spawns, run_each, values
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel

from fsdp_builder import (
    ConfigurationError,
    CPUDevice,
    FromCheckpoint,
    FSDPBuilder,
    FSDPBuilderError,
    FullyShardBuilder,
    MaterializationError,
    MergeExperts,
    NoSplitModules,
    Rename,
    ResetParameters,
    TensorMeta,
    register_checkpoint_rules,
    register_format,
    register_initializer,
    versions,
)
from fsdp_builder.sources import (
    Index,
    checkpoint_rules,
    unregister_checkpoint_rules,
    unregister_format,
)
from fsdp_builder.tools import cli

# -- registered formats: reads held to their listing ------------------------------------------


class SafetensorsLike:
    """A user's format over a .safetensors file whose ``read`` can be made to misbehave:
    ``rows`` returns only the first row, ``dtype`` returns float64."""

    def __init__(self, path: Path, fault: str) -> None:
        self.describe = f"the test archive '{path}'"
        self._values = load_file(str(path))
        self._fault = fault

    def tensors(self) -> dict[str, TensorMeta]:
        return {k: TensorMeta(tuple(v.shape), v.dtype) for k, v in self._values.items()}

    def read(self, key: str, index: Index | None = None) -> torch.Tensor:
        tensor = self._values[key]
        tensor = tensor[index] if index else tensor
        if self._fault == "rows" and key == "weight":
            return tensor[:1]
        if self._fault == "dtype" and key == "weight":
            return tensor.double()
        return tensor

    def close(self) -> None:
        self._values.clear()


def register_faulty(name: str, fault: str) -> None:
    register_format(name, lambda p: p.suffix == f".{name}", partial(SafetensorsLike, fault=fault))


@pytest.fixture
def linear_file(tmp_path: Path) -> Callable[[str], Path]:
    saved = nn.Linear(16, 4)  # weight [4, 16]

    def write(suffix: str) -> Path:
        path = tmp_path / f"linear.{suffix}"
        save_file({k: v.detach().contiguous() for k, v in saved.state_dict().items()}, str(path))
        return path

    return write


def meta_linear() -> nn.Module:
    with torch.device("meta"):
        return nn.Linear(16, 4)


def test_a_format_reading_fewer_rows_than_it_lists_is_refused(
    world1: None, linear_file: Callable[[str], Path]
) -> None:
    register_faulty("rowfmt", "rows")
    try:
        with pytest.raises(
            FSDPBuilderError,
            match=r"format 'rowfmt' read 'weight' as shape \[1, 16\] where its tensors\(\) "
            r"listed \[4, 16\].*broadcast",
        ):
            FSDPBuilder().device(CPUDevice()).materialize(
                FromCheckpoint(linear_file("rowfmt"))
            ).build(meta_linear())
    finally:
        unregister_format("rowfmt")


def test_a_format_reading_another_dtype_than_it_lists_is_refused(
    world1: None, linear_file: Callable[[str], Path]
) -> None:
    register_faulty("dtypefmt", "dtype")
    try:
        with pytest.raises(
            FSDPBuilderError,
            match=r"format 'dtypefmt' read 'weight' as torch\.float64 where its tensors\(\) "
            r"listed torch\.float32",
        ):
            FullyShardBuilder().device(CPUDevice()).materialize(
                FromCheckpoint(linear_file("dtypefmt"))
            ).build(meta_linear())
    finally:
        unregister_format("dtypefmt")


def test_a_format_that_reads_what_it_lists_still_loads(
    world1: None, linear_file: Callable[[str], Path]
) -> None:
    register_faulty("goodfmt", "none")
    path = linear_file("goodfmt")
    try:
        built = (
            FSDPBuilder().device(CPUDevice()).materialize(FromCheckpoint(path)).build(meta_linear())
        )
    finally:
        unregister_format("goodfmt")
    want = load_file(str(path))
    got = built.state_dict()
    for key in want:
        assert torch.equal(got[key].cpu(), want[key]), key


def test_a_format_whose_detect_raises_is_named(world1: None, tmp_path: Path) -> None:
    def detect(path: Path) -> bool:
        raise ValueError("the header cannot be parsed")

    (tmp_path / "x.bin").write_bytes(b"")
    register_format("brokenfmt", detect, partial(SafetensorsLike, fault="none"))
    model = meta_linear()
    try:
        with pytest.raises(
            ConfigurationError,
            match=r"checkpoint format 'brokenfmt' \(registered with register_format\) raised "
            r"ValueError: the header cannot be parsed in its detect function.*"
            r"unregister_format\('brokenfmt'\)",
        ):
            FSDPBuilder().device(CPUDevice()).materialize(FromCheckpoint(tmp_path / "x.bin")).build(
                model
            )
    finally:
        unregister_format("brokenfmt")
    assert all(p.is_meta for p in model.parameters())


# -- a transformers _init_weights that leaves a state unwritten: refused in configure ----------


def tiny_classes(
    writes_gain: bool, writes_bias: bool = True
) -> tuple[type[nn.Module], Any, type[nn.Module]]:
    from transformers import PretrainedConfig, PreTrainedModel

    class Scale(nn.Module):
        """A module with a parameter of its own and no reset_parameters()."""

        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.empty(4))
            self.proj = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(x) * self.gain

    class TinyConfig(PretrainedConfig):
        model_type = "tiny_unwritten"

    class Tiny(PreTrainedModel):
        config_class = TinyConfig

        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.scale = Scale()
            self.head = nn.Linear(4, 4)
            self.post_init()

        def _init_weights(self, module: nn.Module) -> None:
            if isinstance(module, nn.Linear):
                nn.init.constant_(module.weight, 0.5)
                if writes_bias:
                    nn.init.zeros_(module.bias)
            elif writes_gain and isinstance(module, Scale):
                nn.init.constant_(module.gain, 2.0)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.scale(x))

    return Scale, TinyConfig, Tiny


@pytest.mark.parametrize("builder", [FSDPBuilder, FullyShardBuilder])
def test_init_weights_leaving_a_state_unwritten_is_refused_before_any_change(
    world1: None, builder: Callable[[], Any]
) -> None:
    scale, config, tiny = tiny_classes(writes_gain=False)
    with torch.device("meta"):
        model = tiny(config())
    before = [(name, type(m)) for name, m in model.named_modules()]
    with pytest.raises(
        MaterializationError,
        match=r"Tiny\._init_weights does not set gain of Scale \('scale'\), which has no "
        r"reset_parameters\(\)\. Register one: `register_initializer\(Scale, fn\)`",
    ):
        builder().device(CPUDevice()).wrap(scale).materialize(ResetParameters()).build(model)
    assert [(name, type(m)) for name, m in model.named_modules()] == before
    assert all(p.is_meta for p in model.parameters())


def test_init_weights_writing_every_state_builds_as_eager_construction(world1: None) -> None:
    scale, config, tiny = tiny_classes(writes_gain=True)
    want = tiny(config()).state_dict()  # eager: the model's own post_init
    with torch.device("meta"):
        model = tiny(config())
    built = FSDPBuilder().device(CPUDevice()).wrap(scale).materialize(ResetParameters())
    got = built.build(model).state_dict()
    for key, value in want.items():
        assert torch.equal(got[key].cpu(), value), key


@pytest.mark.parametrize("builder", [FSDPBuilder, FullyShardBuilder])
def test_init_weights_leaving_a_state_to_reset_parameters_builds_as_eager_construction(
    world1: None, builder: Callable[[], Any]
) -> None:
    # Eager: each Linear's constructor draws weight and bias, then post_init sets the weight
    # alone; the bias keeps its constructor draw.
    scale, config, tiny = tiny_classes(writes_gain=True, writes_bias=False)
    torch.manual_seed(0)
    want = tiny(config()).state_dict()
    with torch.device("meta"):
        model = tiny(config())
    torch.manual_seed(0)
    got = builder().device(CPUDevice()).wrap(scale).materialize(ResetParameters()).build(model)
    state = {k: v.cpu() for k, v in full_state_dict(got).items()}
    assert want.keys() == state.keys()
    for key, value in want.items():
        assert torch.equal(state[key], value), key
    assert want["head.bias"].abs().max() > 0  # the constructor's draw, not a constant


# -- raw errors: registries, torch versions, the plan command ----------------------------------


def test_checkpoint_rules_that_are_not_a_list_are_refused() -> None:
    with pytest.raises(
        ConfigurationError,
        match=r"`register_checkpoint_rules` got an invalid `rules`: expected a sequence of "
        r"Rename and MergeExperts rules, got NoneType None",
    ):
        register_checkpoint_rules("tiny_none", None)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"invalid `rules`: .*got Rename"):
        register_checkpoint_rules("tiny_one", Rename("a", "b"))  # type: ignore[arg-type]


def test_checkpoint_rules_from_a_generator_are_all_kept() -> None:
    rules: list[Rename | MergeExperts] = [
        Rename(r"\.moe\.", ".mlp."),
        MergeExperts((".experts.*.w1.weight",), ".experts.up_proj"),
    ]
    register_checkpoint_rules("tiny_generated", (r for r in rules))

    class Config:
        model_type = "tiny_generated"

    class Model:
        config = Config()

    try:
        assert checkpoint_rules(Model()) == tuple(rules)
    finally:
        unregister_checkpoint_rules("tiny_generated")


def test_an_unreadable_torch_version_is_taken_for_the_newest_known(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch, "__version__", "custom-build-7f3a")
    with pytest.warns(RuntimeWarning, match=r"cannot read the torch version 'custom-build-7f3a'"):
        release = versions.torch_release()
    newest = max(f.minimum for f in versions.FEATURES.values())
    assert release == newest
    assert all(versions.supports(name) for name in versions.FEATURES)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per version, not at every gate
        versions.require(versions.FSDP2_SHARDED_GLOO, "FullyShardBuilder.sharding", "strategy")


def llama_folder(root: Path, name: str, **changes: Any) -> Path:
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=100,
    ).to_dict()
    config.update(changes, architectures=["LlamaForCausalLM"])
    folder = root / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"hidden_size": -64}, r"sets hidden_size=-64, which is not a size"),
        ({"num_hidden_layers": "two"}, r"sets num_hidden_layers='two', which is not a size"),
        (
            {"num_attention_heads": 3},
            r"is not a configuration transformers accepts .*multiple of the number of "
            r"attention heads",
        ),
    ],
)
def test_plan_of_a_broken_config_names_the_setting(
    tmp_path: Path, changes: dict[str, Any], words: str
) -> None:
    folder = llama_folder(tmp_path, "model", **changes)
    with pytest.raises(
        SystemExit, match=r"`fsdp-builder plan` got an invalid `FOLDER`: .*" + words
    ):
        cli.main(["plan", str(folder)])


def test_plan_command_reports_a_broken_config_without_a_traceback(tmp_path: Path) -> None:
    folder = llama_folder(tmp_path, "negative", hidden_size=-64)
    done = subprocess.run(
        [sys.executable, "-m", "fsdp_builder", "plan", str(folder)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    assert "hidden_size=-64" in done.stderr
    assert done.stdout == ""


# -- refusals that name what was passed --------------------------------------------------------


def test_checkpointing_a_class_the_model_lacks_names_it(world1: None) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(
        ConfigurationError,
        match=r"activation_checkpointing` got an invalid `policy`: it chooses no module of "
        r"Sequential \(no module is a GRU\)",
    ):
        FSDPBuilder().device(CPUDevice()).activation_checkpointing(nn.GRU).build(model)
    assert [type(m) for m in model] == [nn.Linear, nn.ReLU, nn.Linear]
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_wrap_with_the_no_split_class_itself_says_call_it() -> None:
    with pytest.raises(
        ConfigurationError,
        match=r"`ShardingBuilder\.wrap` got an invalid `policy`: the class NoSplitModules was "
        r"given, not an instance of it\. Call it: `\.wrap\(NoSplitModules\(\)\)`",
    ):
        FSDPBuilder().wrap(NoSplitModules)


def test_wrap_takes_a_generator_of_classes(world1: None) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    sharded = FSDPBuilder().device(CPUDevice()).wrap(c for c in (nn.Linear,)).build(model)
    inner = sharded.module
    assert isinstance(inner, nn.Sequential)
    assert [type(m) for m in inner] == [FullyShardedDataParallel, nn.ReLU, FullyShardedDataParallel]


def test_wrap_with_an_empty_generator_is_refused() -> None:
    with pytest.raises(
        ConfigurationError,
        match=r"`ShardingBuilder\.wrap` got an invalid `policy`: expected nn\.Module "
        r"subclasses, got an empty collection",
    ):
        none: tuple[type[nn.Module], ...] = ()
        FSDPBuilder().wrap(c for c in none)


# -- registries differ between ranks: refused in configure on every rank -----------------------


class OnlyHere(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)


def _meta_pair() -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(OnlyHere(), OnlyHere())


def _attempt(register: Callable[[], None], undo: Callable[[], None]) -> dict[str, Any]:
    """Register on rank 1 only, build, and say what the build raised and what it left."""
    if dist.get_rank() == 1:
        register()
    model = _meta_pair()
    error = ""
    try:
        FullyShardBuilder().device(CPUDevice()).wrap(OnlyHere).materialize(ResetParameters()).build(
            model
        )
    except FSDPBuilderError as exc:
        error = f"{type(exc).__name__}: {exc}"
    finally:
        if dist.get_rank() == 1:
            undo()
    return {
        "error": error,
        "all_meta": all(p.is_meta for p in model.parameters()),
        "types": [type(m).__name__ for m in model.modules()],
    }


def _drop_initializer() -> None:
    from fsdp_builder.materializers import conventions

    conventions._REGISTERED.pop(OnlyHere, None)
    conventions._REGISTERED_BY_TYPE.clear()


def _fill_fc(module: nn.Module) -> None:
    nn.init.constant_(module.get_parameter("fc.weight"), 1.0)


def registry_ranks() -> Results:
    def cases() -> Iterator[tuple[Hashable, Callable[[], Any]]]:
        yield (
            "initializer",
            partial(_attempt, partial(register_initializer, OnlyHere, _fill_fc), _drop_initializer),
        )
        yield (
            "format",
            partial(
                _attempt,
                partial(register_faulty, "rank1fmt", "none"),
                partial(unregister_format, "rank1fmt"),
            ),
        )
        yield (
            "rules",
            partial(
                _attempt,
                partial(register_checkpoint_rules, "rank1_only", []),
                partial(unregister_checkpoint_rules, "rank1_only"),
            ),
        )

    return run_each(cases(), stall_seconds=20)


SPAWNS = Spawns(registry_ranks, timeout=120)


@pytest.mark.parametrize(
    ("key", "setting"),
    [
        ("initializer", r"register_initializer=\{.*OnlyHere: .*_fill_fc"),
        ("format", r"register_format=\[Format\(name='rank1fmt'"),
        ("rules", r"register_checkpoint_rules=\{'rank1_only': \[\]\}"),
    ],
)
def test_a_registration_on_one_rank_only_is_refused_on_every_rank(key: str, setting: str) -> None:
    got = values(SPAWNS(2), key)
    # The error crossed a process boundary as text: matched as pytest.raises would match it.
    assert got[0]["error"] == got[1]["error"]
    assert re.search(
        r"RankDisagreementError: stage 'configure' failed on rank\(s\) 1.*rank 1 has " + setting,
        got[0]["error"],
        re.S,
    ), got[0]["error"]
    for rank in got:
        assert rank["all_meta"]
        assert rank["types"] == ["Sequential", "OnlyHere", "Linear", "OnlyHere", "Linear"]
