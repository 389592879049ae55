"""The spec as a MaxText run: MaxText's own config overrides (`key=value` after its trainer module) and the one
command every TPU host runs. shardline never trains on TPU; MaxText (JAX) does, as torchrun does on GPUs.

Every key emitted here exists in MaxText's `configs/base.yml` (tests/launch/test_maxtext.py reads it from the
released wheel). A spec field MaxText cannot honour is a `SpecError` naming it, never dropped:
- LoRA, host offload, checkpointing every k-th block, time-based checkpoints, `keep_every`: MaxText has no such knob
  in pre-training;
- shardline's generated text-to-SQL set and its SQL evaluation: MaxText reads a Hugging Face dataset;
- the plain prompt template: MaxText's supervised fine-tuning (`use_sft`) renders the tokenizer's chat template;
- a checkpoint outside GCS: `base_output_directory` must be gs:// (every host of every slice writes there);
- Hugging Face weights: MaxText trains from an Orbax checkpoint converted once (launch.tpu.load_parameters_path).
"""

from __future__ import annotations

import json

from shardline.errors import SpecError
from shardline.hardware import tpu_slice
from shardline.spec import JobSpec

TRAINER_MODULE = "maxtext.trainers.pre_train.train"
"""MaxText ≥ 0.2's pre-training entry point; with no config file named it loads configs/base.yml
(maxtext/configs/pyconfig.py, the module → config table)."""

MODEL_NAMES = {
    "meta-llama/llama-3.1-8b": "llama3.1-8b", "meta-llama/llama-3.1-8b-instruct": "llama3.1-8b",
    "meta-llama/llama-3.1-70b": "llama3.1-70b", "meta-llama/llama-3.1-70b-instruct": "llama3.1-70b",
    "meta-llama/llama-3.1-405b": "llama3.1-405b", "meta-llama/llama-3.1-405b-instruct": "llama3.1-405b",
    "meta-llama/llama-3.3-70b-instruct": "llama3.3-70b",
    "meta-llama/meta-llama-3-8b": "llama3-8b", "meta-llama/meta-llama-3-8b-instruct": "llama3-8b",
    "meta-llama/meta-llama-3-70b": "llama3-70b", "meta-llama/meta-llama-3-70b-instruct": "llama3-70b",
}
"""Hub model → MaxText's model config (configs/models/<name>.yml). Instruct and base share the architecture; which
weights train comes from launch.tpu.load_parameters_path."""

REMAT_POLICIES = {"none": "minimal", "selective": "save_dot_except_mlp", "full": "full"}
"""parallel.activation_checkpointing → MaxText remat_policy: `minimal` saves the most MaxText can (it has no
"save everything"), `save_dot_except_mlp` keeps the attention matmul outputs and recomputes the MLP, `full`
recomputes each layer from its input."""

ATTENTION = {"flash_attention_2": "flash", "sdpa": "autoselected", "eager": "dot_product"}
"""model.attn_implementation → MaxText `attention`: `flash` is the Pallas splash-attention kernel on TPU."""

SFT_COLUMNS = (("prompt", "completion"), ("question", "answer"))
"""The column pairs MaxText's SFT pipeline accepts (input_pipeline/data_processing_utils.py
validate_and_configure_sft_columns; it also takes a single `messages` column)."""


def _refuse(field: str, problem: str, fix: str) -> None:
    raise SpecError(field, problem, fix)


def check_maxtext(spec: JobSpec) -> None:
    """Every spec field MaxText cannot honour, as a named error (module docstring)."""
    m, d, p, c = spec.model, spec.data, spec.parallel, spec.checkpoint
    if spec.train.engine != "maxtext":
        _refuse("train.engine", f"is {spec.train.engine}, not maxtext", "set train.engine=maxtext for a TPU run")
    if m.lora.enabled:
        _refuse("model.lora.enabled", "MaxText pre-training has no LoRA", "train all weights (lora.enabled=false) "
                "or use train.engine=torch on GPUs")
    if m.path is not None:
        if m.path.lower() not in MODEL_NAMES:
            _refuse("model.path", f"{m.path!r} has no MaxText model config here", "use one of "
                    f"{', '.join(sorted(MODEL_NAMES))}, or leave model.path unset and describe model.arch")
        if spec.launch.tpu.load_parameters_path is None:
            _refuse("launch.tpu.load_parameters_path", f"is unset, so MaxText would train {m.path} from random "
                    "weights (it does not read Hugging Face safetensors in training)",
                    "convert the weights once (python -m maxtext.checkpoint_conversion.to_maxtext) and set "
                    "launch.tpu.load_parameters_path=gs://…/0/items")
    elif m.tokenizer is None:
        _refuse("model.tokenizer", "is unset and model.path is unset: shardline would train a tokenizer, MaxText "
                "cannot", "point model.tokenizer at a Hugging Face tokenizer (hub name or gs:// directory)")
    if d.path is None:
        _refuse("data.path", "is unset: shardline's generated text-to-SQL set is not a dataset MaxText can read",
                "set data.path to a Hugging Face hub dataset")
    if d.task != "none":
        _refuse("data.task", f"is {d.task}, whose evaluation runs in shardline's worker, not in MaxText",
                "set data.task=none (MaxText reports its own loss)")
    if d.prompt_format == "plain":
        _refuse("data.prompt_format", "is plain, but MaxText's fine-tuning renders the tokenizer's chat template",
                "set data.prompt_format=chat (or auto)")
    if (d.columns.question, d.columns.answer) not in SFT_COLUMNS:
        _refuse("data.columns", f"question/answer are {d.columns.question}/{d.columns.answer}, but MaxText reads "
                "only the column pairs prompt/completion or question/answer", "use a dataset with those columns "
                "(MaxText cannot rename them)")
    if p.offload:
        _refuse("parallel.offload", "is shardline's FSDP2 CPU offload", "set parallel.offload=false")
    if p.activation_checkpointing_every != 1:
        _refuse("parallel.activation_checkpointing_every", "MaxText applies its remat policy to every layer",
                "set parallel.activation_checkpointing_every=1")
    tp = spec.launch.tpu
    if p.dp_shard is not None or p.dp_replicate not in (1, tp.slices):
        _refuse("parallel.dp_replicate", f"dp_replicate={p.dp_replicate}, dp_shard={p.dp_shard}: on TPU the "
                "replicas are slices or nothing", f"set parallel.dp_replicate={tp.slices} (data parallel across "
                "slices, FSDP inside each) or 1 (FSDP across every chip), and leave dp_shard unset")
    if c.every_minutes is not None:
        _refuse("checkpoint.every_minutes", "MaxText checkpoints by step only", "use checkpoint.every_steps")
    if c.keep_every is not None:
        _refuse("checkpoint.keep_every", "MaxText keeps the last N checkpoints only", "unset checkpoint.keep_every")
    if not (c.dir or "").startswith("gs://"):
        _refuse("checkpoint.dir", f"is {c.dir!r}; every host of every slice writes MaxText's checkpoints and logs "
                "to one base_output_directory", "set checkpoint.dir=gs://<bucket>/<prefix>")


