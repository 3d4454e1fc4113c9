"""The conformance matrix: every combination of the builder's defaults against an oracle written
in plain PyTorch.

A cell is one choice on each axis (``AXES``). Every rank of a spawn builds the cell's model in
the cell's state, builds it with the library, gathers the full state and runs one training step;
the test process then compares what the ranks gathered with :func:`expected`, which defines the
result without the library: eager ``Net()`` / ``LlamaForCausalLM(config)`` values, the checkpoint
the loaders read, and the documented contract of each materializer and synchronizer:

- a loader gives every state the checkpoint's value (a state the checkpoint lacks is computed by
  the model, as eager construction computes it);
- ignored modules are the user's, as in plain FSDP: one on meta is refused; an ignored
  parameter is materialized with its module;
- ``KeepAsIs`` refuses states on meta; ``DeterministicInit`` and ``InitWeights`` initialize
  every state but real ignored ones; the other initializers only states on meta, and leave
  real ones as they are;
  ``InitWeights`` writes the whole model after the last unit, so it refuses FSDP1 and any
  synchronizer (which works unit by unit);
- a synchronizer that takes rank 0's values gives every rank rank 0's states after rank 0's own
  materialization (ignored states excepted: they are never synchronized, as in plain FSDP);
  ``VerifyReplicas`` refuses, on every rank, states that differ between ranks;
- with no synchronizer and states that differ between ranks, each rank's local shard of a
  parameter is its own rows of its own value, as plain ``fully_shard`` takes them
  (``distribute_tensor`` with no source rank); FSDP1 gathers such rows from every rank, which
  only the ranks' own values define.

Values drawn at random by an initializer have no single eager value, and each is checked by
what its materializer promises (:class:`Drawn`): ``DeterministicInit`` and ``StreamInit`` (and
FSDP2's default, which is ``StreamInit``) promise the same full weights at any world size, on
both backends and in every group layout, so their draws must be equal across every cell of the
same model (:func:`judge_across`); the other initializers promise eager init's distribution,
so each drawn tensor must fall within the per-tensor statistics of eager construction under many
seeds (:func:`distribution_verdict`); ``InitWeights`` promises what the model's own
``init_weights()`` gives after eager construction, so its statistics are of that. Elements
whose value does not depend on the seed (BatchNorm statistics, LayerNorm weights, RoPE tables,
an embedding's padding row) are held to that value exactly, in every cell. Every state's dtype
is the plain model's.

Real models run forwards in train mode before they are built, so BatchNorm statistics are
away from their defaults and a synchronizer or loader that skips buffers is seen. After the
build, every rank trains one SGD step; each rank's result is compared with the same step in
plain PyTorch, taken from the states the rank gathered before its step (gradients averaged over
the data-parallel ranks, an ignored parameter's kept local, as FSDP does).

A refusal is pinned by exception type and message on every rank; the ranks must leave the
model untouched and issue no collective but the agreement's before it (counted by wrapping
``torch.distributed``'s collectives in the ranks).
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import random
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

# -- the axes -----------------------------------------------------------------------------------

BACKENDS = ("fsdp1", "fsdp2")
MATERIALIZERS = (
    "default",
    "KeepAsIs",
    "ResetParameters",
    "ShardFirstReset",
    "StreamInit",
    "DeterministicInit",
    "InitFn",
    "InitWeights",
    "FromStateDict",
    "FromCheckpoint",  # one .safetensors file
    "FromCheckpoint:index",  # a folder of shards with model.safetensors.index.json
    "FromCheckpoint:dcp",  # a torch.distributed.checkpoint folder
    "FromCheckpoint:keymap",  # one file whose names a key_map maps to the model's
)
SYNCHRONIZERS = ("none", "BroadcastFromRank0", "VerifyReplicas", "Chain")
# "empty": built under accelerate.init_empty_weights() (parameters on meta, buffers real).
STATES = ("meta", "empty", "equal", "differ", "rank0", "part")
GROUPS = ("default", "mesh1d", "mesh2d", "hybrid", "auto")
WORLDS = (1, 2, 3, 4)
MODELS = ("net", "llama")
# The models built: the Llama, the net with a 0-dim parameter and with a one-element one.
VARIANTS = ("net0", "net1", "llama")
IGNORES = ("none", "module", "param")
# "block": the first block's parameters frozen (requires_grad=False) before the build.
FROZEN = ("none", "block")

AXES: dict[str, tuple[Any, ...]] = {
    "backend": BACKENDS,
    "materializer": MATERIALIZERS,
    "synchronizer": SYNCHRONIZERS,
    "state": STATES,
    "groups": GROUPS,
    "world": WORLDS,
    "model": MODELS,
    "ignore": IGNORES,
    "frozen": FROZEN,
}

# Seeds: the model's real values (rank r adds r in the "differ" state), the checkpoint's, and
# the global RNG every rank starts its build from.
REAL_SEED = 100
CHECKPOINT_SEED = 7
BUILD_SEED = 1234


class Cell(NamedTuple):
    backend: str
    materializer: str
    synchronizer: str
    state: str
    groups: str
    world: int
    model: str
    ignore: str
    frozen: str = "none"

    @property
    def key(self) -> str:
        return "/".join(str(v) for v in self)


def valid(cell: Cell) -> bool:
    """The combinations that exist: hybrid layouts need 4 ranks (2 x 2) and one world size of 1
    has no second dimension; the Llama is wrapped by its decoder layers and not given ignored
    states; ``InitFn`` and ``InitWeights`` need module initializers the Llama does not have
    (transformers initializes through ``_init_weights``)."""
    if cell.groups in ("mesh2d", "hybrid", "auto") and cell.world != 4:
        return False
    if cell.model == "llama" and (
        cell.ignore != "none" or cell.materializer in ("InitFn", "InitWeights")
    ):
        return False
    return True


def full_product() -> list[Cell]:
    cells = [Cell(*values) for values in itertools.product(*AXES.values())]
    return [c for c in cells if valid(c)]


def pairwise(seed: int = 0, candidates: int = 60) -> list[Cell]:
    """A greedy cover of every valid pair of axis values: each new cell is the one of
    ``candidates`` random valid cells that covers the most pairs not covered yet."""
    every = full_product()
    names = list(AXES)

    def pairs(cell: Cell) -> set[tuple[int, Any, int, Any]]:
        return {(i, cell[i], j, cell[j]) for i, j in itertools.combinations(range(len(names)), 2)}

    uncovered: set[tuple[int, Any, int, Any]] = set()
    for cell in every:
        uncovered |= pairs(cell)
    rng = random.Random(seed)
    chosen: list[Cell] = []
    while uncovered:
        # One uncovered pair is always covered, so the cover ends.
        i, a, j, b = min(uncovered, key=repr)
        fitting = [c for c in every if c[i] == a and c[j] == b]
        pool = [rng.choice(fitting) for _ in range(candidates)]
        best = max(pool, key=lambda c: len(pairs(c) & uncovered))
        chosen.append(best)
        uncovered -= pairs(best)
    return sorted(set(chosen), key=lambda c: (c.world, c.key))


# -- the models ----------------------------------------------------------------------------------


class Cls(nn.Module):
    """A [1, 1, dim] token, like ViT's ``cls_token``: one row, so ranks past the first hold an
    empty shard."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.token = nn.Parameter(torch.empty(1, 1, dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.token, std=0.02)


