"""The ``fsdp-builder`` command (also ``python -m fsdp_builder``).

``demo`` builds a small transformer sharded over local ranks and trains it a few steps; ``plan``
prints a model's wrap units and a per-rank training memory estimate without any process group,
or with ``--simulate WORLD`` runs the build itself on a fake process group and reports each
simulated rank's shards, reads and measured peak; ``bench`` runs the benchmark harness from a
checkout of the repository.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import json
import logging
import multiprocessing as mp
import os
import shlex
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.distributed as dist

from fsdp_builder import AutoHybridGroups, DeterministicInit
from fsdp_builder.builder import ShardingBuilder, builder_for
from fsdp_builder.errors import ConfigurationError
from fsdp_builder.tools import estimate
from fsdp_builder.tools.demo import Block, DemoConfig, DemoTransformer, train
from fsdp_builder.tools.estimate import STRATEGIES
from fsdp_builder.tools.hf_plan import DTYPES
from fsdp_builder.tools.launch import end_process_group, run_ranks

EPILOG = (
    "Under torchrun the demo uses torchrun's ranks instead of starting its own: "
    "`torchrun --nproc-per-node 2 -m fsdp_builder demo`."
)


def configure_logging(verbose: bool) -> None:
    """The CLI's structlog set-up; the library itself never configures logging."""
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.dev.ConsoleRenderer(colors=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.DEBUG if verbose else logging.WARNING
        ),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )


def progress(message: str, quiet: bool = False) -> None:
    """One short progress line on stderr (stdout stays the report, or the JSON line)."""
    if not quiet:
        print(message, file=sys.stderr, flush=True)


DEMO_SEED = 0


def demo_rank(args: argparse.Namespace) -> dict[str, Any]:
    """One rank of ``demo``: build, train on a fixed batch, return the report and losses."""
    configure_logging(args.verbose)
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank != 0:
        warnings.simplefilter("ignore")  # the other ranks repeat rank 0's warnings
    else:
        # One line per warning (where it was raised inside the ranks says nothing here), without
        # FSDP2's view warning (the demo never writes its output in place) or FSDP1's repeat of
        # the builder's NO_SHARD deprecation.
        warnings.showwarning = lambda message, category, *_: print(
            f"{category.__name__}: {message}", file=sys.stderr, flush=True
        )
        warnings.filterwarnings("ignore", r".*returned a view tensor", UserWarning)
        warnings.filterwarnings(
            "ignore", r"The `NO_SHARD` sharding strategy is deprecated", FutureWarning
        )
    lead = rank == 0 and not args.quiet
    cfg = DemoConfig()
    with torch.device("meta"):
        model = DemoTransformer(cfg)
    progress(
        f"{world} rank(s) ready; building the sharded model ({args.backend}, {args.strategy})…",
        not lead,
    )
    # World-size-invariant weights from meta; blocks optionally checkpointed and compiled, in
    # torchtitan's order (checkpoint, compile, shard).
    builder = builder_for(args.backend)
    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    builder.device(device).wrap(Block).sharding(args.strategy)
    builder.materialize(DeterministicInit(seed=DEMO_SEED))
    if args.activation_checkpointing:
        builder.activation_checkpointing(Block)
    if args.compile is not None:
        # "default": inductor on CUDA, aot_eager on CPU (no C compiler needed).
        chosen = {"default": None if cuda else "aot_eager"}.get(args.compile, args.compile)
        builder.compile(per_unit=True, **({} if chosen is None else {"backend": chosen}))
    if args.strategy == "hybrid":
        per_node = estimate.local_node_size(world)
        builder.groups(AutoHybridGroups(devices_per_node=per_node))
    sharded = builder.build(model)
    if args.steps:
        progress(f"training {args.steps} step(s) on a fixed batch…", not lead)
    losses = train(sharded, cfg, args.steps, rank, world, fixed_batch=True)
    report = builder.report
    return {
        "text": report.format(),
        "world_size": world,
        "backend": args.backend,
        "strategy": report.strategy,
        "stages": [{k: s[k] for k in ("name", "seconds", "peak_bytes")} for s in report.stages()],
        "units": len(builder.plan),
        "model_params": builder.plan.numel,
        "losses": losses,
        "activation_checkpointing": args.activation_checkpointing,
        "compile": args.compile,
    }


