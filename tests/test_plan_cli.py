"""``fsdp-builder plan``: the printed plan and training estimate agree with the real model, the
plan is the one the dry run builds (``--simulate``, which measures the build's peak), and a 7B
model on meta plans."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from fsdp_builder.planning.ignored import IgnoredStates
from fsdp_builder.planning.plan import plan_units
from fsdp_builder.planning.wrap import WrapPolicy
from fsdp_builder.tools.cli import main
from fsdp_builder.tools.demo import DemoTransformer, demo_model
from fsdp_builder.tools.estimate import training_estimate

REPO = Path(__file__).resolve().parent.parent
CLI = (sys.executable, "-m", "fsdp_builder")
LLAMA = REPO / "docs" / "recipes" / "llama_model.py"


def _plan_rows(text: str) -> dict[str, tuple[int, int]]:
    rows: dict[str, tuple[int, int]] = {}
    for line in text.splitlines()[1:]:
        if not line.strip():
            break
        name, params, nbytes = line.split()[:3]
        rows[name] = (int(params.replace(",", "")), int(nbytes.replace(",", "")))
    return rows


def _dry_run_command(text: str) -> list[str]:
    """The ``plan --simulate`` command the report names for the build's measured peak."""
    (line,) = [ln for ln in text.splitlines() if ln.startswith("  fsdp-builder plan ")]
    return shlex.split(line)[1:]


def _figures(text: str) -> list[str]:
    """The report but the lines naming the model (the dtype's source, the dry run command)."""
    return [
        line
        for line in text.splitlines()
        if not line.startswith(("assumptions: ", "  fsdp-builder plan "))
    ]


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@pytest.fixture(scope="module")
def model() -> DemoTransformer:
    return demo_model()


