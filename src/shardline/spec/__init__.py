"""The job spec (docs/architecture.md §3): sections, rules, resolution and the resume policy."""

from shardline.spec.job import JobSpec
from shardline.spec.sections import (
    ActivationCheckpointing,
    ArchSpec,
    AttentionImpl,
    CheckpointSpec,
    CollectiveOp,
    ColumnsSpec,
    CostSpec,
    DataFormat,
    DataSpec,
    GpucheckSpec,
    JobSections,
    KubernetesSpec,
    LaunchSpec,
    LoraSpec,
    ModelSpec,
    NetcheckSpec,
    ObserveSpec,
    ParallelSpec,
    Precision,
    PromptFormat,
    Provisioning,
    RaySpec,
    RunSpec,
    SecretRef,
    SlurmSpec,
    StorageSpec,
    TaskName,
    Toleration,
    TpuSpec,
    TrainSpec,
)

__all__ = [
    "ActivationCheckpointing", "ArchSpec", "AttentionImpl", "CheckpointSpec", "CollectiveOp", "ColumnsSpec",
    "CostSpec", "DataFormat", "DataSpec", "GpucheckSpec", "JobSections", "JobSpec", "KubernetesSpec", "LaunchSpec",
    "LoraSpec",
    "ModelSpec", "NetcheckSpec", "ObserveSpec", "ParallelSpec", "Precision", "PromptFormat", "Provisioning",
    "RaySpec", "RunSpec", "SecretRef", "SlurmSpec", "StorageSpec", "TaskName", "Toleration", "TpuSpec", "TrainSpec",
]
