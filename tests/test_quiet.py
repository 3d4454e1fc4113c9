"""Quiet by default: with no logging and no structlog configured, no public entry point writes a
line to stdout or stderr; with logging or structlog configured by the application, the library's
events reach it.

Each test runs one clean interpreter (``python -c``), so that nothing this test session
configured (pytest's logging capture, structlog set up by other tests) can hide a line.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

# Event names of the library's module-level loggers, the ones that once bypassed its route.
EVENTS = (
    "stream_init_whole_tensors",
    "checkpoint_opened",
    "checkpoint_format_registered",
    "checkpoint_rules_registered",
    "torch too old",
)

# A model with a padding embedding (the FSDP2 default initializes it whole), wrap units, a norm.
MODEL = """
import torch
import torch.distributed as dist
from torch import nn


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.fc(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8, padding_idx=0)
        self.blocks = nn.Sequential(Block(), Block())
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.norm(self.blocks(self.embed(x))))

    def init_weights(self) -> None:
        for m in self.modules():
            if m is not self and hasattr(m, "reset_parameters"):
                m.reset_parameters()


def meta_net():
    with torch.device("meta"):
        return Net()


dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
"""

QUIET = r"""
import json
import sys
import warnings
from pathlib import Path

import transformers
from safetensors.torch import save_file

import fsdp_builder as fb
from fsdp_builder import versions
from fsdp_builder.planning.ignored import IgnoredStates
from fsdp_builder.sources import open_source, unregister_checkpoint_rules, unregister_format
from fsdp_builder.tools.estimate import format_training, training_estimate
from fsdp_builder.tools.hf_plan import meta_model_from_config

# Python warnings are another channel (the library's for conditions the user should act on,
# and torch's own): they are recorded here and handed back, so stdout and stderr hold only
# what a logger or a print wrote.
recorded = warnings.catch_warnings(record=True)
caught = recorded.__enter__()
warnings.simplefilter("always")

tmp = Path(sys.argv[1])
state = {k: v.clone() for k, v in Net().state_dict().items()}
(tmp / "st").mkdir()
save_file(state, str(tmp / "st" / "model.safetensors"))
torch.save(state, tmp / "weights.pt")
torch.save(state, tmp / "weights.toy")

fb.register_format(
    "toy", lambda p: p.suffix == ".toy", lambda p: open_source(torch.load(p, weights_only=True))
)
fb.register_checkpoint_rules("toy_model", [fb.Rename(r"^old\.", "new.")])
fb.register_initializer(Block, lambda m: m.fc.reset_parameters())
fb.register_subtree_rule(Block, lambda p: None)

def init_fn(module):
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()

materializers = {
    "default": None,
    "ResetParameters": fb.ResetParameters(),
    "DeterministicInit": fb.DeterministicInit(seed=1),
    "StreamInit": fb.StreamInit(whole_below=0),
    "ShardFirstReset": fb.ShardFirstReset(),
    "InitWeights": fb.InitWeights(),
    "InitFn": fb.InitFn(init_fn, allocate=True),
    "KeepAsIs": fb.KeepAsIs(),
    "FromStateDict": fb.FromStateDict(state),
    "FromCheckpoint(safetensors)": fb.FromCheckpoint(tmp / "st"),
    "FromCheckpoint(torch file)": fb.FromCheckpoint(tmp / "weights.pt"),
    "FromCheckpoint(registered format)": fb.FromCheckpoint(tmp / "weights.toy"),
}
outcome = {}
for backend in (fb.FSDPBuilder, fb.FullyShardBuilder):
    for name, materializer in materializers.items():
        builder = backend().device(fb.CPUDevice()).wrap(Block)
        if materializer is not None:
            builder = builder.materialize(materializer)
        try:
            built = builder.build(Net() if name == "KeepAsIs" else meta_net())
            built(torch.tensor([0, 1, 2])).sum().backward()
            outcome[f"{backend.__name__}/{name}"] = "built"
        except fb.FSDPBuilderError as exc:
            outcome[f"{backend.__name__}/{name}"] = type(exc).__name__
    fb.save_hf_checkpoint(built, tmp / f"export-{backend.__name__}")
    outcome[f"{backend.__name__}/save_hf_checkpoint"] = sorted(
        p.name for p in (tmp / f"export-{backend.__name__}").iterdir()
    )

