"""Small models and training loops that several test modules use.

Spawned ranks import this module by name, as they import the test module that started them
(``tests`` is on the path of every rank).
"""

from __future__ import annotations

import importlib
import math
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing,
)

from fsdp_builder.tools.demo import DemoConfig, DemoTransformer

RECIPES = Path(__file__).resolve().parents[1] / "docs" / "recipes"


def recipe_module(name: str) -> Any:
    """A module of docs/recipes/ imported by name; the folder goes on sys.path, as when a recipe
    runs as a script (spawned ranks inherit that path)."""
    if str(RECIPES) not in sys.path:
        sys.path.insert(0, str(RECIPES))
    return importlib.import_module(name)


# -- the docs' torchtitan-style Llama ------------------------------------------------------------

llama: Any = recipe_module("llama_model")


def meta_llama(args: Any, checkpointed: bool = False) -> nn.Module:
    """The Llama on the meta device (``freqs_cis`` too: no checkpoint holds it, a build computes
    it); ``checkpointed``: each block under activation checkpointing, applied before the build."""
    with torch.device("meta"):
        model = llama.Transformer(args)
    if checkpointed:
        apply_activation_checkpointing(
            model, check_fn=lambda m: isinstance(m, llama.TransformerBlock)
        )
    return model


def real_llama(args: Any, seed: int) -> nn.Module:
    """The Llama as torchtitan makes it: built eagerly, then ``init_weights()`` under ``seed``."""
    torch.manual_seed(seed)
    model = llama.Transformer(args)
    model.init_weights()
    return model


