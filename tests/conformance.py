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

Values drawn at random by an initializer have no exact oracle: such a state must be real,
finite, and hold the same value on every rank wherever the contract above says the ranks agree.
A state whose eager value does not depend on the seed (BatchNorm statistics, LayerNorm weights,
RoPE tables) is held to that value exactly.
"""

from __future__ import annotations

import itertools
import os
import random
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
    "FromCheckpoint",
)
SYNCHRONIZERS = ("none", "BroadcastFromRank0", "VerifyReplicas", "Chain")
STATES = ("meta", "equal", "differ", "rank0", "part")
GROUPS = ("default", "mesh1d", "mesh2d", "hybrid", "auto")
WORLDS = (1, 2, 4)
MODELS = ("net", "llama")
# The models built: the Llama, the net with a 0-dim parameter and with a one-element one.
VARIANTS = ("net0", "net1", "llama")
IGNORES = ("none", "module", "param")

AXES: dict[str, tuple[Any, ...]] = {
    "backend": BACKENDS,
    "materializer": MATERIALIZERS,
    "synchronizer": SYNCHRONIZERS,
    "state": STATES,
    "groups": GROUPS,
    "world": WORLDS,
    "model": MODELS,
    "ignore": IGNORES,
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


def eager(model: str, seed: int) -> nn.Module:
    """The model as plain PyTorch / transformers builds it, under ``seed``."""
    torch.manual_seed(seed)
    if model.startswith("net"):
        return Net(scalar=model == "net0")
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(llama_config())


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
        return on_meta(kind)
    if cell.state != "part":
        return eager(kind, seed)
    model = on_meta(kind)
    real = eager(kind, seed)
    for name in real_modules(kind):
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, child, real.get_submodule(name))
    return model


def real_states(cell: Cell, rank: int) -> dict[str, torch.Tensor | None]:
    """Rank ``rank``'s states before the build: a value, or None where it is on meta."""
    model = built(cell, rank)
    named = [*model.named_parameters(), *model.named_buffers()]
    return {n: (None if t.is_meta else t.detach().clone()) for n, t in named}


def checkpoint(model: str) -> dict[str, torch.Tensor]:
    """What the loaders read: an eager model's persistent states under another seed, each
    tensor its own copy (tied ones too, as ``save_pretrained`` writes them)."""
    return {k: v.detach().clone() for k, v in eager(model, CHECKPOINT_SEED).state_dict().items()}


def seed_free(model: str) -> dict[str, torch.Tensor]:
    """The states whose eager values do not depend on the seed, with those values."""
    a, b = states_of(eager(model, 1)), states_of(eager(model, 2))
    return {k: v for k, v in a.items() if torch.equal(v, b[k])}


def ignored_names(cell: Cell) -> set[str]:
    if cell.ignore == "module":
        return {"side.weight", "side.bias"}
    if cell.ignore == "param":
        return {"scale.value"}
    return set()


# -- the oracle ----------------------------------------------------------------------------------

Drawn = None  # a value an initializer draws at random: no exact oracle


class Expected(NamedTuple):
    """What a cell must give: ``refusal`` (a regex the error must match on every rank), or per
    rank, per state, the exact value (``Drawn`` where it is drawn at random) and whether every
    rank must hold the same full value (``agree``); ``local``: per rank, exact local shards
    (plain ``fully_shard``'s rows of the rank's own value) for states the ranks hold apart."""

    refusal: str | None
    values: list[dict[str, torch.Tensor | None]]
    agree: set[str]
    local: list[dict[str, torch.Tensor]]


LOADERS = ("FromStateDict", "FromCheckpoint")
REINITIALIZE = ("DeterministicInit", "InitWeights")