class Scale(nn.Module):
    """A 0-dim parameter, like CLIP's ``logit_scale`` (neither backend shards one: it has one
    element unless it is ignored)."""

    def __init__(self, scalar: bool) -> None:
        super().__init__()
        self.value = nn.Parameter(torch.empty(() if scalar else (1,)))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.constant_(self.value, 2.5)


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.norm(self.lin(x))


class Net(nn.Module):
    """Every feature the matrix asks for in one small model: an embedding with a padding row
    tied to the output head, BatchNorm statistics, a parameter of 5 rows (uneven shards), one of
    one row (empty shards), a 0-dim parameter and a side module (the ignored states)."""

    DIM = 8
    VOCAB = 11

    def __init__(self, scalar: bool = True) -> None:
        super().__init__()
        d = self.DIM
        self.embed = nn.Embedding(self.VOCAB, d, padding_idx=0)
        self.blocks = nn.ModuleList([Block(d), Block(d)])
        self.bn = nn.BatchNorm1d(d)
        self.odd = nn.Linear(d, 5)
        self.cls = Cls(d)
        self.scale = Scale(scalar)
        self.side = nn.Linear(d, 3)
        self.head = nn.Linear(d, self.VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """torchtitan's whole-model initializer convention."""
        for m in self.modules():
            if m is not self and hasattr(m, "reset_parameters"):
                m.reset_parameters()  # type: ignore[operator]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.cls.token
        for block in self.blocks:
            x = block(x)
        x = self.bn(x.transpose(1, 2)).transpose(1, 2)
        extra = self.odd(x).mean() + self.side(x).mean()
        return self.head(x).mean() * self.scale.value.sum() + extra


def llama_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=16,
    )


def variant(cell: Cell) -> str:
    """Which model the cell builds: the Llama, or the net with a 0-dim parameter ("net0") where
    it is ignored, else with a one-element one ("net1")."""
    if cell.model == "llama":
        return "llama"
    return "net0" if cell.ignore == "param" else "net1"


def eager(model: str, seed: int, warmed: bool = False, reinit: bool = False) -> nn.Module:
    """The model as plain PyTorch / transformers builds it, under ``seed``; ``warmed``: after
    forwards in train mode, as a model that has trained holds them (BatchNorm statistics away
    from their defaults); ``reinit``: then initialized again by its own ``init_weights()``, as
    plain PyTorch does for a model whose initializer is that method (``InitWeights``)."""
    torch.manual_seed(seed)
    if model.startswith("net"):
        net = Net(scalar=model == "net0")
        if warmed:
            warm(net, seed)
        if reinit:
            # The tie is kept (no to_empty), so the head's reset, the last, draws the shared
            # weight: plain init_weights leaves no zero padding row.
            with torch.no_grad():
                net.init_weights()
        return net
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(llama_config())


def warm(model: nn.Module, seed: int) -> None:
    """Two forwards in train mode on seed-dependent inputs: the statistics then differ between
    models of different seeds, and ``num_batches_tracked`` counts 2."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _ in range(2):
            model(torch.randint(0, Net.VOCAB, (2, 6), generator=generator))


def on_meta(model: str) -> nn.Module:
    with torch.device("meta"):
        if model.startswith("net"):
            return Net(scalar=model == "net0")
        from transformers import LlamaForCausalLM

        return LlamaForCausalLM(llama_config())


def unit_classes(model: str) -> tuple[type[nn.Module], ...]:
    if model.startswith("net"):
        return (Block,)
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return (LlamaDecoderLayer,)


def real_modules(model: str) -> tuple[str, ...]:
    """The modules that hold real values in the "part" state (the rest is on meta)."""
    return ("model.layers.0",) if model == "llama" else ("blocks.0", "bn")


def states_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters (each once) and buffers (non-persistent ones too) by name."""
    named = [*model.named_parameters(), *model.named_buffers()]
    return {name: t.detach().clone() for name, t in named}


def built(cell: Cell, rank: int) -> nn.Module:
    """Rank ``rank``'s model before the build, in the cell's state."""
    seed = REAL_SEED + (rank if cell.state == "differ" else 0)
    kind = variant(cell)
    if cell.state == "meta" or (cell.state == "rank0" and rank != 0):
        model = on_meta(kind)
    elif cell.state == "empty":
        model = empty(kind)
    elif cell.state != "part":
        model = eager(kind, seed, warmed=True)
    else:
        model = on_meta(kind)
        real = eager(kind, seed, warmed=True)
        for name in real_modules(kind):
            parent, _, child = name.rpartition(".")
            owner = model.get_submodule(parent) if parent else model
            setattr(owner, child, real.get_submodule(name))
    for p in frozen_params(cell, model).values():
        p.requires_grad_(False)
    return model