@pytest.mark.parametrize("world", [2, 4])
def test_plan_numbers_match_the_model(
    model: DemoTransformer, world: int, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main(
            [
                "plan",
                "fsdp_builder.tools.demo:demo_model",
                "--wrap",
                "Block",
                "--world-size",
                str(world),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    rows = _plan_rows(out)

    blocks = {f"blocks.{i}": b for i, b in enumerate(model.blocks)}
    assert list(rows) == [*blocks, "<root>", "total"]  # bottom-up, root last
    for name, block in blocks.items():
        assert rows[name] == (_numel(block), _numel(block) * 4)
    total = _numel(model)
    root = total - sum(_numel(b) for b in blocks.values())
    assert rows["<root>"] == (root, root * 4)
    assert rows["total"] == (total, total * 4)

    # The build's memory is the dry run's to measure: the report names the command.
    assert _dry_run_command(out) == [
        "plan", "fsdp_builder.tools.demo:demo_model", "--simulate", str(world),
        "--backend", "fsdp2", "--strategy", "full", "--wrap", "Block",
    ]  # fmt: skip
    assert "estimated per-rank memory" not in out

    units = [list(b.parameters()) for b in blocks.values()]
    block_ids = {id(p) for ps in units for p in ps}
    units.append([p for p in model.parameters() if id(p) not in block_ids])
    # FSDP1 keeps ceil(unit numel / W) of each flat parameter; FSDP2 ceil(rows / W) of each.
    fsdp1 = sum(_ceil_div(sum(p.numel() for p in ps), world) * 4 for ps in units)
    fsdp2 = sum(
        _ceil_div(p.shape[0], world) * (p.numel() // p.shape[0]) * 4 for p in model.parameters()
    )
    argv = ["plan", "fsdp_builder.tools.demo:demo_model", "--wrap", "Block", "--json"]
    layouts = [("fsdp1", "full", fsdp1), ("fsdp2", "full", fsdp2), ("fsdp2", "none", total * 4)]
    for backend, strategy, kept in layouts:
        more = ["--world-size", str(world), "--backend", backend, "--strategy", strategy]
        assert main([*argv, *more]) == 0
        training = json.loads(capsys.readouterr().out)["training"]
        assert training["params"] == kept, (backend, strategy)


def test_plan_console_command(model: DemoTransformer) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fsdp_builder",
            "plan",
            "fsdp_builder.tools.demo:demo_model",
            "--wrap",
            "Block",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert _plan_rows(proc.stdout)["total"][0] == _numel(model)


def test_plan_rejects_unknown_wrap_class() -> None:
    with pytest.raises(SystemExit, match="no module of that class"):
        main(["plan", "fsdp_builder.tools.demo:demo_model", "--wrap", "Nope"])


def test_plan_json_and_training_estimate(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "fsdp_builder.tools.demo:demo_model", "--wrap", "Block", "--world-size", "4"]
    argv += ["--backend", "fsdp1"]
    assert main([*argv, "--json", "--param-dtype", "bf16", "--optimizer", "sgd-momentum"]) == 0
    out = json.loads(capsys.readouterr().out)
    model = demo_model()
    total = _numel(model)
    assert out["params"] == total and out["world_size"] == 4
    assert [u["name"] for u in out["units"]] == ["blocks.0", "blocks.1", "blocks.2", "<root>"]
    assert "build" not in out  # the build's peak: the dry run's, measured
    assert out["dry_run"].startswith("fsdp-builder plan fsdp_builder.tools.demo:demo_model ")
    train = out["training"]
    assert train["backend"] == "fsdp1" and train["strategy"] == "full"
    assert train["shard_size"] == 4 and train["optimizer"] == "sgd-momentum"
    # FSDP1 shards each unit's flat parameter: about a quarter of the model per rank.
    assert total * 4 / 4 <= train["params"] <= total * 4 / 4 + 4 * 4 * len(out["units"])
    assert train["gradients"] == train["params"]
    assert train["optimizer_states"] == train["params"]  # one momentum buffer per parameter
    # bf16 copies gathered for compute: the root plus the two largest blocks, 2 bytes each.
    block = _numel(model.blocks[0])
    assert train["gathered_params"] == 2 * (total - 3 * block) + 2 * 2 * block
    assert train["activations"].startswith("not estimated")
    assert train["total"] == sum(
        train[k]
        for k in (
            "params",
            "buffers",
            "gradients",
            "optimizer_states",
            "gathered_params",
            "gathered_gradients",
        )
    )

    assert main([*argv, "--strategy", "none", "--optimizer", "adamw"]) == 0
    text = capsys.readouterr().out
    assert "training memory per rank: fsdp1 none at world size 4 (shards of 1)" in text
    assert "activations: not estimated" in text


def test_training_estimate_counts_every_optimizer() -> None:
    plan = plan_units(
        demo_model(), WrapPolicy(classes=(type(demo_model().blocks[0]),)), IgnoredStates()
    )
    states = {
        opt: training_estimate(plan, 2, optimizer=opt).optimizer_states
        for opt in ("adamw", "adam", "sgd", "sgd-momentum", "none")
    }
    shard = training_estimate(plan, 2).params
    assert states == {
        "adamw": 2 * shard,
        "adam": 2 * shard,
        "sgd": 0,
        "sgd-momentum": shard,
        "none": 0,
    }
    # grad_op keeps every unit gathered after forward.
    full = training_estimate(plan, 2, strategy="full")
    grad_op = training_estimate(plan, 2, strategy="grad_op")
    assert grad_op.gathered_params == plan.nbytes - sum(u.buffer_bytes for u in plan)
    assert full.gathered_params < grad_op.gathered_params


# -- one plan: the one the dry run builds -----------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["fsdp_builder.tools.demo:demo_model", "--wrap", "Block", "--world-size", "4"],
        ["fsdp_builder.tools.demo:demo_model", "--backend", "fsdp1"],
        ["{llama}", "--world-size", "4", "--strategy", "hybrid", "--devices-per-node", "2"],
    ],
    ids=["wrap-classes", "no-wrap", "transformers-hybrid"],
)
def test_the_plan_is_the_dry_runs_and_the_named_command_measures_it(
    argv: list[str], tmp_path: Path, capsys: Any
) -> None:
    pytest.importorskip("transformers")
    import transformers

    transformers.LlamaConfig(**TINY_LLAMA).save_pretrained(tmp_path / "llama")
    argv = [a.format(llama=tmp_path / "llama") for a in argv]
    assert main(["plan", *argv]) == 0
    out = capsys.readouterr().out
    plan_table = out.split("\n\n")[0]
    # The command the report names runs the build as ranks of that world size.
    command = _dry_run_command(out)
    assert main([*command, "--json"]) == 0
    run = json.loads(capsys.readouterr().out)
    world = int(command[command.index("--simulate") + 1])
    assert [r["rank"] for r in run["ranks"]] == [0, world - 1]
    assert all(r["error"] is None and r["build_peak"] > 0 for r in run["ranks"])
    # Its report shows the same unit plan, line for line.
    assert main(command) == 0
    assert "\n" + plan_table + "\n" in capsys.readouterr().out


# -- a 7B Llama on meta ----------------------------------------------------------------------

LLAMA_7B = """
from llama_model import ModelArgs, Transformer


def make():
    return Transformer(
        ModelArgs(
            dim=4096, n_layers=32, n_heads=32, vocab_size=32000, multiple_of=256,
            max_seq_len=4096,
        )
    )
"""


LLAMA_OPTIONS = ("--world-size", "64", "--param-dtype", "bf16", "--json")


# How long this takes is measured by `python -m benchmarks.dryrun_scale --timings`, not here.
@pytest.mark.timeout(300)
def test_plan_7b_llama_at_world_size_64_from_the_current_directory(tmp_path: Path) -> None:
    shutil.copy(LLAMA, tmp_path / "llama_model.py")
    (tmp_path / "mymodel.py").write_text(textwrap.dedent(LLAMA_7B))
    proc = subprocess.run(
        [*CLI, "plan", "mymodel:make", "--wrap", "TransformerBlock", *LLAMA_OPTIONS],
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
        cwd=tmp_path,  # mymodel.py is only importable from here
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    params = out["params"]
    assert 6.6e9 < params < 6.8e9  # Llama-2 7B: 6.74e9
    assert len(out["units"]) == 33  # 32 blocks + the root
    train = out["training"]
    assert train["shard_size"] == 64
    fp32_shard = params * 4 / 64
    assert fp32_shard <= train["params"] <= fp32_shard * 1.01
    assert train["optimizer_states"] == 2 * train["params"]  # AdamW
    # bf16 copies: the root (embeddings + output, 262M) and two blocks (202M each).
    assert 2 * (262e6 + 2 * 202e6) <= train["gathered_params"] <= 2 * 6.7e8 * 1.01
    assert 3e9 < train["total"] < 4e9  # ~3.4 GB per rank before activations


def test_plan_names_an_unimportable_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match="run the command from the folder that holds it"):
        main(["plan", "no_such_module_here:make"])


# -- a transformers folder -------------------------------------------------------------------

TINY_LLAMA: dict[str, Any] = {
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "tie_word_embeddings": False,
    "architectures": ["LlamaForCausalLM"],
}

FACTORY = """
from transformers import LlamaConfig, LlamaForCausalLM


def make():
    return LlamaForCausalLM(LlamaConfig(**{config!r}))
"""


@pytest.fixture
def llama_folder(tmp_path: Path) -> Path:
    """What ``save_pretrained`` writes next to the weights: the planner reads only config.json."""
    transformers = pytest.importorskip("transformers")
    transformers.LlamaConfig(**TINY_LLAMA).save_pretrained(tmp_path / "llama")
    return tmp_path / "llama"


def test_plan_of_a_transformers_folder_matches_the_model_and_a_factorys_plan(
    llama_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    import transformers

    assert main(["plan", str(llama_folder), "--world-size", "4"]) == 0
    from_folder = capsys.readouterr().out
    rows = _plan_rows(from_folder)
    # The units are the decoder layers (the model's _no_split_modules) and the root.
    assert list(rows) == ["model.layers.0", "model.layers.1", "<root>", "total"]
    eager = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA))
    layer = _numel(eager.model.layers[0])
    assert rows["model.layers.0"] == (layer, layer * 4)
    buffer_bytes = sum(b.numel() * b.element_size() for b in eager.buffers())  # RoPE
    assert buffer_bytes > 0
    assert rows["total"] == (_numel(eager), _numel(eager) * 4 + buffer_bytes)
    # The same model from a Python factory: the same plan and estimate, line for line.
    (tmp_path / "tiny_llama_factory.py").write_text(FACTORY.format(config=TINY_LLAMA))
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "tiny_llama_factory:make", "--world-size", "4"]) == 0
    # All but the line saying where the dtype came from (the config, or the factory).
    assert _figures(capsys.readouterr().out) == _figures(from_folder)
    # config.json itself names the same model.
    assert main(["plan", str(llama_folder / "config.json"), "--world-size", "4"]) == 0
    assert _figures(capsys.readouterr().out) == _figures(from_folder)


