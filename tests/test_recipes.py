"""Every recipe in docs/recipes/ runs as its page says, on CPU ranks (gloo)."""

from __future__ import annotations

import math
import socket
import subprocess
import sys
from collections.abc import Callable, Hashable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from isolated import Results, Spawns, run_each, values
from models import RECIPES, recipe_module

# What these tests start runs ranks (torchrun, the command line, the harness) on both cores.
pytestmark = pytest.mark.cores(2)

REPO = Path(__file__).resolve().parent.parent
TORCHRUN = (sys.executable, "-m", "torch.distributed.run")
TESTED = {
    "torchrun_one_node.py",
    "multinode.py",
    "llama_train.py",
    "custom_strategies.py",
    "composition.py",
    "resume.py",
    "hugging_face.py",
}


def torchrun(*args: str, timeout: float = 150) -> str:
    proc = subprocess.run(
        [*TORCHRUN, *args], capture_output=True, text=True, timeout=timeout, check=False, cwd=REPO
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def floats(line: str) -> list[float]:
    return [float(x) for x in line.split("losses:")[1].split()]


def test_every_recipe_script_is_tested_and_shown() -> None:
    scripts = {p.name for p in RECIPES.glob("*.py")} - {"llama_model.py"}  # a module, not a job
    assert scripts == TESTED
    pages = "\n".join(p.read_text() for p in RECIPES.glob("*.md"))
    for name in sorted(scripts | {"llama_model.py"}):
        assert f'--8<-- "docs/recipes/{name}"' in pages, f"{name} is not shown on a page"


@pytest.mark.timeout(180)
def test_torchrun_one_node() -> None:
    out = torchrun("--nproc-per-node", "2", "--standalone", "docs/recipes/torchrun_one_node.py")
    lines = sorted(line for line in out.splitlines() if "losses:" in line)
    assert [line.split()[1] for line in lines] == ["0/2", "1/2"]
    for line in lines:
        losses = floats(line)
        assert len(losses) == 3 and losses == sorted(losses, reverse=True)


@pytest.mark.timeout(180)
def test_several_nodes_with_c10d_rendezvous() -> None:
    with socket.socket() as s:  # a port free now, for the rendezvous the first node hosts
        s.bind(("127.0.0.1", 0))
        endpoint = f"127.0.0.1:{s.getsockname()[1]}"
    command = [
        *TORCHRUN,
        "--nnodes", "2",
        "--nproc-per-node", "2",
        "--rdzv-backend", "c10d",
        "--rdzv-endpoint", endpoint,
        "--rdzv-id", "recipe",
        "docs/recipes/multinode.py",
    ]  # fmt: skip
    nodes = [
        subprocess.Popen(
            command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outs = []
    try:
        for node in nodes:
            out, err = node.communicate(timeout=150)
            assert node.returncode == 0, out + err
            outs.append(out)
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    lines = sorted(
        (line for out in outs for line in out.splitlines() if "losses:" in line),
        key=lambda line: line.split()[3],
    )
    # Two nodes of two ranks: shards inside a node, replicas across nodes.
    assert [line.split()[:4] for line in lines] == [
        ["node", "0", "rank", "0/4:"],
        ["node", "0", "rank", "1/4:"],
        ["node", "1", "rank", "2/4:"],
        ["node", "1", "rank", "3/4:"],
    ]
    for line in lines:
        assert "HYBRID_SHARD over groups of 2 ranks" in line, line
        losses = floats(line)
        assert losses == sorted(losses, reverse=True)


# -- the scripts' functions on two ranks the tests start (what main() runs under torchrun) ---
#
# One spawn runs every script's first phase, each scenario on its own (see ``isolated``); the
# resume script's second phase needs new ranks (what a second torchrun call gives): a second spawn.

BACKENDS = ("fsdp1", "fsdp2")


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("recipes")
    out = {name: root / name for name in ("hugging_face", *(f"resume-{b}" for b in BACKENDS))}
    for folder in out.values():
        folder.mkdir()
    return {name: str(folder) for name, folder in out.items()}


def first_cases(folders: dict[str, str]) -> Iterator[tuple[Hashable, Callable[[], Any]]]:
    yield "llama_train", lambda: recipe_module("llama_train").train(3)
    yield "custom_strategies", lambda: recipe_module("custom_strategies").build_and_run()
    for backend in BACKENDS:
        train = partial(recipe_phase, "resume", "train", folders[f"resume-{backend}"], backend)
        yield ("resume", "train", backend), train
    yield "hugging_face", lambda: recipe_module("hugging_face").train(folders["hugging_face"])


def second_cases(folders: dict[str, str]) -> Iterator[tuple[Hashable, Callable[[], Any]]]:
    for backend in BACKENDS:
        again = partial(recipe_phase, "resume", "resume", folders[f"resume-{backend}"], backend)
        yield ("resume", "resume", backend), again


def recipe_phase(name: str, phase: str, *args: Any) -> Any:
    return getattr(recipe_module(name), phase)(*args)


def first_phase(folders: dict[str, str]) -> Results:
    return run_each(first_cases(folders))


def second_phase(folders: dict[str, str]) -> Results:
    return run_each(second_cases(folders))


FIRST = Spawns(first_phase, timeout=300)
SECOND = Spawns(second_phase, timeout=150)


@pytest.mark.timeout(360)
def test_llama_training_script(folders: dict[str, str]) -> None:
    per_rank = values(FIRST(2, folders), "llama_train")
    for losses in per_rank:
        assert len(losses) == 3 and losses == sorted(losses, reverse=True)
        assert 4.0 < losses[0] < 6.0  # about ln(128) = 4.85 for a fresh model


@pytest.mark.timeout(360)
def test_custom_strategies(folders: dict[str, str]) -> None:
    results = values(FIRST(2, folders), "custom_strategies")
    for result in results:
        assert result["initialized"] == ["0.ff", "0.norm", "1.ff", "1.norm", "2"]
        assert result["checked"] == ["0", "1", "<root>"]
    assert results[0]["output"] == results[1]["output"]


@pytest.mark.timeout(540)
@pytest.mark.parametrize("backend", BACKENDS)
def test_resume_from_dcp_gives_the_uninterrupted_losses(
    folders: dict[str, str], backend: str
) -> None:
    # The script's two phases, each in new ranks (what two torchrun calls do).
    resume = recipe_module("resume")
    whole = values(FIRST(2, folders), ("resume", "train", backend))
    again = values(SECOND(2, folders), ("resume", "resume", backend))
    folder = Path(folders[f"resume-{backend}"])
    half = resume.STEPS // 2
    for rank in range(2):
        assert len(whole[rank]) == resume.STEPS
        assert again[rank] == whole[rank][half:], (rank, whole[rank], again[rank])
    # The export holds the resumed model under HF names (tests/test_export.py checks that an
    # export loads back bit-exact).
    # The model fits one file: model.safetensors, no index (as save_pretrained writes it).
    from safetensors import safe_open

    assert not (folder / "export" / "model.safetensors.index.json").exists()
    with safe_open(str(folder / "export" / "model.safetensors"), "pt") as f:
        assert "model.layers.1.self_attn.q_proj.weight" in f.keys()


@pytest.mark.timeout(240)
def test_tensor_parallel_checkpointing_and_compile() -> None:
    out = torchrun(
        "--nproc-per-node", "4", "--standalone", "docs/recipes/composition.py", timeout=200
    )  # fmt: skip
    losses: dict[int, list[float]] = {}
    # Ranks print concurrently: a line may hold two ranks' outputs.
    for chunk in out.split("rank ")[1:]:
        if "/4 losses:" in chunk:
            rank, rest = chunk.split("/4 losses:")
            losses[int(rank)] = [float(x) for x in rest.split()[:3]]
    assert sorted(losses) == [0, 1, 2, 3], out
    # The ranks of one TP group (0-1, 2-3) train on the same batch.
    assert losses[0] == losses[1] and losses[2] == losses[3] and losses[0] != losses[2]


@pytest.mark.timeout(480)
def test_hugging_face_fine_tune_exports_what_from_pretrained_loads(
    folders: dict[str, str],
) -> None:
    pytest.importorskip("transformers", reason="transformers is part of the test extra")
    import json

    import torch
    from transformers import AutoModelForCausalLM

    from fsdp_builder import save_hf_checkpoint

    hf = recipe_module("hugging_face")
    per_rank = values(FIRST(2, folders), "hugging_face")
    folder = Path(folders["hugging_face"])
    # The base checkpoint had several shards; so has the export, with an index and config.json.
    assert len(list((folder / "base").glob("model-*.safetensors"))) > 1
    export = folder / "export"
    index = json.loads((export / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in export.glob("*.safetensors"))
    assert len(files) > 1 and sorted(set(index["weight_map"].values())) == files
    config = json.loads((export / "config.json").read_text())
    assert config == json.loads((folder / "base" / "config.json").read_text())
    # from_pretrained in a new process, as the page's second command runs it.
    proc = subprocess.run(
        [sys.executable, "docs/recipes/hugging_face.py", "--folder", str(folder), "--phase",
         "check"],
        capture_output=True, text=True, timeout=150, check=False, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    reloaded = torch.load(folder / "reloaded.pt")
    for rank, (losses, logits) in enumerate(per_rank):
        assert len(losses) == hf.STEPS and all(math.isfinite(x) for x in losses)
        assert torch.equal(logits, reloaded), f"rank {rank}: the sharded model's logits differ"
    # Fine-tuning changed the model: the base checkpoint's logits are not the export's.
    base = AutoModelForCausalLM.from_pretrained(folder / "base")
    assert not torch.allclose(hf.eval_logits(base, torch.device("cpu")), reloaded)
    # One file: a model under max_shard_bytes round-trips through from_pretrained too.
    tuned = AutoModelForCausalLM.from_pretrained(export)
    written = save_hf_checkpoint(tuned, folder / "one")
    assert len(written.files) == 1 and (folder / "one" / "config.json").is_file()
    again = AutoModelForCausalLM.from_pretrained(folder / "one")
    assert torch.equal(hf.eval_logits(again, torch.device("cpu")), reloaded)


@pytest.mark.timeout(120)
def test_an_fsdp1_export_of_a_transformers_model_loads_with_from_pretrained(
    tmp_path: Path, world1: None
) -> None:
    # FSDP1 wraps the model: its config is found through the wrapper, as FSDP hands attributes on.
    pytest.importorskip("transformers", reason="transformers is part of the test extra")
    import torch
    from transformers import AutoModelForCausalLM

    from fsdp_builder import FromCheckpoint, FSDPBuilder, save_hf_checkpoint

    hf = recipe_module("hugging_face")
    torch.manual_seed(0)
    reference = hf.LlamaForCausalLM(hf.LlamaConfig(vocab_size=hf.VOCAB, hidden_size=32,
                                                   intermediate_size=48, num_hidden_layers=2,
                                                   num_attention_heads=2))  # fmt: skip
    reference.save_pretrained(tmp_path / "base")
    sharded = FSDPBuilder().materialize(FromCheckpoint(tmp_path / "base"))
    model = sharded.build(hf.meta_model(tmp_path / "base"))
    written = save_hf_checkpoint(model, tmp_path / "export", max_shard_bytes=20_000)
    assert len(written.files) > 1 and (tmp_path / "export" / "config.json").is_file()
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    cpu = torch.device("cpu")
    assert torch.equal(hf.eval_logits(again, cpu), hf.eval_logits(reference, cpu))
