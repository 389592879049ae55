"""The job spec (docs/architecture.md §3): sections, rules, resolution and the resume policy."""

from shardline.spec.sections import (
    ActivationCheckpointing,
    ArchSpec,
    AttentionImpl,
    CheckpointSpec,
    CollectiveOp,
    ColumnsSpec,
    CostSpec,
    DataSpec,
    GpucheckSpec,
    JobSpec,
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
    TrainSpec,
)

__all__ = [
    "ActivationCheckpointing", "ArchSpec", "AttentionImpl", "CheckpointSpec", "CollectiveOp", "ColumnsSpec",
    "CostSpec", "DataSpec", "GpucheckSpec", "JobSpec", "KubernetesSpec", "LaunchSpec", "LoraSpec", "ModelSpec",
    "NetcheckSpec", "ObserveSpec", "ParallelSpec", "Precision", "PromptFormat", "Provisioning", "RaySpec",
    "RunSpec", "SecretRef", "SlurmSpec", "StorageSpec", "TaskName", "Toleration", "TrainSpec",
]