def test_plan_of_a_transformers_folder_as_json(llama_folder: Path, capsys: Any) -> None:
    assert main(["plan", str(llama_folder), "--json", "--wrap", "LlamaDecoderLayer"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [u["name"] for u in out["units"]] == ["model.layers.0", "model.layers.1", "<root>"]
    # Two RoPE buffers (inv_freq, original_inv_freq), both owned by the root.
    assert [u["buffers"] for u in out["units"]] == [0, 0, 2]


def test_a_config_without_architectures_is_a_causal_lm(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from fsdp_builder.tools.hf_plan import meta_model_from_config

    config = {k: v for k, v in TINY_LLAMA.items() if k != "architectures"}
    transformers.LlamaConfig(**config).save_pretrained(tmp_path)
    assert "architectures" not in json.loads((tmp_path / "config.json").read_text())
    model = meta_model_from_config(tmp_path)
    assert type(model) is transformers.LlamaForCausalLM
    assert all(p.is_meta for p in model.parameters())
    bert = transformers.BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2)
    bert.architectures = ["BertForMaskedLM"]
    bert.save_pretrained(tmp_path / "bert")
    assert type(meta_model_from_config(tmp_path / "bert")) is transformers.BertForMaskedLM


def test_plan_of_a_folder_without_config_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fsdp_builder.errors import ConfigurationError
    from fsdp_builder.tools.hf_plan import meta_model_from_config

    with pytest.raises(ConfigurationError, match=r"has no config\.json\. Pass a folder written"):
        meta_model_from_config(tmp_path)
    with pytest.raises(SystemExit, match=r"`fsdp-builder plan` got an invalid `FOLDER`"):
        main(["plan", str(tmp_path)])
    with pytest.raises(SystemExit, match="does not exist"):
        main(["plan", str(tmp_path / "typo")])
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers fails
    with pytest.raises(ConfigurationError, match=r"needs transformers.*pip install transformers"):
        meta_model_from_config(tmp_path)


# -- the dry run from the command line: dtype, defaults, options that would do nothing ---------


def _write_config(folder: Path, **settings: Any) -> Path:
    # config.json as save_pretrained writes it, with the dtype named as given (the older
    # `torch_dtype` key or `dtype`).
    folder.mkdir(parents=True, exist_ok=True)
    transformers = pytest.importorskip("transformers")
    transformers.LlamaConfig(**TINY_LLAMA).save_pretrained(folder)
    written = json.loads((folder / "config.json").read_text())
    written = {k: v for k, v in written.items() if k not in ("dtype", "torch_dtype")}
    (folder / "config.json").write_text(json.dumps(written | settings))
    return folder


def _chunk_bytes(world: int, rank: int, dtype: torch.dtype) -> int:
    """The bytes of rank's FSDP2 shards of the eager model: torch.chunk's rows of each."""
    import transformers

    eager = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA))
    chunks = [torch.chunk(p.detach(), world)[rank:] for p in eager.parameters()]
    return sum(c[0].numel() * dtype.itemsize for c in chunks if c)