def cmd_demo(args: argparse.Namespace) -> int:
    if all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        try:
            out = demo_rank(args)
            # Every rank's losses, as when the demo starts the ranks itself.
            per_rank: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(per_rank, out["losses"])
            out["losses_per_rank"] = per_rank
        finally:
            end_process_group()
        if int(os.environ["RANK"]) != 0:
            return 0
    else:
        # One server imports torch and the demo, and each rank forks from it: the ranks do not
        # each import them again (about half the CPU time of starting them on two cores).
        mp.set_forkserver_preload(["torch", "torch.distributed.fsdp", "fsdp_builder.tools.cli"])
        progress(
            f"starting {args.world_size} rank(s) on gloo (importing torch: a few seconds)…",
            args.quiet,
        )
        outs = run_ranks(
            demo_rank, args.world_size, args, timeout=args.timeout, start_method="forkserver"
        )
        out = outs[0]
        out["losses_per_rank"] = [o["losses"] for o in outs]
    if args.json:
        print(json.dumps({k: v for k, v in out.items() if k != "text"}))
    else:
        print(out["text"])
        print(f"model: {out['model_params']:,} parameters in {out['units']} units")
        if not args.steps:
            print("no training steps (--steps 0)")
        for r, losses in enumerate(out["losses_per_rank"]):
            if losses:
                print(f"rank {r} losses: " + ", ".join(f"{x:.4f}" for x in losses))
    return 0


def load_factory(spec: str, option: str = "MODULE:FACTORY", returns: str = "the model") -> Any:
    """Resolve ``module:function``, importing from the current directory first; ``option`` and
    ``returns`` name the argument and what its function returns in the messages."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise SystemExit(
            f"{option}: expected the form module:function, a function returning {returns} "
            f"(e.g. {'myjob:make_builder' if option == '--builder' else 'mymodel:make'}), "
            f"got {spec!r}"
        )
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise SystemExit(
            f"cannot import {module_name!r} ({exc}); run the command from the folder that holds "
            "it, or install it"
        ) from None
    try:
        found = getattr(module, attr)
    except AttributeError:
        raise SystemExit(f"{module_name!r} has no attribute {attr!r}") from None
    if not callable(found):
        raise SystemExit(
            f"{option} {spec}: {attr} is a {type(found).__name__}, not a function; name a "
            f"function returning {returns}"
        )
    return found


def wrap_classes(model: torch.nn.Module, names: list[str] | None) -> list[type[torch.nn.Module]]:
    """The classes of ``model``'s modules named by ``--wrap``; exits naming one that none has."""
    classes: list[type[torch.nn.Module]] = []
    for name in names or []:
        found = {type(m) for m in model.modules() if type(m).__name__ == name}
        if not found:
            raise SystemExit(f"--wrap {name}: no module of that class in the model")
        classes.extend(found)
    return classes