def empty(model: str) -> nn.Module:
    """The model as ``accelerate.init_empty_weights()`` builds it: parameters on meta, buffers
    real (their constructors' values)."""
    from accelerate import init_empty_weights

    with init_empty_weights():
        if not model.startswith("net"):
            from transformers import LlamaForCausalLM

            return LlamaForCausalLM(llama_config())
        net = Net(scalar=model == "net0")
    # The context registers each assigned parameter anew, which unties the head; tied again
    # after it, as transformers' tie_weights() does for its models.
    net.head.weight = net.embed.weight
    return net


def frozen_params(cell: Cell, model: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters the cell freezes, by their names in ``model``."""
    if cell.frozen == "none":
        return {}
    block = "model.layers.0" if cell.model == "llama" else "blocks.0"
    return {f"{block}.{n}": p for n, p in model.get_submodule(block).named_parameters()}


def real_states(cell: Cell, rank: int) -> dict[str, torch.Tensor | None]:
    """Rank ``rank``'s states before the build: a value, or None where it is on meta."""
    model = built(cell, rank)
    named = [*model.named_parameters(), *model.named_buffers()]
    return {n: (None if t.is_meta else t.detach().clone()) for n, t in named}


def checkpoint(model: str) -> dict[str, torch.Tensor]:
    """What the loaders read: an eager model's persistent states under another seed, each
    tensor its own copy (tied ones too, as ``save_pretrained`` writes them)."""
    state = eager(model, CHECKPOINT_SEED, warmed=True).state_dict()
    return {k: v.detach().clone() for k, v in state.items()}


CHECKPOINT_FORMATS = ("file", "index", "dcp", "keymap")
# The prefix of the names the "keymap" checkpoint writes (its key_map takes it off).
KEYMAP_PREFIX = "net."


def checkpoint_key(cell: Cell) -> str:
    """Which written checkpoint the cell reads (``write_checkpoints``' keys)."""
    _, _, form = cell.materializer.partition(":")
    return f"{variant(cell)}:{form or 'file'}"


def write_checkpoints(folder: Path) -> dict[str, str]:
    """Every variant's checkpoint in every format, written with safetensors' and torch's own
    calls: one file, an indexed folder of two shards, a DCP folder, one file under other names."""
    import json

    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    paths = {}
    for kind in VARIANTS:
        state = checkpoint(kind)
        paths[f"{kind}:file"] = str(folder / f"{kind}.safetensors")
        save_file(state, paths[f"{kind}:file"])
        index = folder / f"{kind}-index"
        index.mkdir()
        names = sorted(state)
        half = len(names) // 2
        halves = {"a.safetensors": names[:half], "b.safetensors": names[half:]}
        for file, keys in halves.items():
            save_file({k: state[k] for k in keys}, str(index / file))
        weight_map = {k: file for file, keys in halves.items() for k in keys}
        (index / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map})
        )
        paths[f"{kind}:index"] = str(index)
        dcp.save(state, checkpoint_id=str(folder / f"{kind}-dcp"), no_dist=True)
        paths[f"{kind}:dcp"] = str(folder / f"{kind}-dcp")
        paths[f"{kind}:keymap"] = str(folder / f"{kind}-keymap.safetensors")
        save_file({KEYMAP_PREFIX + k: v for k, v in state.items()}, paths[f"{kind}:keymap"])
    return paths


def seed_free(model: str, reinit: bool = False) -> dict[str, torch.Tensor]:
    """The states whose eager values (``reinit``: after ``init_weights()``) do not depend on
    the seed, with those values."""
    a = states_of(eager(model, 1, reinit=reinit))
    b = states_of(eager(model, 2, reinit=reinit))
    return {k: v for k, v in a.items() if torch.equal(v, b[k])}


DISTRIBUTION_SEEDS = 48


@functools.cache
def eager_statistics(model: str, reinit: bool = False) -> dict[str, Statistics]:
    """Per state, what eager construction (``reinit``: then ``init_weights()``) gives under
    ``DISTRIBUTION_SEEDS`` seeds: the range of its per-tensor mean and standard deviation, of
    its values, and the elements that every seed gives the same value (with that value)."""
    samples = [
        states_of(eager(model, seed, reinit=reinit)) for seed in range(DISTRIBUTION_SEEDS)
    ]
    out = {}
    for name, first in samples[0].items():
        values = torch.stack([s[name].double() for s in samples])
        fixed = (values == values[0]).all(dim=0)
        flat = values.reshape(len(samples), -1)
        means = flat.mean(dim=1)
        stds = flat.std(dim=1) if flat.shape[1] > 1 else torch.zeros(len(samples))
        out[name] = Statistics(
            (float(means.min()), float(means.max())),
            (float(stds.min()), float(stds.max())),
            (float(values.min()), float(values.max())),
            fixed,
            first.clone(),
        )
    return out


class Statistics(NamedTuple):
    mean: tuple[float, float]
    std: tuple[float, float]
    support: tuple[float, float]
    fixed: torch.Tensor  # elements equal under every seed
    value: torch.Tensor  # one seed's value (the fixed elements' value)


def distribution_verdict(
    model: str, name: str, got: torch.Tensor, reinit: bool = False
) -> str | None:
    """None when ``got`` could be a draw of eager construction: its seed-independent elements
    equal, its per-tensor mean and standard deviation and its values inside eager's ranges
    (widened by half of each range, so honest draws pass and zeros, a constant, a scaled or
    shifted distribution fail)."""
    stats = eager_statistics(model, reinit)[name]
    if got.shape != stats.value.shape:
        return f"{name} has shape {tuple(got.shape)}, eager construction {tuple(stats.value.shape)}"
    if not torch.equal(got[stats.fixed], stats.value.to(got.dtype)[stats.fixed]):
        return f"{name}: elements that eager construction fixes (any seed) differ"
    values = got.double().reshape(-1)
    checks = [("mean", float(values.mean()), stats.mean)]
    if values.numel() > 1:
        checks.append(("standard deviation", float(values.std()), stats.std))
    checks += [("minimum", float(values.min()), stats.support)]
    checks += [("maximum", float(values.max()), stats.support)]
    for what, found, (low, high) in checks:
        slack = (high - low) / 2 + 1e-12
        if not low - slack <= found <= high + slack:
            return (
                f"{name}: {what} {found:.4g} is outside eager construction's "
                f"[{low:.4g}, {high:.4g}] over {DISTRIBUTION_SEEDS} seeds"
            )
    return None