@pytest.mark.parametrize(
    ("settings", "flag", "dtype"),
    [
        ({"torch_dtype": "bfloat16"}, [], torch.bfloat16),
        ({"dtype": "bfloat16"}, [], torch.bfloat16),
        ({"dtype": "bfloat16"}, ["--dtype", "float32"], torch.float32),
        ({}, [], torch.float32),
        ({"torch_dtype": "float16"}, [], torch.float16),
    ],
)
def test_the_dry_run_takes_the_configs_dtype_and_simulates_the_first_and_last_rank(
    tmp_path: Path, settings: dict[str, str], flag: list[str], dtype: torch.dtype, capsys: Any
) -> None:
    folder = _write_config(tmp_path / "llama", **settings)
    world = 5  # 96 rows over 5 ranks: the last rank holds fewer
    assert main(["plan", str(folder), "--simulate", str(world), "--json", *flag]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["backend"] == "fsdp2"  # FullyShardBuilder's, as the quick start builds
    assert [r["rank"] for r in out["ranks"]] == [0, world - 1]
    for r in out["ranks"]:
        assert r["param_bytes"] == _chunk_bytes(world, r["rank"], dtype)
        assert {s["dtype"] for s in r["shards"]} == {str(dtype)}
    assert f"parameters in {str(dtype).removeprefix('torch.')}" in out["assumptions"]
    assert "MALLOC_MMAP_THRESHOLD_" in out["assumptions"]
    # The estimates without --simulate count the same dtype.
    assert main(["plan", str(folder), "--json", *flag]) == 0
    import transformers

    eager = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA))
    nn.Module.to(eager, dtype)
    assert json.loads(capsys.readouterr().out)["bytes"] == sum(
        t.numel() * t.element_size() for t in [*eager.parameters(), *eager.buffers()]
    )