def expected(cell: Cell) -> Expected:
    """The cell's result, defined without the library (see the module docstring)."""
    world = cell.world
    pre = [real_states(cell, r) for r in range(world)]
    names = list(pre[0])
    fixed = seed_free(variant(cell))
    materializer = cell.materializer
    # Every reason the cell must be refused for; the build names one of them (the checks run in
    # one order, and any of these refusals, in configure and on every rank, is right).
    reasons = []
    if cell.ignore == "module" and any(p["side.weight"] is None for p in pre):
        # Ignored modules are the user's, as in plain FSDP: left as they are, so not on meta.
        reasons.append("Ignored states are on the meta device")
    if materializer == "KeepAsIs" and any(v is None for p in pre for v in p.values()):
        reasons.append("on the meta device")
    if materializer == "InitWeights" and cell.backend == "fsdp1":
        reasons.append("InitWeights.*cannot shard a unit on meta")
    if materializer == "InitWeights" and cell.synchronizer != "none":
        reasons.append("InitWeights` initializes the whole model on local shards")
    if reasons:
        return Expected("|".join(f"(?:{r})" for r in reasons), [], set(), [])
    overwrites = cell.synchronizer in ("BroadcastFromRank0", "Chain")
    ignored = ignored_names(cell)
    source = checkpoint(variant(cell)) if materializer in LOADERS else {}

    # Each rank's states after its own materialization; Drawn marks random draws.
    post: list[dict[str, torch.Tensor | None]] = []
    for r in range(world):
        mine: dict[str, torch.Tensor | None] = {}
        for name in names:
            if materializer in LOADERS:
                mine[name] = source.get(name, fixed.get(name))
            elif pre[r][name] is None or (materializer in REINITIALIZE and name not in ignored):
                # A real ignored state is the user's: kept even by a reinitializing materializer.
                mine[name] = fixed.get(name)
            else:
                mine[name] = pre[r][name]
        post.append(mine)

    # Whether each state holds one value on every rank after materialization. Random draws agree
    # across ranks: every rank starts the build from the same RNG state, and the shard-first
    # initializers are built so that replicas agree.
    differs = {n for n in names if any(_differ(post[0][n], post[r][n]) for r in range(world))}
    # A Chain broadcasts before it verifies, so only VerifyReplicas alone can find a difference.
    if cell.synchronizer == "VerifyReplicas" and differs - ignored:
        return Expected("VerifyReplicas` found different values across ranks", [], set(), [])
    if overwrites:
        values = [
            {n: (post[r][n] if n in ignored else post[0][n]) for n in names} for r in range(world)
        ]
        agree = set(names) - ignored
        return Expected(None, values, agree, [{} for _ in range(world)])
    agree = set(names) - differs
    values = [dict(p) for p in post]
    local: list[dict[str, torch.Tensor]] = [{} for _ in range(world)]
    for n in differs:
        for r in range(world):
            # Full values of a state the ranks hold apart are only defined rank by rank: a
            # parameter's local shard (FSDP2), a buffer or ignored state's own value.
            values[r][n] = post[r][n] if (n in ignored or _is_buffer(cell, n)) else None
            value = post[r][n]
            if cell.backend == "fsdp2" and value is not None and n not in ignored:
                if not _is_buffer(cell, n):
                    local[r][n] = value  # compared through the rank's placements
    return Expected(None, values, agree, local)


