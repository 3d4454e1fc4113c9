"""Which torch each feature needs (:data:`FEATURES`), and the configure-stage checks that refuse
a feature this torch lacks, naming the release that has it (see docs/torch_versions.md)."""

from __future__ import annotations

import functools
import re
import warnings
from collections.abc import Iterable
from typing import Final

import torch
from attrs import frozen
from torch.distributed.fsdp import ShardingStrategy

from fsdp_builder.common.logs import get_logger
from fsdp_builder.config import HYBRID_STRATEGIES
from fsdp_builder.errors import config_error

logger = get_logger(__name__)

Release = tuple[int, int]


@frozen
class Feature:
    """A feature some torch releases cannot do: ``minimum`` is the first that can, ``why`` what
    goes wrong before it, ``fix`` what to do instead of upgrading."""

    name: str
    minimum: Release
    why: str
    fix: str = ""

    @property
    def minimum_text(self) -> str:
        return f"{self.minimum[0]}.{self.minimum[1]}"


FSDP2_CPU: Final = "fsdp2_cpu"
FSDP2_REPLICATE_GLOO: Final = "fsdp2_replicate_gloo"
FSDP2_SHARDED_GLOO: Final = "fsdp2_sharded_gloo"
FSDP2_IGNORED_PARAMS: Final = "fsdp2_ignored_params"
DCP_NO_DIST: Final = "dcp_no_dist"

FEATURES: Final[dict[str, Feature]] = {
    FSDP2_CPU: Feature(
        "FullyShardBuilder (fully_shard) computing on the CPU",
        (2, 7),
        "fully_shard's CPU path calls Stream.record_event, which the CPU stream lacks before "
        "torch 2.7 (AttributeError in the first forward)",
        "Use FSDPBuilder (FSDP1) on the CPU, or compute on CUDA devices.",
    ),
    FSDP2_REPLICATE_GLOO: Feature(
        "FullyShardBuilder with a replicate dimension (NO_SHARD or hybrid sharding) on gloo",
        (2, 8),
        "fully_shard all-reduces gradients over the replicate dimension with ReduceOp.AVG, "
        "which gloo refuses before torch 2.8 ('Cannot use ReduceOp.AVG with Gloo')",
        "Use FSDPBuilder (FSDP1) for NO_SHARD or hybrid sharding on the CPU, or a FULL_SHARD / "
        "SHARD_GRAD_OP strategy.",
    ),
    FSDP2_SHARDED_GLOO: Feature(
        "FullyShardBuilder sharding over several ranks on gloo (FULL_SHARD, SHARD_GRAD_OP, "
        "hybrid sharding)",
        (2, 11),
        "on torch 2.7 and 2.8 the model trains but its losses leave the single-process "
        "reference after the first step, and tied parameters come apart (the compatibility "
        "matrix); 2.9 and 2.10 are not measured yet",
        "Use FSDPBuilder (FSDP1) on the CPU, or compute on CUDA devices.",
    ),
    FSDP2_IGNORED_PARAMS: Feature(
        "FullyShardBuilder.ignore (fully_shard(ignored_params=...))",
        (2, 7),
        "fully_shard has no ignored_params argument before torch 2.7",
        "Use FSDPBuilder to ignore modules or parameters.",
    ),
    DCP_NO_DIST: Feature(
        "FromCheckpoint of a torch.distributed.checkpoint folder (dcp.load(no_dist=True))",
        (2, 7),
        "torch.distributed.checkpoint.load has no no_dist argument before torch 2.7",
        "Convert the checkpoint to safetensors (FromCheckpoint reads those on any torch).",
    ),
}


def parse_release(version: str) -> Release:
    """``"2.8.0a0+git1234"`` → ``(2, 8)``: only major.minor counts."""
    match = re.match(r"\s*(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"not a torch version: {version!r}")
    return int(match.group(1)), int(match.group(2))


def newest_known() -> Release:
    """The newest release any feature of :data:`FEATURES` needs: one that can do them all."""
    return max(f.minimum for f in FEATURES.values())


def torch_release() -> Release:
    """This torch's (major, minor). An unreadable version is taken for :func:`newest_known`,
    with a warning, rather than refused: such custom builds are usually recent."""
    return _release_of(str(torch.__version__))


@functools.cache
def _release_of(version: str) -> Release:
    try:
        return parse_release(version)
    except ValueError:
        assumed = newest_known()
        warnings.warn(
            f"fsdp_builder cannot read the torch version {version!r} (expected "
            f"'major.minor...', e.g. '2.8.0+cu128'); it assumes torch "
            f"{assumed[0]}.{assumed[1]}, the newest release its version gates know. If this "
            "torch is older, a feature it lacks fails inside torch instead of being refused "
            "in the configure stage.",
            RuntimeWarning,
            stacklevel=3,
        )
        return assumed


def supports(feature: str, release: Release | None = None) -> bool:
    """Whether ``release`` (default: this torch) can do ``feature`` (a key of FEATURES)."""
    if feature not in FEATURES:
        raise ValueError(f"unknown feature {feature!r}; known: {', '.join(sorted(FEATURES))}")
    return (release or torch_release()) >= FEATURES[feature].minimum


def require(feature: str, where: str, argument: str) -> None:
    """Raise ``ConfigurationError`` (naming ``where``, ``argument`` and the minimum torch) when
    this torch cannot do ``feature``."""
    if supports(feature):
        return
    needed = FEATURES[feature]
    current = str(torch.__version__)
    logger.debug("torch too old", feature=feature, minimum=needed.minimum_text, torch=current)
    fix = f"Upgrade torch to {needed.minimum_text} or later"
    fix += f"; or: {needed.fix}" if needed.fix else "."
    raise config_error(
        where,
        argument,
        f"{needed.name} needs torch >= {needed.minimum_text}, this is torch {current} "
        f"({needed.why})",
        fix,
    )


def check_fully_shard(
    strategy: ShardingStrategy,
    device: torch.device,
    ignored_params: Iterable[object] = (),
) -> None:
    """The version gates of a ``fully_shard`` build (``strategy`` as configured, before clamping
    to the world size); FSDP1 needs nothing beyond the declared floor."""
    where = "FullyShardBuilder"
    if any(True for _ in ignored_params):
        require(FSDP2_IGNORED_PARAMS, f"{where}.ignore", "states")
    if device.type == "cpu":
        require(FSDP2_CPU, f"{where}.device", "device")
        if strategy in HYBRID_STRATEGIES | {ShardingStrategy.NO_SHARD} and _world_size() > 1:
            require(FSDP2_REPLICATE_GLOO, f"{where}.sharding", "strategy")
        if strategy != ShardingStrategy.NO_SHARD and _world_size() > 1:
            require(FSDP2_SHARDED_GLOO, f"{where}.sharding", "strategy")


def _world_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


__all__ = [
    "DCP_NO_DIST",
    "FEATURES",
    "FSDP2_CPU",
    "FSDP2_IGNORED_PARAMS",
    "FSDP2_REPLICATE_GLOO",
    "FSDP2_SHARDED_GLOO",
    "Feature",
    "check_fully_shard",
    "parse_release",
    "require",
    "supports",
    "newest_known",
    "torch_release",
]
