"""fsdp_builder: PyTorch FSDP initialization as a fluent builder with pluggable strategies.

``__all__`` holds what a user of the builder needs: the builders, the ready-made strategies, the
role protocols and their base classes, the registries and the errors. Names for advanced use
(the plan, the report, the configuration records, checkpoint rule classes) live in their
modules, e.g. ``fsdp_builder.planning.plan.UnitPlan``; they stay importable from here too, for
code written against earlier releases. Module paths that moved keep working with a
``DeprecationWarning`` (``fsdp_builder.moved``).
"""

from fsdp_builder import moved as _moved
from fsdp_builder.builder import BuilderConfig as BuilderConfig
from fsdp_builder.builder import FSDPBuilder, FullyShardBuilder
from fsdp_builder.builder import ShardingBuilder as ShardingBuilder
from fsdp_builder.config import ShardingOptions as ShardingOptions
from fsdp_builder.devices import BaseDeviceResolver, CPUDevice, DeviceResolver, LocalRankDevice
from fsdp_builder.devices import ExplicitDevice as ExplicitDevice
from fsdp_builder.devices import InferredDevice as InferredDevice
from fsdp_builder.errors import (
    CommunicationError,
    ConfigurationError,
    ExportError,
    FSDPBuilderError,
    MaterializationError,
    PlanError,
    RankDisagreementError,
    StateMismatchError,
)
from fsdp_builder.export import save_hf_checkpoint
from fsdp_builder.groups import (
    AutoHybridGroups,
    BaseGroupFactory,
    GroupFactory,
    HybridGroups,
    MeshGroups,
)
from fsdp_builder.groups import DefaultGroups as DefaultGroups
from fsdp_builder.groups import GivenGroup as GivenGroup
from fsdp_builder.groups import ProcessGroups as ProcessGroups
from fsdp_builder.materializers.checkpoints import FromCheckpoint
from fsdp_builder.materializers.conventions import register_initializer, register_subtree_rule
from fsdp_builder.materializers.initializers import (
    BaseMaterializer,
    DeferredInit,
    DeterministicInit,
    InitFn,
    KeepAsIs,
    Materializer,
    ResetParameters,
)
from fsdp_builder.materializers.loading import FromStateDict
from fsdp_builder.materializers.sharded import InitWeights, ShardFirstReset
from fsdp_builder.materializers.streams import StreamInit
from fsdp_builder.planning.ignored import IgnoredStates as IgnoredStates
from fsdp_builder.planning.ignored import resolve_ignored as resolve_ignored
from fsdp_builder.planning.plan import Unit
from fsdp_builder.planning.plan import UnitPlan as UnitPlan
from fsdp_builder.planning.plan import plan_units as plan_units
from fsdp_builder.planning.wrap import NoSplitModules
from fsdp_builder.planning.wrap import WrapPolicy as WrapPolicy
from fsdp_builder.runtime.environment import Environment
from fsdp_builder.runtime.report import BuildReport as BuildReport
from fsdp_builder.runtime.report import StageRecord as StageRecord
from fsdp_builder.sources import CheckpointSource as CheckpointSource
from fsdp_builder.sources import MergeExperts as MergeExperts
from fsdp_builder.sources import Rename as Rename
from fsdp_builder.sources import TensorMeta as TensorMeta
from fsdp_builder.sources import register_checkpoint_rules, register_format
from fsdp_builder.synchronizers import (
    BaseSynchronizer,
    BroadcastFromRank0,
    Chain,
    NoSync,
    StateSynchronizer,
    VerifyReplicas,
)

__all__ = [
    "AutoHybridGroups",
    "BaseDeviceResolver",
    "BaseGroupFactory",
    "BaseMaterializer",
    "BaseSynchronizer",
    "CPUDevice",
    "Chain",
    "CommunicationError",
    "ConfigurationError",
    "ExportError",
    "DeviceResolver",
    "Environment",
    "FSDPBuilder",
    "FSDPBuilderError",
    "FullyShardBuilder",
    "GroupFactory",
    "HybridGroups",
    "KeepAsIs",
    "LocalRankDevice",
    "MaterializationError",
    "Materializer",
    "MeshGroups",
    "NoSplitModules",
    "NoSync",
    "PlanError",
    "RankDisagreementError",
    "ResetParameters",
    "ShardFirstReset",
    "StreamInit",
    "StateMismatchError",
    "StateSynchronizer",
    "Unit",
    "register_initializer",
    "register_subtree_rule",
    "register_format",
    "register_checkpoint_rules",
    "save_hf_checkpoint",
    "BroadcastFromRank0",
    "DeferredInit",
    "DeterministicInit",
    "FromCheckpoint",
    "FromStateDict",
    "InitFn",
    "InitWeights",
    "VerifyReplicas",
]

_moved.install()