def without_checkpoint_prefix(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict's keys as the model without activation checkpointing names them."""
    return {k.replace("_checkpoint_wrapped_module.", ""): v for k, v in state.items()}


# -- the library's demo transformer --------------------------------------------------------------


class TiedDemo(DemoTransformer):
    """The demo model with its output projection tied to the embedding."""

    def __init__(self, cfg: DemoConfig) -> None:
        super().__init__(cfg)
        self.head.weight = self.embed.weight


def meta_demo(cfg: DemoConfig, cls: type[DemoTransformer] = DemoTransformer) -> DemoTransformer:
    with torch.device("meta"):
        return cls(cfg)


def seeded_demo(cfg: DemoConfig, seed: int) -> DemoTransformer:
    """The demo model as eager PyTorch initializes it under ``seed``."""
    torch.manual_seed(seed)
    return DemoTransformer(cfg)


# -- a residual net of tiny blocks, trained on regression batches --------------------------------

DIM = 8
STEPS = 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class GainBlock(Block):
    """A Block whose float32 buffer turns its output back to float32: the next unit then gets
    float32 inputs, which only fully_shard's default input casting makes work in bf16."""

    gain: torch.Tensor
    calls = 0  # forward calls, recomputations under activation checkpointing included

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("gain", torch.ones(DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        GainBlock.calls += 1
        return super().forward(x) * self.gain


class Net(nn.Module):
    """A projection, then ``blocks`` residual blocks, then a mean: one output per row."""

    def __init__(self, blocks: int = 2, block: type[Block] = Block) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)
        self.blocks = nn.Sequential(*(block() for _ in range(blocks)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.proj(x)).mean(-1, keepdim=True)


def new_net(blocks: int = 2, block: type[Block] = Block) -> Net:
    """The same weights on every call (and every rank)."""
    torch.manual_seed(0)
    return Net(blocks, block)


def train(model: nn.Module, rank: int = 0, steps: int = STEPS) -> list[float]:
    """SGD steps on regression batches fixed by the step; rank ``r`` trains on its own ones."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(4, DIM, generator=gen), torch.randn(4, 1, generator=gen)
        loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


# -- plain-PyTorch oracles for initialization ----------------------------------------------------


@contextmanager
def one_thread() -> Iterator[None]:
    """Torch on one thread for a while, as a spawned rank runs: on a busy machine with few cores
    the small operations of a tiny model are many times faster than with contending threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def reset_module(module: nn.Module) -> None:
    """The module's own initializer, as its constructor runs it (``nn.MultiheadAttention``'s is
    private), for a module with states of its own."""
    if next(module.parameters(recurse=False), None) is None:
        if next(module.buffers(recurse=False), None) is None:
            return
    reset = getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
    if reset is not None:
        reset()


def own_modules(unit: nn.Module, units: list[nn.Module]) -> list[nn.Module]:
    """``unit`` and the modules below it breadth-first, without descending into other units."""
    others = {id(u) for u in units if u is not unit}
    found, queue = [], [unit]
    while queue:
        module = queue.pop(0)
        found.append(module)
        queue += [c for c in module.children() if id(c) not in others]
    return found


def eager_init_by_unit(
    units: list[nn.Module], init: Callable[[nn.Module], object] = reset_module
) -> None:
    """Materialize a model on meta in plain PyTorch, unit by unit in ``units``' order (bottom-up,
    the root last): ``to_empty(recurse=False)`` on each module the unit owns, then ``init`` on
    each, children first so a parent's initializer has the last word (MultiheadAttention zeroes
    its ``out_proj.bias``), as at construction. The order the builder documents for
    ``ResetParameters`` and ``InitFn(fn, allocate=True)``."""
    for unit in units:
        modules = own_modules(unit, units)
        for module in modules:
            module.to_empty(device="cpu", recurse=False)
        with torch.no_grad():
            for module in reversed(modules):
                init(module)


def demo_units(model: DemoTransformer) -> list[nn.Module]:
    """The demo model's units with ``wrap(Block)``, bottom-up: each block, then the root."""
    return [*model.blocks, model]


def ks_distance(sample: torch.Tensor, pool: torch.Tensor) -> float:
    """The two-sample Kolmogorov-Smirnov statistic: the largest gap between the empirical
    distribution functions of ``sample`` and ``pool``."""
    # In numpy: single-threaded, so quick on a busy machine where torch's threads contend.
    a = np.sort(sample.detach().flatten().double().numpy())
    b = np.sort(pool.flatten().double().numpy())
    at = np.concatenate([a, b])
    gap = np.searchsorted(a, at, side="right") / a.size
    gap -= np.searchsorted(b, at, side="right") / b.size
    return float(np.abs(gap).max())


def eager_draws(make: Callable[[], nn.Module], draws: int = 16) -> dict[str, list[torch.Tensor]]:
    """Each state of ``draws`` eager constructions ``make()`` under different seeds."""
    pools: dict[str, list[torch.Tensor]] = {}
    with torch.random.fork_rng(devices=[]):
        for seed in range(draws):
            torch.manual_seed(1000 + seed)
            for k, v in make().state_dict().items():
                pools.setdefault(k, []).append(v.detach().clone())
    return pools


def assert_drawn_like_eager(
    state: dict[str, torch.Tensor], pools: dict[str, list[torch.Tensor]]
) -> None:
    """``state`` holds what a model's own constructor initializes, without knowing its seeds
    (``pools``: ``eager_draws`` of that constructor): every state the constructor sets
    deterministically (LayerNorm's ones, zeroed biases) is equal to it, every random one passes
    a two-sample Kolmogorov-Smirnov test (p = 1e-4) against the eager draws, and two random
    states hold the same values exactly where the constructor ties them."""
    draws = len(next(iter(pools.values())))
    assert state.keys() == pools.keys()
    random: list[str] = []
    for k, got in state.items():
        first = pools[k][0]
        assert got.shape == first.shape and got.dtype == first.dtype, k
        if all(torch.equal(first, v) for v in pools[k][1:]):
            assert torch.equal(got, first), k
            continue
        n, m = got.numel(), first.numel() * draws
        bound = math.sqrt(-math.log(1e-4 / 2) / 2) * math.sqrt((n + m) / (n * m))
        distance = ks_distance(got, torch.stack(pools[k]))
        assert distance < bound, (k, distance, bound)
        random.append(k)
    # States the constructor ties hold one draw; any other two hold different ones.
    for i, a in enumerate(random):
        for b in random[i + 1 :]:
            if state[a].shape == state[b].shape:
                tied = torch.equal(pools[a][0], pools[b][0])
                assert torch.equal(state[a], state[b]) == tied, (a, b)


# -- counting what collectives carry --------------------------------------------------------------

# torch.distributed's collectives, by name: tests wrap each to measure the tensors it carries.
COLLECTIVES = (
    "broadcast",
    "scatter",
    "gather",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_reduce",
    "all_to_all_single",
    "send",
    "recv",
    "isend",
    "irecv",
    "broadcast_object_list",
    "all_gather_object",
)


def tensor_bytes(value: Any) -> list[int]:
    """The bytes of each tensor in ``value`` (a tensor, or lists/tuples of them)."""
    if isinstance(value, torch.Tensor):
        return [value.numel() * value.element_size()]
    if isinstance(value, list | tuple):
        return [n for v in value for n in tensor_bytes(v)]
    return []


@contextmanager
def counting_collectives(sent: list[int]) -> Iterator[None]:
    """Inside the block, the bytes of every tensor handed to a collective of ``COLLECTIVES``
    (``torch.distributed`` and its ``distributed_c10d`` module) are appended to ``sent``."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    def counting(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            for value in (*args, *kwargs.values()):
                sent.extend(tensor_bytes(value))
            return fn(*args, **kwargs)

        return wrapper

    saved: list[tuple[Any, str, Any]] = []
    for module in (dist, c10d):
        for name in COLLECTIVES:
            original = getattr(module, name, None)
            if original is not None:
                saved.append((module, name, original))
                setattr(module, name, counting(original))
    try:
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)