# A tiny transformers model: the CLI's plan of its config.json, and a default build of it.
config = transformers.LlamaConfig(
    vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=2, pad_token_id=0,
)
config.architectures = ["LlamaForCausalLM"]
config.save_pretrained(tmp / "llama")
llama = meta_model_from_config(tmp / "llama")
plan = fb.plan_units(llama, fb.WrapPolicy(), IgnoredStates())
format_training(training_estimate(plan, 8), 8)
built = fb.FullyShardBuilder().device(fb.CPUDevice()).build(llama)
outcome["llama"] = type(built).__name__

# The version gate, as on a torch too old for a feature.
release = versions.torch_release
versions.torch_release = lambda: (2, 0)
try:
    versions.require(versions.DCP_NO_DIST, "FromCheckpoint", "source")
except fb.ConfigurationError:
    outcome["version_gate"] = "refused"
finally:
    versions.torch_release = release

unregister_format("toy")
unregister_checkpoint_rules("toy_model")
dist.destroy_process_group()
recorded.__exit__(None, None, None)
outcome["warnings"] = [str(w.message) for w in caught]
(tmp / "outcome.json").write_text(json.dumps(outcome))
"""

LOUD = """
import logging
import sys
from pathlib import Path

import structlog
from safetensors.torch import save_file

import fsdp_builder as fb

tmp = Path(sys.argv[1])
save_file(Net().state_dict(), str(tmp / "model.safetensors"))

def build(materializer):
    fb.FullyShardBuilder().device(fb.CPUDevice()).wrap(Block).materialize(materializer).build(
        meta_net()
    )

# Configured after the import, as applications do: the route is chosen at each event.
logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)
build(fb.StreamInit(whole_below=0))  # shard by shard: its whole-tensor event
build(fb.FromCheckpoint(tmp))
structlog.configure(
    processors=[structlog.processors.JSONRenderer()],
    logger_factory=structlog.PrintLoggerFactory(sys.stdout),
)
build(fb.StreamInit(whole_below=0))  # shard by shard: its whole-tensor event
build(fb.FromCheckpoint(tmp))
dist.destroy_process_group()
"""


def _run(script: str, folder: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(MODEL) + textwrap.dedent(script), str(folder)],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=folder,
    )


def test_no_entry_point_prints_without_logging_configured(tmp_path: Path) -> None:
    proc = _run(QUIET, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr == ""
    outcome = json.loads((tmp_path / "outcome.json").read_text())
    warned = outcome.pop("warnings")
    assert not [w for w in warned if any(event in w for event in EVENTS)]
    exports = {k: outcome.pop(k) for k in list(outcome) if k.endswith("/save_hf_checkpoint")}
    assert exports == {
        f"{backend}/save_hf_checkpoint": ["model.safetensors"]
        for backend in ("FSDPBuilder", "FullyShardBuilder")
    }
    # Every entry point ran: each build (12 per backend) completed a training step, except one
    # refused combination (an initializer writing an FSDP1 unit's flattened parameters).
    assert len(outcome) == 2 * 12 + 2
    assert {k: v for k, v in outcome.items() if v != "built"} == {
        "FSDPBuilder/InitWeights": "ConfigurationError",
        "llama": "FSDPLlamaForCausalLM",
        "version_gate": "refused",
    }


def test_events_reach_logging_and_structlog_when_configured(tmp_path: Path) -> None:
    proc = _run(LOUD, tmp_path)
    assert proc.returncode == 0, proc.stderr
    # logging.basicConfig: one key=value line per event, on stderr, through the module's logger.
    lines = proc.stderr.splitlines()
    for prefix in [
        "DEBUG:fsdp_builder.materializers.streams:event='stream_init_whole_tensors'",
        "DEBUG:fsdp_builder.sources.registry:event='checkpoint_opened'",
        "INFO:fsdp_builder.pipeline:event='build_done'",
    ]:
        assert sum(line.startswith(prefix) for line in lines) >= 1, prefix
    assert "module='embed'" in proc.stderr and "format='safetensors-file-folder'" in proc.stderr
    # structlog.configure: the application's processors and output (JSON lines on stdout).
    events = [json.loads(line) for line in proc.stdout.splitlines()]
    names = [e["event"] for e in events]
    assert "stream_init_whole_tensors" in names and "checkpoint_opened" in names
    opened = next(e for e in events if e["event"] == "checkpoint_opened")
    assert opened["format"] == "safetensors-file-folder" and opened["path"] == str(tmp_path)
