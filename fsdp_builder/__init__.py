"""fsdp_builder: PyTorch FSDP initialization as a fluent builder with pluggable strategies."""

from fsdp_builder.builder import BuilderConfig, FSDPBuilder, FullyShardBuilder, ShardingBuilder
from fsdp_builder.config import ShardingOptions
from fsdp_builder.devices import (
    BaseDeviceResolver,
    CPUDevice,
    DeviceResolver,
    ExplicitDevice,
    InferredDevice,
    LocalRankDevice,
)
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
    DefaultGroups,
    GivenGroup,
    GroupFactory,
    HybridGroups,
    MeshGroups,
    ProcessGroups,
)
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
from fsdp_builder.planning.ignored import IgnoredStates, resolve_ignored
from fsdp_builder.planning.plan import Unit, UnitPlan, plan_units
from fsdp_builder.planning.wrap import NoSplitModules, WrapPolicy
from fsdp_builder.runtime.environment import Environment
from fsdp_builder.runtime.report import BuildReport, StageRecord
from fsdp_builder.sources import (
    CheckpointSource,
    MergeExperts,
    Rename,
    TensorMeta,
    register_checkpoint_rules,
    register_format,
)
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
    "BuildReport",
    "BuilderConfig",
    "CPUDevice",
    "Chain",
    "CheckpointSource",
    "CommunicationError",
    "ConfigurationError",
    "ExportError",
    "DefaultGroups",
    "DeviceResolver",
    "Environment",
    "ExplicitDevice",
    "FSDPBuilder",
    "FSDPBuilderError",
    "FullyShardBuilder",
    "GivenGroup",
    "GroupFactory",
    "HybridGroups",
    "IgnoredStates",
    "InferredDevice",
    "KeepAsIs",
    "LocalRankDevice",
    "MaterializationError",
    "Materializer",
    "MeshGroups",
    "NoSplitModules",
    "NoSync",
    "PlanError",
    "ProcessGroups",
    "RankDisagreementError",
    "ResetParameters",
    "ShardFirstReset",
    "StreamInit",
    "ShardingBuilder",
    "ShardingOptions",
    "StageRecord",
    "StateMismatchError",
    "StateSynchronizer",
    "TensorMeta",
    "Unit",
    "UnitPlan",
    "WrapPolicy",
    "plan_units",
    "register_initializer",
    "register_subtree_rule",
    "register_format",
    "register_checkpoint_rules",
    "Rename",
    "MergeExperts",
    "resolve_ignored",
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