def ignored_names(cell: Cell) -> set[str]:
    if cell.ignore == "module":
        return {"side.weight", "side.bias"}
    if cell.ignore == "param":
        return {"scale.value"}
    return set()


# -- the oracle ----------------------------------------------------------------------------------

class Drawn(NamedTuple):
    """A value an initializer draws at random, and what holds it: ``"deterministic"`` or
    ``"stream"`` (the same full value in every cell of that materializer and model, see
    :func:`judge_across`), or ``"distribution"`` (:func:`distribution_verdict`)."""

    how: str


# A state's expected full value on one rank: exact, drawn, or None where the ranks hold it apart
# and only each rank's own rows of its own value are defined (``Expected.local``).
Value = torch.Tensor | Drawn | None


class Refusal(NamedTuple):
    """An error the build must raise on every rank: its type (``ConfigurationError`` and its
    subclasses by their own names; ``RankDisagreementError`` on a rank that saw no fault of its
    own but learnt of another's through the agreement) and the part of its message that tells
    this refusal from every other."""

    types: tuple[str, ...]
    message: str


class Expected(NamedTuple):
    """What a cell must give: ``refusals`` (any one of them, on every rank), or per rank, per
    state, its full value (:data:`Value`) and whether every rank must hold the same full value
    (``agree``); ``local``: per rank, exact local shards (plain ``fully_shard``'s rows of the
    rank's own value) for states the ranks hold apart; ``dtypes``: the plain model's."""

    refusals: list[Refusal]
    values: list[dict[str, Value]]
    agree: set[str]
    local: list[dict[str, torch.Tensor]]
    dtypes: dict[str, torch.dtype]


def is_loader(materializer: str) -> bool:
    return materializer == "FromStateDict" or materializer.startswith("FromCheckpoint")

REINITIALIZE = ("DeterministicInit", "InitWeights")


def reinitialized(cell: Cell) -> bool:
    """Whether plain PyTorch's value for the cell's drawn states is the model's own
    ``init_weights()`` after construction rather than construction alone."""
    return cell.materializer == "InitWeights"
AGREED = ("RankDisagreementError",)


def drawn(cell: Cell) -> Drawn:
    """How the cell's materializer's random draws are checked."""
    if cell.materializer == "DeterministicInit":
        return Drawn("deterministic")
    if cell.materializer == "StreamInit" or (
        cell.materializer == "default" and cell.backend == "fsdp2"
    ):
        return Drawn("stream")
    return Drawn("distribution")


def expected(cell: Cell) -> Expected:
    """The cell's result, defined without the library (see the module docstring)."""
    world = cell.world
    pre = [real_states(cell, r) for r in range(world)]
    names = list(pre[0])
    dtypes = {n: t.dtype for n, t in states_of(on_meta(variant(cell))).items()}
    fixed = seed_free(variant(cell), reinitialized(cell))
    materializer = cell.materializer
    # Every reason the cell must be refused for; the build names one of them (the checks run in
    # one order, and any of these refusals, in configure and on every rank, is right).
    reasons = []
    if cell.ignore == "module" and any(p["side.weight"] is None for p in pre):
        # Ignored modules are the user's, as in plain FSDP: left as they are, so not on meta.
        reasons.append(
            Refusal(("ConfigurationError", *AGREED), "Ignored states are on the meta device")
        )
    if materializer == "KeepAsIs" and any(v is None for p in pre for v in p.values()):
        reasons.append(
            Refusal(("MaterializationError", *AGREED), r"`KeepAsIs`.*on the meta device")
        )
    if materializer == "InitWeights" and cell.backend == "fsdp1":
        reasons.append(Refusal(("ConfigurationError",), "InitWeights.*cannot shard a unit on meta"))
    if materializer == "InitWeights" and cell.synchronizer != "none":
        reasons.append(
            Refusal(
                ("ConfigurationError",), "InitWeights` initializes the whole model on local shards"
            )
        )
    if reasons:
        return Expected(reasons, [], set(), [], dtypes)
    overwrites = cell.synchronizer in ("BroadcastFromRank0", "Chain")
    ignored = ignored_names(cell)
    source = checkpoint(variant(cell)) if is_loader(materializer) else {}
    draw = drawn(cell)

    # Each rank's states after its own materialization.
    post: list[dict[str, torch.Tensor | Drawn]] = []
    for r in range(world):
        mine: dict[str, torch.Tensor | Drawn] = {}
        for name in names:
            before = pre[r][name]
            if is_loader(materializer):
                mine[name] = source.get(name, fixed.get(name, draw))
            elif before is None or (materializer in REINITIALIZE and name not in ignored):
                # A real ignored state is the user's: kept even by a reinitializing materializer.
                mine[name] = fixed.get(name, draw)
            else:
                mine[name] = before
        post.append(mine)

    # Whether each state holds one value on every rank after materialization. Random draws agree
    # across ranks: every rank starts the build from the same RNG state, and the shard-first
    # initializers are built so that replicas agree.
    differs = {n for n in names if any(_differ(post[0][n], post[r][n]) for r in range(world))}
    # A Chain broadcasts before it verifies, so only VerifyReplicas alone can find a difference.
    if cell.synchronizer == "VerifyReplicas" and differs - ignored:
        found = Refusal(("StateMismatchError",), "`VerifyReplicas` found different values")
        return Expected([found], [], set(), [], dtypes)
    if overwrites:
        values: list[dict[str, Value]] = [
            {n: (post[r][n] if n in ignored else post[0][n]) for n in names} for r in range(world)
        ]
        agree = set(names) - ignored
        return Expected([], values, agree, [{} for _ in range(world)], dtypes)
    agree = set(names) - differs
    values = [dict(p) for p in post]
    local: list[dict[str, torch.Tensor]] = [{} for _ in range(world)]
    for n in differs:
        for r in range(world):
            # Full values of a state the ranks hold apart are only defined rank by rank: a
            # parameter's local shard (FSDP2), a buffer or ignored state's own value.
            value = post[r][n]
            values[r][n] = value if (n in ignored or _is_buffer(cell, n)) else None
            if cell.backend == "fsdp2" and isinstance(value, torch.Tensor) and n not in ignored:
                if not _is_buffer(cell, n):
                    local[r][n] = value  # compared through the rank's placements
    return Expected([], values, agree, local, dtypes)