def _differ(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None and b is None:
        return False  # both drawn, from the same RNG state
    if a is None or b is None:
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
    elif m == "FromCheckpoint":
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


def local_shards(model: nn.Module, wanted: dict[str, torch.Tensor]) -> dict[str, bool]:
    """For each FSDP2 parameter in ``wanted``: whether its local shard equals the rows plain
    ``distribute_tensor`` (no source rank: each rank's own value) gives this rank."""
    from torch.distributed.tensor import distribute_tensor

    found: dict[str, Any] = dict(model.named_parameters())
    result = {}
    for name, value in wanted.items():
        t = found[name]
        plain = distribute_tensor(value, t.device_mesh, t.placements, src_data_rank=None)
        result[name] = torch.equal(plain.to_local(), t.to_local())
    return result


def _named(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model.named_parameters()
    yield from model.named_buffers()


def _untouched(model: nn.Module, before: list[tuple[str, int, bool]]) -> bool:
    now = [(n, id(t), t.is_meta) for n, t in _named(model)]
    return now == before and not any(
        type(m).__name__.startswith(("FullyShardedDataParallel", "FSDP")) for m in model.modules()
    )


def train_step(model: nn.Module, cell: Cell) -> float:
    vocab = Net.VOCAB if cell.model == "net" else 32
    ids = torch.arange(12).remainder(vocab).view(2, 6)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    out = model(ids)
    loss = out if cell.model == "net" else out.logits.float().mean()
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
    try:
        result = b.build(model)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "untouched": _untouched(model, before)}
    full = gathered(result, cell.backend)
    local = local_shards(result, wanted_local) if wanted_local else {}
    loss = train_step(result, cell)
    return {"error": None, "full": full, "local": local, "loss": loss}


# -- judging -------------------------------------------------------------------------------------


def judge(cell: Cell, want: Expected, ranks: list[dict[str, Any]]) -> str | None:
    """None when the ranks' results are the oracle's; otherwise what differs."""
    errors = [r["error"] for r in ranks]
    if want.refusal is not None:
        import re

        for rank, (error, result) in enumerate(zip(errors, ranks, strict=True)):
            if error is None or not re.search(want.refusal, error):
                return f"rank {rank}: expected a refusal matching {want.refusal!r}, got {error!r}"
            if "untouched" in result and not result["untouched"] and "VerifyReplicas" not in error:
                return f"rank {rank}: refused after changing the model: {error}"
        return None
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
        for name, value in want.values[rank].items():
            got = full[name]
            if got.is_meta or not torch.isfinite(got.float()).all():
                return f"rank {rank}: {name} is not real and finite"
            if value is not None and not torch.equal(got, value.to(got.dtype)):
                return f"rank {rank}: {name} differs from the oracle"
            if name in want.agree and not torch.equal(got, ranks[0]["full"][name]):
                return f"rank {rank}: {name} differs from rank 0's, where every rank must agree"
        bad = [n for n, same in result["local"].items() if not same]
        if bad:
            return f"rank {rank}: local shards of {bad} are not this rank's own rows"
        if not torch.isfinite(torch.tensor(result["loss"])):
            return f"rank {rank}: the training step's loss is not finite"
    return None


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
            return run_cell(cell, layouts, paths[variant(cell)], local[rank] if local else {})

        return run

    return run_each((cell.key, one(cell, local)) for cell, local in cells)


# -- the full run --------------------------------------------------------------------------------


def run_matrix(cells: list[Cell], folder: Path, chunk: int = 400) -> dict[Cell, str | None]:
    """Every cell's verdict (None: equal to its oracle or refused as it says), world size by
    world size, ``chunk`` cells per spawn."""
    from safetensors.torch import save_file

    from fsdp_builder.tools.launch import run_ranks

    paths = {}
    for kind in VARIANTS:
        paths[kind] = str(folder / f"{kind}.safetensors")
        save_file(checkpoint(kind), paths[kind])
    verdicts: dict[Cell, str | None] = {}
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
                verdicts[c] = (
                    f"did not complete: {failed[0]}"
                    if failed
                    else judge(c, wants[c], [o.value for o in outcomes])
                )
    return verdicts


def summary(cells: list[Cell], verdicts: dict[Cell, str | None], seconds: float) -> str:
    """The result table: cells, equal to the oracle, refused as the oracle says (by reason),
    wrong, and what did not complete (a hang ends in the build's bound or the spawn's)."""
    refused: dict[str, int] = {}
    equal = 0
    for c in cells:
        want = expected(c)
        if verdicts[c] is None:
            if want.refusal is None:
                equal += 1
            else:
                refused[want.refusal] = refused.get(want.refusal, 0) + 1
    wrong = [c for c in cells if "did not complete" not in (verdicts[c] or "did not complete")]
    hung = [c for c in cells if "did not complete" in (verdicts[c] or "")]
    lines = [
        "| cells | equal to the oracle | refused as the oracle says | wrong | did not complete |",
        "|---|---|---|---|---|",
        f"| {len(cells)} | {equal} | {sum(refused.values())} | {len(wrong)} | {len(hung)} |",
        "",
        "Refusals, by the error the oracle expects (raised on every rank, before any collective "
        "except VerifyReplicas' own comparison, model untouched):",
        "",
        "| expected error (regex) | cells |",
        "|---|---|",
        *(f"| {_readable(reason)} | {n} |" for reason, n in sorted(refused.items())),
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


def _readable(refusal: str) -> str:
    """A refusal's alternatives, each in backticks."""
    parts = refusal.removeprefix("(?:").removesuffix(")").split(")|(?:")
    return " or ".join(f"`{p}`" for p in parts)


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
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        verdicts = run_matrix(cells, Path(folder))
    table = header(args) + summary(cells, verdicts, time.perf_counter() - started)
    if args.out is not None:
        args.out.write_text(table)
    sys.stdout.write(table)


if __name__ == "__main__":
    main()