@pytest.mark.parametrize(
    ("extra", "option"),
    [
        (["--rank", "1"], "--rank"),
        (["--checkpoint", "{folder}"], "--checkpoint"),
        (["--builder", "mod:make"], "--builder"),
        (["--simulate", "2", "--world-size", "8"], "--world-size"),
        (["--simulate", "2", "--optimizer", "sgd"], "--optimizer"),
        (["--simulate", "2", "--param-dtype", "bf16"], "--param-dtype (--mixed-precision)"),
        (["--simulate", "2", "--builder", "mod:make", "--checkpoint", "{folder}"], "--checkpoint"),
        (["--simulate", "2", "--builder", "mod:make", "--backend", "fsdp1"], "--backend"),
        (["--simulate", "2", "--builder", "mod:make", "--wrap", "LlamaDecoderLayer"], "--wrap"),
        (["--simulate", "2", "--builder", "mod:make", "--strategy", "hybrid"], "--strategy"),
        (["--simulate", "4", "--devices-per-node", "2"], "--devices-per-node"),
        (["--step"], "--step"),
        (["--simulate", "2", "--batch", "4"], "--batch"),
        (["--simulate", "2", "--seq", "64"], "--seq"),
        (["--simulate", "2", "--activation-checkpointing"], "--activation-checkpointing"),
        (["--simulate", "2", "--mixed-precision", "bf16"], "--param-dtype (--mixed-precision)"),
        (
            ["--simulate", "2", "--step", "--builder", "mod:make", "--mixed-precision", "bf16"],
            "--param-dtype (--mixed-precision)",
        ),
        (
            ["--simulate", "2", "--step", "--builder", "mod:make", "--activation-checkpointing"],
            "--activation-checkpointing",
        ),
    ],
)
def test_an_option_that_would_change_nothing_is_refused_naming_it(
    tmp_path: Path, extra: list[str], option: str, capsys: Any
) -> None:
    folder = _write_config(tmp_path / "llama")
    argv = ["plan", str(folder), *(a.format(folder=folder) for a in extra)]
    with pytest.raises(SystemExit) as refused:
        main(argv)
    message = str(refused.value)
    assert f"{option} has no effect" in message and "\n" not in message
    assert capsys.readouterr().out == ""  # nothing computed, nothing printed
    assert not torch.distributed.is_initialized()


def test_the_dry_runs_step_from_the_command_line_counts_the_optimizer_and_the_options(
    tmp_path: Path, capsys: Any
) -> None:
    # Its figures against measured steps: tests/test_dryrun_step.py. Here: the options reach the
    # step. AdamW keeps two states of every shard: torch.chunk's rows of the eager model.
    folder = _write_config(tmp_path / "llama")
    step = ["--step", "--batch", "2", "--seq", "16", "--json"]
    peaks = {}
    for name, extra in {
        "adamw": [],
        "sgd": ["--optimizer", "sgd"],
        "ac": ["--activation-checkpointing"],
        "bf16": ["--mixed-precision", "bf16"],
        "fsdp1": ["--backend", "fsdp1"],
    }.items():
        assert main(["plan", str(folder), "--simulate", "2", *step, *extra]) == 0
        out = json.loads(capsys.readouterr().out)
        assert "batch 2 x sequence 16" in out["assumptions"]
        peaks[name] = [r["step_peak"] for r in out["ranks"]]
    for rank, peak in enumerate(peaks["adamw"]):
        shards = _chunk_bytes(2, rank, torch.float32)
        assert shards * 2 <= peak["optimizer state"] <= shards * 2 + 1024, rank
        assert not peaks["sgd"][rank].get("optimizer state")
        assert peaks["ac"][rank]["activations"] < peak["activations"]
        assert peaks["bf16"][rank]["gathered parameters"] < peak["gathered parameters"]
        assert peaks["fsdp1"][rank]["optimizer state"] >= shards * 2
    # A factory's model has no inputs the command line knows: refused, naming the way.
    refused = r"--step needs the model's inputs.*simulate\(\.\.\., step="
    with pytest.raises(SystemExit, match=refused):
        main(["plan", "fsdp_builder.tools.demo:DemoTransformer", "--simulate", "2", "--step"])


def test_the_steps_optimizers_are_the_estimates() -> None:
    # One vocabulary: the command line offers the estimate's names and the step looks them up.
    from fsdp_builder.tools.dryrun import OPTIMIZERS
    from fsdp_builder.tools.estimate import OPTIMIZER_STATES

    assert set(OPTIMIZERS) == set(OPTIMIZER_STATES)