def _model_overrides(spec: JobSpec) -> dict[str, object]:
    m = spec.model
    if m.path is not None:
        return {"model_name": MODEL_NAMES[m.path.lower()], "tokenizer_path": m.tokenizer or m.path,
                "load_parameters_path": spec.launch.tpu.load_parameters_path}
    a = m.arch
    return {"base_emb_dim": a.hidden_size, "base_num_query_heads": a.num_heads, "base_num_kv_heads": a.num_kv_heads,
            "base_num_decoder_layers": a.num_layers, "base_mlp_dim": a.intermediate_size,
            "head_dim": a.hidden_size // a.num_heads, "vocab_size": a.vocab_size, "rope_max_timescale": a.rope_theta,
            "logits_via_embedding": a.tie_embeddings, "decoder_block": "llama2",
            "mlp_activations": ["silu", "linear"], "tokenizer_path": m.tokenizer}


def parallelism(spec: JobSpec) -> dict[str, int]:
    """The mesh: FSDP × TP inside a slice (ICI), data or FSDP across slices (DCN) as parallel.dp_replicate says."""
    tp = spec.launch.tpu
    chips = tpu_slice(tp.type, tp.topology).chips
    across_slices_data = spec.parallel.dp_replicate == tp.slices
    return {"ici_fsdp_parallelism": chips // tp.tensor_parallelism, "ici_tensor_parallelism": tp.tensor_parallelism,
            "dcn_data_parallelism": tp.slices if across_slices_data else 1,
            "dcn_fsdp_parallelism": 1 if across_slices_data else tp.slices}


def maxtext_overrides(spec: JobSpec) -> dict[str, object]:
    """The spec as MaxText config keys (base.yml names), in a stable order."""
    check_maxtext(spec)
    t, d, c = spec.train, spec.data, spec.checkpoint
    return {
        "run_name": spec.run.id or spec.run.name, "base_output_directory": c.dir,
        **_model_overrides(spec), "tokenizer_type": "huggingface",
        "dataset_type": "hf", "hf_path": d.path, "train_split": "train",
        "train_data_columns": [d.columns.question, d.columns.answer],
        "use_sft": True, "sft_train_on_completion_only": True, "packing": d.packing,
        "steps": t.max_steps, "per_device_batch_size": t.micro_batch_size,
        "gradient_accumulation_steps": t.global_batch_size // (spec.world_size * t.micro_batch_size),
        "max_target_length": t.seq_len,
        "learning_rate": t.lr, "lr_schedule_type": "cosine", "learning_rate_final_fraction": t.min_lr_ratio,
        "warmup_steps_fraction": round((t.warmup_steps or 0) / t.max_steps, 6), "adam_weight_decay": t.weight_decay,
        "gradient_clipping_threshold": t.max_grad_norm or 0.0,  # 0 turns MaxText's clipping off
        "dtype": "float32" if t.precision == "fp32" else "bfloat16",  # auto: bf16 on TPU "weight_dtype": "float32",
        "data_shuffle_seed": t.seed, "init_weights_seed": spec.model.init_seed,
        "enable_checkpointing": True, "checkpoint_period": c.every_steps or t.max_steps,
        "async_checkpointing": c.async_save is not False, "max_num_checkpoints_to_keep": c.keep_last,
        **parallelism(spec),
        "remat_policy": REMAT_POLICIES[spec.parallel.activation_checkpointing],
        "attention": ATTENTION[spec.model.attn_implementation],
        "log_period": t.log_every,
    }


def _arg(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def maxtext_command(spec: JobSpec) -> list[str]:
    """`python3 -m maxtext.trainers.pre_train.train key=value …`: an argv list, never shell text."""
    return ["python3", "-m", TRAINER_MODULE, *(f"{k}={_arg(v)}" for k, v in maxtext_overrides(spec).items())]
