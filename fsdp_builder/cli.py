"""The ``fsdp-builder`` command: ``demo`` builds and trains a sharded model, ``plan`` prints a
model's unit plan without any process group, ``bench`` runs the benchmark harness."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from typing import Any

import structlog
import torch
import torch.distributed as dist

from fsdp_builder import (
    AutoHybridGroups,
    DeterministicInit,
    FSDPBuilder,
    FullyShardBuilder,
    ShardingBuilder,
)
from fsdp_builder.demo import Block, DemoConfig, DemoTransformer, train
from fsdp_builder.estimate import local_node_size

STRATEGIES = ("full", "grad_op", "hybrid", "none")


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


DEMO_SEED = 0


def build_demo(backend: str, strategy: str) -> ShardingBuilder:
    """The builder the demo uses: the model comes from meta, each unit initialized from a
    per-name seed, so the weights are the same whatever the world size."""
    builder: ShardingBuilder = FullyShardBuilder() if backend == "fsdp2" else FSDPBuilder()
    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    builder.device(device).wrap(Block).sharding(strategy)
    builder.materialize(DeterministicInit(seed=DEMO_SEED))
    if strategy == "hybrid":
        world = dist.get_world_size()
        per_node = local_node_size(world)
        builder.groups(AutoHybridGroups(devices_per_node=per_node))
    return builder


def demo_rank(backend: str, strategy: str, steps: int, verbose: bool) -> dict[str, Any]:
    """One rank of the demo: build, train, return the report and losses."""
    configure_logging(verbose)
    cfg = DemoConfig()
    with torch.device("meta"):
        model = DemoTransformer(cfg)
    builder = build_demo(backend, strategy)
    sharded = builder.build(model)
    losses = train(sharded, cfg, steps, dist.get_rank(), dist.get_world_size())
    report = builder.report
    return {
        "text": report.format(),
        "world_size": dist.get_world_size(),
        "backend": backend,
        "strategy": report.strategy,
        "stages": [
            {"name": s["name"], "seconds": s["seconds"], "peak_bytes": s["peak_bytes"]}
            for s in report.stages()
        ],
        "units": len(builder.plan),
        "model_params": builder.plan.numel,
        "losses": losses,
    }


def _under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def cmd_demo(args: argparse.Namespace) -> int:
    if _under_torchrun():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
        try:
            out = demo_rank(args.backend, args.strategy, args.steps, args.verbose)
        finally:
            dist.destroy_process_group()
        if int(os.environ["RANK"]) != 0:
            return 0
    else:
        from fsdp_builder.launch import run_ranks

        outs = run_ranks(
            demo_rank,
            args.world_size,
            args.backend,
            args.strategy,
            args.steps,
            args.verbose,
            timeout=args.timeout,
        )
        out = outs[0]
        out["losses_per_rank"] = [o["losses"] for o in outs]
    if args.json:
        print(json.dumps({k: v for k, v in out.items() if k != "text"}))
    else:
        print(out["text"])
        print(f"model: {out['model_params']:,} parameters in {out['units']} units")
        for r, losses in enumerate(out.get("losses_per_rank", [out["losses"]])):
            print(f"rank {r} losses: " + ", ".join(f"{x:.4f}" for x in losses))
    return 0


def load_factory(spec: str) -> Any:
    """Resolve ``package.module:callable``."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise SystemExit(f"expected MODULE:FACTORY, got {spec!r}")
    return getattr(importlib.import_module(module_name), attr)


def cmd_plan(args: argparse.Namespace) -> int:
    from fsdp_builder.estimate import format_estimates
    from fsdp_builder.ignored import IgnoredStates
    from fsdp_builder.plan import plan_units
    from fsdp_builder.wrap import WrapPolicy

    factory = load_factory(args.factory)
    with torch.device("meta"):
        model = factory()
    classes: list[type[torch.nn.Module]] = []
    for name in args.wrap or []:
        matches = {type(m) for m in model.modules() if type(m).__name__ == name}
        if not matches:
            raise SystemExit(f"--wrap {name}: no module of that class in the model")
        classes.extend(matches)
    plan = plan_units(model, WrapPolicy(classes=tuple(classes)), IgnoredStates())
    print(plan.format())
    print()
    print(format_estimates(plan, args.world_size))
    return 0


def cmd_bench(args: argparse.Namespace, rest: list[str]) -> int:
    try:
        harness = importlib.import_module("benchmarks.harness")
    except ImportError as exc:
        raise SystemExit(
            f"`fsdp-builder bench` cannot start: {exc}. Install the harness and its extras "
            "from the repository with `pip install -e '.[bench]'`."
        ) from None
    return int(harness.main(rest))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fsdp-builder", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="build and train a small sharded model on local ranks")
    demo.add_argument("--world-size", type=int, default=2)
    demo.add_argument("--backend", choices=("fsdp1", "fsdp2"), default="fsdp1")
    demo.add_argument("--strategy", choices=STRATEGIES, default="full")
    demo.add_argument("--steps", type=int, default=3)
    demo.add_argument("--json", action="store_true", help="print the report as one JSON line")
    demo.add_argument("--verbose", action="store_true", help="log every stage event")
    demo.add_argument("--timeout", type=float, default=300.0)
    plan = sub.add_parser("plan", help="print a model's unit plan; needs no process group")
    plan.add_argument("factory", help="MODULE:FACTORY returning an nn.Module")
    plan.add_argument("--wrap", action="append", help="module class name to wrap (repeatable)")
    plan.add_argument("--world-size", type=int, default=2)
    sub.add_parser("bench", help="run the benchmark harness (see benchmarks/)", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        return cmd_bench(args, rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "demo":
        if args.world_size < 1:
            parser.error("--world-size must be at least 1")
        return cmd_demo(args)
    return cmd_plan(args)


if __name__ == "__main__":
    sys.exit(main())