def _differ(a: torch.Tensor | Drawn, b: torch.Tensor | Drawn) -> bool:
    if isinstance(a, Drawn) and isinstance(b, Drawn):
        return False  # both drawn, from the same RNG state or seed
    if isinstance(a, Drawn) or isinstance(b, Drawn):
        return True
    return not torch.equal(a, b)


def _is_buffer(cell: Cell, name: str) -> bool:
    return name in dict(on_meta(variant(cell)).named_buffers())


# -- one cell on one rank ------------------------------------------------------------------------


class Layouts:
    """The process groups and meshes of one spawn, created once, in the same order on every
    rank (creating groups is collective)."""

    def __init__(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        world = dist.get_world_size()
        rank = dist.get_rank()
        self.mesh1d = init_device_mesh("cpu", (world,))
        self.mesh2d = None
        self.pair: tuple[Any, Any] | None = None
        if world == 4:
            self.mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
            shard = [dist.new_group([0, 1]), dist.new_group([2, 3])]
            replicate = [dist.new_group([0, 2]), dist.new_group([1, 3])]
            self.pair = (shard[rank // 2], replicate[rank % 2])


def builder_for(cell: Cell, model: nn.Module, layouts: Layouts, path: Path) -> Any:
    import fsdp_builder as fb

    rank = dist.get_rank()
    b = fb.FSDPBuilder() if cell.backend == "fsdp1" else fb.FullyShardBuilder()
    b = b.device(fb.CPUDevice()).wrap(*unit_classes(variant(cell))).timeout(60)
    if cell.groups == "mesh1d":
        b = b.groups(fb.MeshGroups(layouts.mesh1d))
    elif cell.groups == "mesh2d":
        assert layouts.mesh2d is not None
        b = b.sharding("hybrid").groups(fb.MeshGroups(layouts.mesh2d))
    elif cell.groups == "hybrid":
        assert layouts.pair is not None
        b = b.sharding("hybrid").groups(fb.HybridGroups(*layouts.pair))
    elif cell.groups == "auto":
        b = b.sharding("hybrid").groups(fb.AutoHybridGroups(devices_per_node=2))
    m = cell.materializer
    if m == "FromStateDict":
        b = b.materialize(fb.FromStateDict(checkpoint(variant(cell)) if rank == 0 else None))
    elif m == "FromCheckpoint:keymap":
        prefix = "^" + re.escape(KEYMAP_PREFIX)
        b = b.materialize(fb.FromCheckpoint(str(path), key_map=[(prefix, "")]))
    elif m.startswith("FromCheckpoint"):
        b = b.materialize(fb.FromCheckpoint(str(path)))
    elif m == "InitFn":
        b = b.materialize(fb.InitFn(_init_fn))
    elif m == "DeterministicInit":
        b = b.materialize(fb.DeterministicInit(seed=5))
    elif m == "StreamInit":  # shard by shard; "default" fills these small units whole
        b = b.materialize(fb.StreamInit(whole_below=0))
    elif m == "ShardFirstReset":
        b = b.materialize(fb.ShardFirstReset(seed=5))
    elif m == "InitWeights":
        b = b.materialize(fb.InitWeights(seed=5))
    elif m != "default":
        b = b.materialize(getattr(fb, m)())
    if cell.synchronizer == "Chain":
        b = b.synchronize(fb.BroadcastFromRank0(), fb.VerifyReplicas())
    elif cell.synchronizer != "none":
        b = b.synchronize(getattr(fb, cell.synchronizer)())
    if cell.ignore == "module":
        b = b.ignore(modules=[model.get_submodule("side")])
    elif cell.ignore == "param":
        b = b.ignore(states=[model.get_parameter("scale.value")])
    return b


def _init_fn(module: nn.Module) -> None:
    """FSDP1's ``param_init_fn`` pattern."""
    if any(t.is_meta for t in [*module.parameters(False), *module.buffers(False)]):
        module.to_empty(device="cpu", recurse=False)
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()


def _clean(name: str) -> str:
    for prefix in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module."):
        name = name.replace(prefix, "")
    return name


def gathered(model: nn.Module, backend: str) -> dict[str, torch.Tensor]:
    """The built model's full states, gathered with torch's own calls."""
    if backend == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(model, writeback=False):
            return {_clean(n): t.detach().clone() for n, t in _named(model)}
    out = {}
    for name, t in _named(model):
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        out[name] = full.detach().clone()
    return out


def frozen_names(model: nn.Module, backend: str) -> list[str]:
    """The parameters with ``requires_grad=False``, by their plain names (FSDP1's: inside
    ``summon_full_params``, where its flat parameters show as the module's own)."""
    import contextlib

    scope: Any = contextlib.nullcontext()
    if backend == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        scope = FSDP.summon_full_params(model, writeback=False)
    with scope:
        return sorted(_clean(n) for n, p in model.named_parameters() if not p.requires_grad)


def local_shards(
    model: nn.Module, wanted: dict[str, torch.Tensor]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """For each FSDP2 parameter in ``wanted``: its local shard, and the rows plain
    ``distribute_tensor`` (no source rank: each rank's own value) gives this rank."""
    from torch.distributed.tensor import distribute_tensor

    found: dict[str, Any] = dict(model.named_parameters())
    result = {}
    for name, value in wanted.items():
        t = found[name]
        plain = distribute_tensor(value, t.device_mesh, t.placements, src_data_rank=None)
        result[name] = (t.to_local().detach().clone(), plain.to_local())
    return result


# torch.distributed's collectives, as the library calls them (through the module).
COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "reduce",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
)
_AGREEMENT = os.path.join("runtime", "agreement.py")


class Collectives:
    """Counts the collectives issued through ``torch.distributed`` while it is entered, each
    with whether the rank agreement issued it (the one kind a refusal may follow)."""

    def __init__(self) -> None:
        self.issued: list[tuple[str, bool]] = []
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> Collectives:
        import sys

        for name in COLLECTIVES:
            original = getattr(dist, name, None)
            if original is None:
                continue
            self._saved[name] = original

            def counted(*args: Any, _name: str = name, _fn: Any = original, **kw: Any) -> Any:
                # The agreement's own calls, not the steps it runs (those are its callees too).
                by_agreement = sys._getframe(1).f_code.co_filename.endswith(_AGREEMENT)
                self.issued.append((_name, by_agreement))
                return _fn(*args, **kw)

            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._saved.items():
            setattr(dist, name, original)

    def outside_agreement(self) -> list[str]:
        return [name for name, by_agreement in self.issued if not by_agreement]


def _named(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model.named_parameters()
    yield from model.named_buffers()


def _untouched(model: nn.Module, before: list[tuple[str, int, bool]]) -> bool:
    now = [(n, id(t), t.is_meta) for n, t in _named(model)]
    return now == before and not any(
        type(m).__name__.startswith(("FullyShardedDataParallel", "FSDP")) for m in model.modules()
    )


LR = 0.01


def train_ids(cell: Cell) -> torch.Tensor:
    vocab = Net.VOCAB if cell.model == "net" else 32
    return torch.arange(12).remainder(vocab).view(2, 6)


def loss_of(model: nn.Module, cell: Cell) -> torch.Tensor:
    out = model(train_ids(cell))
    return out if cell.model == "net" else out.logits.float().mean()


def train_step(model: nn.Module, cell: Cell) -> float:
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loss = loss_of(model, cell)
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def run_cell(cell: Cell, layouts: Layouts, path: Path, wanted_local: dict[str, Any]) -> dict:
    """One cell on this rank: what the test needs to judge it."""
    rank = dist.get_rank()
    model = built(cell, rank)
    before = [(n, id(t), t.is_meta) for n, t in _named(model)]
    b = builder_for(cell, model, layouts, path)
    torch.manual_seed(BUILD_SEED)
    with Collectives() as collectives:
        try:
            result = b.build(model)
        except Exception as exc:
            return {
                "error": f"{type(exc).__name__}: {exc}",
                "untouched": _untouched(model, before),
                "collectives": collectives.outside_agreement(),
                "agreements": len(collectives.issued) - len(collectives.outside_agreement()),
            }
    full = gathered(result, cell.backend)
    local = local_shards(result, wanted_local) if wanted_local else {}
    loss = train_step(result, cell)
    post = gathered(result, cell.backend)
    return {
        "error": None,
        "full": full,
        "local": local,
        "loss": loss,
        "post": post,
        "frozen": frozen_names(result, cell.backend),
        "collectives": collectives.outside_agreement(),
        "agreements": len(collectives.issued) - len(collectives.outside_agreement()),
    }


# -- judging -------------------------------------------------------------------------------------


def judge(cell: Cell, want: Expected, ranks: list[dict[str, Any]]) -> str | None:
    """None when the ranks' results are the oracle's; otherwise what differs. Draws that must
    be equal across cells are judged by :func:`judge_across`."""
    errors = [r["error"] for r in ranks]
    if want.refusals:
        return _judge_refusal(want.refusals, ranks)
    for rank, error in enumerate(errors):
        if error is not None:
            return f"rank {rank} raised: {error}"
    for rank, result in enumerate(ranks):
        full = result["full"]
        if set(full) != set(want.values[rank]):
            return (
                f"rank {rank}: states {sorted(set(full) ^ set(want.values[rank]))} differ in "
                "name from the plain model's (a tie broken or a state renamed)"
            )
        frozen = sorted(frozen_params(cell, on_meta(variant(cell))))
        if result["frozen"] != frozen:
            return f"rank {rank}: frozen parameters {result['frozen']}, the plain model's {frozen}"
        for name, value in want.values[rank].items():
            got = full[name]
            if got.dtype != want.dtypes[name]:
                return f"rank {rank}: {name} is {got.dtype}, the plain model's {want.dtypes[name]}"
            if got.is_meta or not torch.isfinite(got.float()).all():
                return f"rank {rank}: {name} is not real and finite"
            if isinstance(value, torch.Tensor) and not torch.equal(got, value):
                return f"rank {rank}: {name} differs from the oracle"
            if isinstance(value, Drawn):
                wrong = distribution_verdict(variant(cell), name, got, reinitialized(cell))
                if wrong is not None:
                    return f"rank {rank}: {wrong}"
            if name in want.agree and not torch.equal(got, ranks[0]["full"][name]):
                return f"rank {rank}: {name} differs from rank 0's, where every rank must agree"
        for name, (shard, plain) in result["local"].items():
            if not torch.equal(shard, plain):
                return f"rank {rank}: the local shard of {name} is not this rank's own rows"
    return _judge_step(cell, ranks)


def _judge_refusal(refusals: list[Refusal], ranks: list[dict[str, Any]]) -> str | None:
    import re

    for rank, result in enumerate(ranks):
        error = result["error"]
        kind, _, message = (error or "").partition(": ")
        if error is None or not any(
            kind in r.types and re.search(r.message, message) for r in refusals
        ):
            wanted = " or ".join(f"{'/'.join(r.types)} matching {r.message!r}" for r in refusals)
            return f"rank {rank}: expected {wanted}, got {error!r}"
        if "VerifyReplicas" in message:
            continue  # it refuses what it compared, unit by unit: after collectives, by design
        if not result.get("untouched", False):
            return f"rank {rank}: refused after changing the model: {error}"
        if result.get("collectives"):
            return (
                f"rank {rank}: refused after issuing collectives {result['collectives']} "
                "outside the agreement"
            )
    return None


def reference_step(cell: Cell, ranks: list[dict[str, Any]]) -> list[tuple[float, dict]]:
    """Per rank, the training step in plain PyTorch from the states the rank gathered before its
    step: its loss and states after it. Gradients are averaged over all ranks (every rank is a
    data-parallel replica of one batch), an ignored parameter's kept local."""
    ignored = ignored_names(cell)
    models, losses = [], []
    for result in ranks:
        model = eager(variant(cell), 0)  # to_empty would break the tie
        for param in frozen_params(cell, model).values():
            param.requires_grad_(False)
        with torch.no_grad():
            for name, t in _named(model):
                t.copy_(result["full"][name])
        loss = loss_of(model, cell)
        loss.backward()
        models.append(model)
        losses.append(float(loss.detach()))
    grads = [{n: p.grad for n, p in m.named_parameters()} for m in models]
    out = []
    for rank, model in enumerate(models):
        with torch.no_grad():
            for name, p in model.named_parameters():
                step: torch.Tensor | None = grads[rank][name]
                if name not in ignored:
                    found = [g for mine in grads if (g := mine[name]) is not None]
                    step = torch.stack(found).mean(0) if found else None
                if step is not None:
                    p.add_(step, alpha=-LR)
        out.append((losses[rank], states_of(model)))
    return out


def _judge_step(cell: Cell, ranks: list[dict[str, Any]]) -> str | None:
    """The training step against the same step in plain PyTorch (reductions in another order:
    equal within float32 rounding)."""
    for rank, (loss, states) in enumerate(reference_step(cell, ranks)):
        got = ranks[rank]
        if not math.isclose(got["loss"], loss, rel_tol=1e-5, abs_tol=1e-6):
            return f"rank {rank}: the step's loss {got['loss']} is not plain PyTorch's {loss}"
        for name, want in states.items():
            after = got["post"].get(name)
            if after is None or after.dtype != want.dtype or after.shape != want.shape:
                return f"rank {rank}: after the training step, {name} is not plain PyTorch's"
            if not torch.allclose(after, want, rtol=1e-5, atol=1e-6):
                worst = float((after.double() - want.double()).abs().max())
                return (
                    f"rank {rank}: after the training step, {name} differs from plain "
                    f"PyTorch's step by up to {worst:.3g}"
                )
    return None


def anchors() -> list[Cell]:
    """Per model and materializer whose draws must be the same in every cell: a world-size-1
    FSDP1 build and an FSDP2 one from meta, so that every such cell has others to equal."""
    out = []
    for backend in BACKENDS:
        for materializer in ("DeterministicInit", "StreamInit"):
            for model, ignore in (("net", "none"), ("net", "param"), ("llama", "none")):
                out.append(Cell(backend, materializer, "none", "meta", "default", 1, model, ignore))
    return out


def judge_across(judged: dict[Cell, tuple[Expected, list[dict[str, Any]] | None]]) -> dict[
    Cell, str
]:
    """Draws promised equal everywhere (``Drawn("deterministic")``, ``Drawn("stream")``) against
    each other: per model and state, every cell's full value equals the first cell's (by key).
    Returns the cells found wrong, with why; cells that raised are left to :func:`judge`."""
    groups: dict[tuple[str, str, str], list[tuple[Cell, torch.Tensor]]] = {}
    for cell in sorted(judged, key=lambda c: c.key):
        want, ranks = judged[cell]
        if want.refusals or ranks is None or any(r["error"] is not None for r in ranks):
            continue
        for rank, values in enumerate(want.values):
            for name, value in values.items():
                if isinstance(value, Drawn) and value.how != "distribution":
                    key = (value.how, variant(cell), name)
                    groups.setdefault(key, []).append((cell, ranks[rank]["full"][name]))
    wrong: dict[Cell, str] = {}
    for (how, _, name), members in groups.items():
        first_cell, first = members[0]
        for cell, value in members[1:]:
            if cell not in wrong and not torch.equal(value, first):
                wrong[cell] = (
                    f"{name} ({how} draws) differs from cell {first_cell.key}'s: the same "
                    "full value is promised at any world size, backend and layout"
                )
    return wrong


def checks(judged: dict[Cell, Expected]) -> dict[str, int]:
    """How each cell's seed-dependent states are held: cells with draws checked by equality
    across cells, by distribution, and cells with no drawn state (every value exact)."""
    counts = {"across cells": 0, "distribution": 0, "exact only": 0, "refused": 0}
    for want in judged.values():
        if want.refusals:
            counts["refused"] += 1
            continue
        kinds = {v.how for vs in want.values for v in vs.values() if isinstance(v, Drawn)}
        if kinds & {"deterministic", "stream"}:
            counts["across cells"] += 1
        if "distribution" in kinds:
            counts["distribution"] += 1
        if not kinds:
            counts["exact only"] += 1
    return counts


def rank_cells(cells: list[tuple[Cell, list[dict[str, torch.Tensor]]]], paths: dict) -> Any:
    """Every cell of one world size, on this rank (the spawn's function)."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from isolated import run_each

    layouts = Layouts()
    rank = dist.get_rank()

    trace = os.environ.get("CONFORMANCE_TRACE") == "1" and rank == 0

    def one(cell: Cell, local: list[dict[str, torch.Tensor]]) -> Callable[[], dict]:
        def run() -> dict:
            if trace:  # names the cell a crash of the spawn happened in
                print(f"cell {cell.key}", flush=True)
            path = paths[checkpoint_key(cell)]
            return run_cell(cell, layouts, path, local[rank] if local else {})

        return run

    return run_each((cell.key, one(cell, local)) for cell, local in cells)


# -- the full run --------------------------------------------------------------------------------


def run_matrix(cells: list[Cell], folder: Path, chunk: int = 400) -> dict[Cell, str | None]:
    """Every cell's verdict (None: equal to its oracle or refused as it says), world size by
    world size, ``chunk`` cells per spawn; then the draws promised equal across cells."""
    from fsdp_builder.tools.launch import run_ranks

    paths = write_checkpoints(folder)
    verdicts: dict[Cell, str | None] = {}
    kept: dict[Cell, tuple[Expected, list[dict[str, Any]] | None]] = {}
    for world in WORLDS:
        mine = [c for c in cells if c.world == world]
        for start in range(0, len(mine), chunk):
            part = mine[start : start + chunk]
            wants = {c: expected(c) for c in part}
            ranks = run_ranks(
                rank_cells,
                world,
                [(c, wants[c].local) for c in part],
                paths,
                timeout=60 + 30 * len(part),
            )
            print(f"world size {world}: {start + len(part)}/{len(mine)} cells", flush=True)
            for c in part:
                outcomes = [r[c.key] for r in ranks]
                failed = [o.error for o in outcomes if o.error is not None]
                results = [o.value for o in outcomes]
                verdicts[c] = (
                    f"did not complete: {failed[0]}" if failed else judge(c, wants[c], results)
                )
                kept[c] = (wants[c], None if failed else [_drawn_only(r) for r in results])
    for cell, why in judge_across(kept).items():
        verdicts[cell] = verdicts[cell] or why
    return verdicts


def _drawn_only(result: dict[str, Any]) -> dict[str, Any]:
    """What :func:`judge_across` reads of a rank's result (the full product keeps thousands)."""
    return {"error": result["error"], "full": result.get("full")}


def summary(cells: list[Cell], verdicts: dict[Cell, str | None], seconds: float) -> str:
    """The result table: cells, equal to the oracle, refused as the oracle says (by reason),
    wrong, and what did not complete (a hang ends in the build's bound or the spawn's); then
    how the cells' random draws were checked."""
    refused: dict[str, int] = {}
    equal = 0
    wants = {c: expected(c) for c in cells}
    for c in cells:
        want = wants[c]
        if verdicts[c] is None:
            if not want.refusals:
                equal += 1
            else:
                reason = _readable(want.refusals)
                refused[reason] = refused.get(reason, 0) + 1
    wrong = [c for c in cells if "did not complete" not in (verdicts[c] or "did not complete")]
    hung = [c for c in cells if "did not complete" in (verdicts[c] or "")]
    counts = checks(wants)
    lines = [
        "| cells | equal to the oracle | refused as the oracle says | wrong | did not complete |",
        "|---|---|---|---|---|",
        f"| {len(cells)} | {equal} | {sum(refused.values())} | {len(wrong)} | {len(hung)} |",
        "",
        "How the built cells' seed-dependent states are checked (a cell can count twice: "
        "draws of its own and exact values): equal across cells (`DeterministicInit`, "
        f"`StreamInit`) {counts['across cells']}, by distribution against eager draws "
        f"{counts['distribution']}, no drawn state (every value exact) "
        f"{counts['exact only']}. Every built cell's training step is compared with plain "
        "PyTorch's.",
        "",
        "Refusals, by the error the oracle expects (raised on every rank, with no collective "
        "but the agreement's before it and the model untouched, except VerifyReplicas' own "
        "comparison):",
        "",
        "| expected error | cells |",
        "|---|---|",
        *(f"| {reason} | {n} |" for reason, n in sorted(refused.items())),
        "",
        f"Wall time: {seconds:.0f} s on this machine.",
    ]
    for c in wrong + hung:
        lines.append(f"- `{c.key}`: {verdicts[c]}")
    return "\n".join(lines) + "\n"


def header(args: Any) -> str:
    """What a result table is: the command, the axes and where the oracle is defined."""
    import subprocess

    chosen = " ".join(
        f"--{k} {v}" for k, v in vars(args).items() if v is not None and k not in ("out", "keys")
    )
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    axes = "\n".join(
        f"| {name} | {', '.join(map(str, values))} |" for name, values in AXES.items()
    )
    return (
        "# Conformance matrix\n\n"
        f"`python tests/conformance.py {chosen}` at commit `{commit}`, torch "
        f"{torch.__version__}, gloo on CPU. Every cell builds on every rank, gathers the full "
        "state, trains one step, and is judged against the oracle that `tests/conformance.py` "
        "defines in plain PyTorch (its module docstring: what each materializer and "
        "synchronizer must give, and what has no exact value). A cell either equals its "
        "oracle or is refused the way the oracle says, on every rank. The default test command "
        "runs a pairwise cover of these axes (`tests/test_conformance.py`); the full product "
        "runs with `pytest -m conformance_full tests/test_conformance.py`.\n\n"
        "| axis | values |\n|---|---|\n"
        f"{axes}\n\n"
        "Valid cells: hybrid layouts (mesh2d, hybrid, auto) at 4 ranks; the Llama is wrapped "
        "by its decoder layers, has no ignored states, and takes no InitFn/InitWeights (its "
        "modules are initialized by `_init_weights`, not `reset_parameters`).\n\n"
    )


def _readable(refusals: list[Refusal]) -> str:
    """Each alternative as its types and message pattern, in backticks."""
    return " or ".join(f"{'/'.join(r.types)} `{r.message}`" for r in refusals)


def main(argv: list[str] | None = None) -> None:
    import argparse
    import sys
    import tempfile
    import time

    parser = argparse.ArgumentParser(description="Run the conformance matrix.")
    parser.add_argument("--cells", choices=("pairwise", "full"), default="pairwise")
    parser.add_argument("--model", choices=MODELS, default=None, help="only this model")
    parser.add_argument("--ignore", choices=IGNORES, default=None, help="only this ignore")
    parser.add_argument("--world", type=int, choices=WORLDS, default=None, help="only this size")
    parser.add_argument("--keys", type=Path, default=None, help="only the cells named here")
    parser.add_argument("--out", type=Path, default=None, help="write the table here")
    args = parser.parse_args(argv)
    cells = pairwise() if args.cells == "pairwise" else full_product()
    if args.model is not None:
        cells = [c for c in cells if c.model == args.model]
    if args.ignore is not None:
        cells = [c for c in cells if c.ignore == args.ignore]
    if args.world is not None:
        cells = [c for c in cells if c.world == args.world]
    if args.keys is not None:
        keys = set(args.keys.read_text().split())
        cells = [c for c in cells if c.key in keys]
    # Draws promised equal across cells need others to equal: the world-size-1 anchors.
    cells += [c for c in anchors() if c not in cells]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        verdicts = run_matrix(cells, Path(folder))
    table = header(args) + summary(cells, verdicts, time.perf_counter() - started)
    if args.out is not None:
        args.out.write_text(table)
    sys.stdout.write(table)


if __name__ == "__main__":
    main()
