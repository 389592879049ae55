"""Cross-field rules of the job spec: combinations that cannot run, caught before any process starts."""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardline.errors import SpecError

if TYPE_CHECKING:
    from shardline.spec import JobSpec


def check_combinations(spec: JobSpec) -> None:
    t, a = spec.train, spec.model.arch
    world = spec.world_size
    per_step = world * t.micro_batch_size
    if t.global_batch_size % per_step:
        lower = max(per_step, t.global_batch_size // per_step * per_step)
        raise SpecError(
            "train.global_batch_size",
            f"{t.global_batch_size} is not divisible by world size × micro-batch = "
            f"{world} × {t.micro_batch_size} = {per_step}",
            f"use a multiple of {per_step} (e.g. --set train.global_batch_size={lower}) "
            "or change train.micro_batch_size / parallel.nproc_per_node",
        )
    p = spec.parallel
    shard = p.dp_shard or world // p.dp_replicate
    if p.dp_replicate * shard != world:
        raise SpecError(
            "parallel.dp_replicate", f"dp_replicate × dp_shard = {p.dp_replicate} × {shard} does not equal the "
            f"world size {world} (launch.nnodes × parallel.nproc_per_node)",
            "choose dp_replicate and dp_shard whose product is the world size (e.g. replicate = nodes, "
            "shard = GPUs per node)",
        )
    if spec.model.path is None:
        if a.hidden_size % a.num_heads:
            raise SpecError(
                "model.arch.hidden_size",
                f"{a.hidden_size} is not divisible by model.arch.num_heads={a.num_heads}",
                "pick a hidden size that is a multiple of the head count",
            )
        if a.num_heads % a.num_kv_heads:
            raise SpecError(
                "model.arch.num_kv_heads",
                f"{a.num_kv_heads} does not divide model.arch.num_heads={a.num_heads}",
                "grouped-query attention needs num_heads to be a multiple of num_kv_heads",
            )
        if t.seq_len > a.max_position_embeddings:
            raise SpecError(
                "train.seq_len",
                f"{t.seq_len} exceeds model.arch.max_position_embeddings={a.max_position_embeddings}",
                "lower train.seq_len or raise model.arch.max_position_embeddings",
            )
    if t.warmup_steps >= t.max_steps:
        raise SpecError(
            "train.warmup_steps",
            f"{t.warmup_steps} is not below train.max_steps={t.max_steps}",
            "use fewer warmup steps than total steps, or leave train.warmup_steps unset (5% of max_steps)",
        )
    if spec.data.prompt_format == "chat" and spec.model.path is None and spec.model.tokenizer is None:
        raise SpecError(
            "data.prompt_format",
            "'chat' needs a tokenizer with a chat template, but no model.path or model.tokenizer is set",
            "use data.prompt_format=plain with the trained tokenizer, or point model.tokenizer at one",
        )
    # Installed packages (flash-attn, trackers) are checked where training starts: shardline/environment.py.
    w = spec.observe.wandb_project
    if w is not None and not w.strip():
        raise SpecError("observe.wandb_project", "is empty", "name a W&B project, or use null to turn W&B off")
    from shardline.cost import check_cost

    check_cost(spec)
    from shardline.launch.elastic import check_elastic

    check_elastic(spec)