def cli_builder(args: Any, model: torch.nn.Module) -> Callable[[], ShardingBuilder]:
    """The builder of ``fsdp-builder plan`` without ``--builder``: the command line's backend,
    strategy, wrap classes (found in ``model``) and checkpoint. Its plan is the plan ``plan``
    prints; ``--simulate`` builds with it, hybrid groups made on the fake process group."""
    from fsdp_builder.groups import AutoHybridGroups
    from fsdp_builder.materializers.checkpoints import FromCheckpoint

    classes = wrap_classes(model, args.wrap)

    def make() -> ShardingBuilder:
        builder = builder_for(args.backend).sharding(args.strategy)
        if classes:
            builder.wrap(*classes)
        # Hybrid groups where there is a process group, the dry run's fake one: the plan
        # without --simulate needs none.
        if args.strategy == "hybrid" and dist.is_initialized():
            per_node = args.devices_per_node or 8
            world = dist.get_world_size()
            # A (nodes, devices per node) mesh: both backends take one, and FSDP2's grid check
            # of groups made by hand needs collectives the fake group cannot answer.
            if world % per_node == 0:
                from torch.distributed.device_mesh import init_device_mesh

                builder.groups(init_device_mesh("cpu", (world // per_node, per_node)))
            else:
                builder.groups(AutoHybridGroups(devices_per_node=per_node))
        if args.checkpoint:
            builder.materialize(FromCheckpoint(args.checkpoint))
        if checkpointed:
            builder.activation_checkpointing(checkpointed)
        if args.param_dtype:
            builder.mixed_precision(param_dtype=estimate.PARAM_DTYPES[args.param_dtype])
        return builder

    checkpointed: tuple[type[torch.nn.Module], ...] = ()
    if getattr(args, "activation_checkpointing", False):
        from fsdp_builder.planning.wrap import no_split_class_names

        names = set(args.wrap or no_split_class_names(model))
        checkpointed = tuple({type(m) for m in model.modules() if type(m).__name__ in names})
        if not checkpointed:
            raise SystemExit(
                "`fsdp-builder plan`: --activation-checkpointing needs the blocks to "
                "checkpoint, and the model names none (_no_split_modules). Name them with "
                "--wrap CLASS."
            )
    return make


def model_factory(args: Any) -> Callable[[], torch.nn.Module]:
    """The command's model as a function to call under ``torch.device("meta")``: a
    transformers folder's from its config, else ``MODULE:FACTORY``'s, in ``args.dtype`` when
    given."""
    from fsdp_builder.tools.hf_plan import is_config_path, meta_model_from_config

    spec, dtype = args.factory, args.dtype
    if is_config_path(spec):
        return functools.partial(meta_model_from_config, spec, dtype)
    made = load_factory(spec)

    def make() -> torch.nn.Module:
        model = made()
        if not isinstance(model, torch.nn.Module):
            raise ConfigurationError(f"{spec} returned {type(model).__name__}, not an nn.Module")
        return model if dtype is None else model.to(dtype)

    return make


def on_meta(make: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    with torch.device("meta"):
        return make()


def training_step(factory: str, batch: int, seq: int | None) -> tuple[Any, str]:
    """The dry run's step for a transformers model: a causal-LM loss on ``batch`` random
    sequences of ``seq`` tokens (default: the config's context, at most 2,048), and the line
    saying so."""
    from fsdp_builder.tools.hf_plan import config_file

    config = json.loads(config_file(factory).read_text())
    text = config.get("text_config") or {}
    vocab = int(config.get("vocab_size") or text.get("vocab_size") or 0)
    if vocab < 1:
        raise SystemExit(
            f"--step: {factory}'s config.json names no vocab_size, so the step cannot make its "
            "tokens; call simulate(..., step=...) from Python with the model's own inputs."
        )
    context = config.get("max_position_embeddings") or 2048
    length = seq or min(2048, int(context))

    def step(model: torch.nn.Module) -> torch.Tensor:
        ids = torch.randint(0, vocab, (batch, length))
        loss: torch.Tensor = model(input_ids=ids, labels=ids).loss
        return loss

    return step, f"step: batch {batch} x sequence {length}, causal-LM loss"


def run_dry_run(args: Any, assumptions: str = "") -> int:
    """``fsdp-builder plan ... --simulate WORLD``: prints the dry run (or its JSON); exits 1
    when a simulated rank's build raises. ``args.dtype``: the model's dtype (None: as made);
    ``assumptions``: the line saying which dtype and allocator the figures assume. Without
    ``--rank``, the first and the last rank: FSDP2's last ranks hold fewer rows, or none."""
    from fsdp_builder.tools.dryrun import OPTIMIZERS, as_dict, format_dry_run, simulate
    from fsdp_builder.tools.hf_plan import is_config_path

    spec = args.factory
    if args.step and not is_config_path(spec):
        raise SystemExit(
            f"`fsdp-builder plan`: --step needs the model's inputs, which only a transformers "
            f"folder's config gives the command line; for {spec}, call "
            "fsdp_builder.tools.dryrun.simulate(..., step=lambda model: loss) from Python."
        )
    # The builder's spec first: a malformed one is named before the model is made.
    if args.builder:
        builder_factory = load_factory(args.builder, "--builder", "the job's configured builder")
    make_model = model_factory(args)
    if not args.builder:
        builder_factory = cli_builder(args, on_meta(make_model))
    elif is_config_path(spec):
        on_meta(make_model)  # a bad config is named once, before any rank
    step, optimizer = None, None
    if args.step:
        step, step_note = training_step(spec, args.batch or 1, args.seq)
        optimizer = OPTIMIZERS[args.optimizer or "adamw"]
        assumptions = f"{step_note}, optimizer {args.optimizer or 'adamw'}; {assumptions}"
    try:
        ranks = args.rank or sorted({0, max(args.simulate - 1, 0)})
        run = simulate(
            builder_factory, make_model, args.simulate, ranks, step=step, optimizer=optimizer
        )
    except ConfigurationError as exc:
        raise SystemExit(str(exc)) from exc
    if args.json:
        print(json.dumps(as_dict(run) | {"assumptions": assumptions}))
    else:
        tail = f"\nassumptions: {assumptions}" if assumptions else ""
        print(format_dry_run(run, shards=8) + tail)
    return 0 if all(r.ok for r in run.runs) else 1


def cmd_plan(args: argparse.Namespace) -> int:
    refuse_ineffective(args)
    given_dtype = args.dtype
    args.dtype, dtype_note = model_dtype(args)
    args.backend = args.backend or "fsdp2"
    args.strategy = args.strategy or "full"
    if args.simulate is not None:
        return run_dry_run(args, dtype_note)
    world, per_node = args.world_size or 2, args.devices_per_node
    model = on_meta(model_factory(args))
    plan = cli_builder(args, model)().plan_for(model)  # the plan the dry run builds
    training = estimate.training_estimate(
        plan,
        world,
        strategy=args.strategy,
        backend=args.backend,
        optimizer=args.optimizer or "adamw",
        param_dtype=args.param_dtype,
        devices_per_node=per_node,
    )
    measure = dry_run_command(args, world, given_dtype)
    if args.json:
        report = {
            "factory": args.factory,
            "world_size": world,
            "hybrid_shard_size": estimate.hybrid_shard_size(world, per_node),
            "params": plan.numel,
            "bytes": plan.nbytes,
            "largest_unit_bytes": plan.largest_unit_bytes,
            "units": [
                {"name": u.label, "params": u.numel, "bytes": u.nbytes, "buffers": len(u.buffers)}
                for u in plan
            ],
            "training": training.as_dict(),
            "dry_run": measure,
        }
        print(json.dumps(report))
    else:
        build = (
            "build memory per rank: measured by the dry run, which runs this build as ranks of "
            f"a fake process group (no memory for the model):\n  {measure}"
        )
        training_text = estimate.format_training(training, world)
        print(plan.format(), build, training_text, f"assumptions: {dtype_note}", sep="\n\n")
    return 0


def dry_run_command(args: argparse.Namespace, world: int, dtype: str | None) -> str:
    """The ``plan --simulate`` command that builds what this plan describes."""
    words = ["fsdp-builder", "plan", args.factory, "--simulate", str(world)]
    words += ["--backend", args.backend, "--strategy", args.strategy]
    for name in args.wrap or ():
        words += ["--wrap", name]
    if args.strategy == "hybrid" and args.devices_per_node:
        words += ["--devices-per-node", str(args.devices_per_node)]
    if dtype is not None:
        words += ["--dtype", dtype]
    return shlex.join(words)


# Options of `plan` that only the dry run (--simulate) reads, those only its training step
# (--step) reads, and those the estimates read and the dry run reads only with --step.
_DRY_RUN_ONLY = ("rank", "builder", "checkpoint", "step")
_STEP_ONLY = ("batch", "seq", "activation_checkpointing")
_ESTIMATE_ONLY = ("world_size", "optimizer", "param_dtype")
# What --builder replaces: the dry run's own builder's settings.
_BUILDER_SETTINGS = (
    "backend", "strategy", "wrap", "devices_per_node", "checkpoint", "activation_checkpointing",
    "param_dtype",
)  # fmt: skip


def _option(name: str) -> str:
    spelled = "--" + name.replace("_", "-")
    return f"{spelled} (--mixed-precision)" if name == "param_dtype" else spelled


def refuse_ineffective(args: argparse.Namespace) -> None:
    """An option given where it changes nothing is refused, naming it: a silently ignored
    option is a figure the user believes and the run does not compute."""
    every = (*_DRY_RUN_ONLY, *_STEP_ONLY, *_ESTIMATE_ONLY, *_BUILDER_SETTINGS)
    given = [n for n in every if getattr(args, n)]
    if not args.step:
        for name in _STEP_ONLY:
            if name in given:
                raise SystemExit(
                    f"`fsdp-builder plan`: {_option(name)} has no effect without --step (it "
                    f"sets the dry run's training step). Add --simulate WORLD --step, or drop "
                    f"{_option(name)}."
                )
    if args.simulate is None:
        for name in _DRY_RUN_ONLY:
            if name in given:
                raise SystemExit(
                    f"`fsdp-builder plan`: {_option(name)} has no effect without --simulate "
                    "WORLD (it sets the dry run). Add --simulate WORLD, or drop "
                    f"{_option(name)}."
                )
        return
    for name in _ESTIMATE_ONLY:
        if name == "world_size" and name in given:
            raise SystemExit(
                "`fsdp-builder plan`: --world-size has no effect with --simulate (--simulate "
                "WORLD sets the world size). Drop --world-size."
            )
        if name in given and not args.step:
            raise SystemExit(
                f"`fsdp-builder plan`: {_option(name)} has no effect with --simulate and no "
                f"--step (the dry run then builds and does not train). Add --step, or drop "
                f"{_option(name)}."
            )
    if not args.builder and args.devices_per_node and args.strategy != "hybrid":
        raise SystemExit(
            "`fsdp-builder plan`: --devices-per-node has no effect in the dry run without "
            "--strategy hybrid (it sizes hybrid sharding's shard groups). Add --strategy "
            "hybrid, or drop --devices-per-node."
        )
    if args.builder:
        for name in _BUILDER_SETTINGS:
            if name in given:
                raise SystemExit(
                    f"`fsdp-builder plan`: {_option(name)} has no effect with --builder (the "
                    f"dry run builds with the builder it returns, as configured there). Set it "
                    f"on that builder (a checkpoint: .materialize(FromCheckpoint(PATH))), or "
                    f"drop --builder."
                )


def model_dtype(args: argparse.Namespace) -> tuple[torch.dtype | None, str]:
    """The model's dtype for the figures (None: as the factory makes it) and a line saying
    which dtype and allocator the figures assume."""
    from fsdp_builder.tools.hf_plan import config_dtype, is_config_path

    allocator = (
        "memory is tensor bytes: what the allocator holds beyond them is not counted (on the "
        "CPU, glibc keeps freed memory unless MALLOC_MMAP_THRESHOLD_ is set, e.g. 65536; on a "
        "GPU, the caching allocator's reserve)"
    )
    if args.dtype is not None:
        dtype, where = DTYPES[args.dtype], "--dtype"
    elif is_config_path(args.factory):
        found = config_dtype(args.factory)
        dtype = found or torch.float32
        where = "config.json's dtype" if found else "config.json names no dtype"
    else:
        return None, f"the model's dtypes as {args.factory} makes it; {allocator}"
    return dtype, f"parameters in {str(dtype).removeprefix('torch.')} ({where}); {allocator}"


def cmd_bench(rest: list[str]) -> int:
    """Run the current directory's ``benchmarks/harness.py`` once its extras are installed."""
    cwd = Path.cwd()
    if not (cwd / "benchmarks" / "harness.py").is_file():
        raise SystemExit(
            "`fsdp-builder bench` runs the benchmark harness in benchmarks/, which is not "
            "installed with the library: run it from a checkout of the repository (the folder "
            "holding benchmarks/harness.py)."
        )
    missing = [name for name in ("matplotlib", "tqdm") if importlib.util.find_spec(name) is None]
    if missing:
        raise SystemExit(
            f"`fsdp-builder bench` needs {' and '.join(missing)}: install the bench extra with "
            "`pip install -e '.[bench]'` from the repository."
        )
    if str(cwd) not in sys.path:
        sys.path.insert(0, str(cwd))
    harness = importlib.import_module("benchmarks.harness")
    return int(harness.main(rest))


def _add_layout(parser: argparse.ArgumentParser, backend_help: str, strategy_help: str) -> None:
    parser.add_argument("--backend", choices=estimate.BACKENDS, default="fsdp1", help=backend_help)
    parser.add_argument("--strategy", choices=STRATEGIES, default="full", help=strategy_help)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fsdp-builder",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = sub.add_parser(
        "demo",
        help="build a small transformer sharded over local ranks and train it a few steps",
        description="Build a small transformer (3 blocks, 183k parameters) from the meta "
        "device, sharded over CPU ranks with gloo (or torchrun's ranks), train it a few SGD "
        "steps on a fixed batch and print the build report and each rank's losses. Progress "
        "goes to stderr.",
        epilog=EPILOG,
    )
    demo.add_argument(
        "--world-size",
        type=int,
        default=2,
        help="ranks to start (default 2; ignored under torchrun, which sets the world)",
    )
    _add_layout(
        demo,
        "fsdp1: FullyShardedDataParallel (FSDPBuilder); fsdp2: fully_shard "
        "(FullyShardBuilder). Default fsdp1",
        "full: shard parameters, gradients and optimizer states; grad_op: keep parameters "
        "gathered between forward and backward; hybrid: shard within a node of 2 ranks, "
        "replicate across nodes; none: replicate (NO_SHARD). Default full",
    )
    demo.add_argument(
        "--steps", type=int, default=3, help="training steps after the build (default 3; 0: none)"
    )
    demo.add_argument(
        "--json",
        action="store_true",
        help="print one JSON line (stages, units, every rank's losses) instead of the report",
    )
    demo.add_argument(
        "--verbose", action="store_true", help="log every stage event of the build (structlog)"
    )
    demo.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="checkpoint each block's activations (torch's checkpoint_wrapper, before sharding)",
    )
    demo.add_argument(
        "--compile",
        nargs="?",
        const="default",
        default=None,
        metavar="BACKEND",
        help="torch.compile each block after checkpointing and before sharding; BACKEND is "
        "torch.compile's (eager, aot_eager, inductor...), default: inductor on CUDA, aot_eager "
        "on CPU (no C compiler needed)",
    )
    demo.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    demo.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds before started ranks are stopped as hung (default 300)",
    )
    plan = sub.add_parser(
        "plan",
        help="print a model's wrap units and a per-rank training memory estimate; with "
        "--simulate, run the build on a fake process group and measure it",
        description="Build the model on the meta device (no memory), split it into wrap units "
        "as the builder does, and estimate per-rank training memory (the chosen backend, "
        "strategy, optimizer and mixed precision). With --simulate WORLD, run the build itself "
        "as ranks of a fake process group instead and report each rank's shards, reads and "
        "measured build peak. Imports MODULE from the current directory first, as `python -m` "
        "does.",
    )
    plan.add_argument(
        "factory",
        metavar="MODULE:FACTORY|FOLDER",
        help="a callable returning an nn.Module, e.g. mymodel:make (called under "
        "torch.device('meta')), or a transformers folder (or its config.json), whose model is "
        "created on meta from its config",
    )
    plan.add_argument(
        "--wrap",
        action="append",
        metavar="CLASS",
        help="class name of the modules to wrap as units, as .wrap(CLASS) (repeatable)",
    )
    plan.add_argument(
        "--world-size", type=int, help="ranks to estimate for (default 2; not with --simulate)"
    )
    plan.add_argument(
        "--devices-per-node",
        type=int,
        help="ranks per node, for hybrid sharding's shard groups (default: what "
        "AutoHybridGroups finds on this machine)",
    )
    plan.add_argument(
        "--backend",
        choices=estimate.BACKENDS,
        help="backend of the training estimate and of the dry run's builder (default fsdp2, "
        "FullyShardBuilder's)",
    )
    plan.add_argument(
        "--strategy",
        choices=STRATEGIES,
        help="sharding strategy of the training estimate and of the dry run's builder "
        "(default full)",
    )
    plan.add_argument(
        "--dtype",
        choices=tuple(DTYPES),
        help="the model's dtype for every figure (default: the config.json's dtype for a "
        "transformers folder, float32 where it names none; as the factory makes it for "
        "MODULE:FACTORY)",
    )
    plan.add_argument(
        "--optimizer",
        choices=tuple(estimate.OPTIMIZER_STATES),
        help="optimizer of the training estimate and of the dry run's --step: adamw/adam "
        "keep 2 states per parameter, sgd-momentum 1, sgd and none 0 (default adamw)",
    )
    plan.add_argument(
        "--param-dtype",
        "--mixed-precision",
        dest="param_dtype",
        choices=tuple(estimate.PARAM_DTYPES),
        help="mixed-precision compute dtype, as .mixed_precision(param_dtype=...): adds the "
        "low-precision copies gathered for compute (default: no mixed precision)",
    )
    plan.add_argument(
        "--json", action="store_true", help="print the plan and estimate (or the dry run) as JSON"
    )
    plan.add_argument(
        "--simulate",
        type=int,
        metavar="WORLD",
        help="run the real build as ranks of a world of WORLD on torch's fake process group, "
        "without memory for the model, and report each rank's error or shards and reads",
    )
    plan.add_argument(
        "--rank",
        type=int,
        action="append",
        metavar="R",
        help="with --simulate: a rank to simulate (repeatable; default the first and the last)",
    )
    plan.add_argument(
        "--builder",
        metavar="MODULE:FACTORY",
        help="with --simulate: a callable returning the job's configured builder, in place of "
        "--backend, --strategy, --wrap, --devices-per-node and --checkpoint",
    )
    plan.add_argument(
        "--checkpoint",
        metavar="PATH",
        help="with --simulate: materialize with FromCheckpoint(PATH) and report the reads",
    )
    plan.add_argument(
        "--step",
        action="store_true",
        help="with --simulate and a transformers folder: also run two training steps on the "
        "built model (forward, causal-LM loss, backward, optimizer step) and report each "
        "rank's peak and its parts (torch's FSDPMemTracker for fsdp2, MemTracker for fsdp1)",
    )
    plan.add_argument(
        "--batch", type=int, help="with --step: sequences per rank per step (default 1)"
    )
    plan.add_argument(
        "--seq",
        type=int,
        help="with --step: tokens per sequence (default: the config's "
        "max_position_embeddings, at most 2048)",
    )
    plan.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="with --step: checkpoint each block's activations, as "
        ".activation_checkpointing(Block) (the --wrap classes, else the model's "
        "_no_split_modules)",
    )
    sub.add_parser(
        "bench",
        help="run the benchmark harness from a checkout (`fsdp-builder bench --help` for its "
        "options; needs `pip install -e '.[bench]'`)",
        add_help=False,
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        return cmd_bench(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.world_size is not None and args.world_size < 1:
        parser.error("--world-size must be at least 1")
    if args.command == "demo":
        if args.steps < 0:
            parser.error("--steps must be at least 0")
        return cmd_demo(args)
    if args.devices_per_node is not None and args.devices_per_node < 1:
        parser.error("--devices-per-node must be at least 1")
    for name in ("batch", "seq"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    try:
        return cmd_plan(args)
    except ConfigurationError as exc:  # the library's message says what to fix: no traceback
        raise SystemExit(str(exc)) from exc


if __name__ == "__main__":
    sys.exit(main())
