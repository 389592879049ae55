"""Export a run's committed checkpoint as a consolidated Hugging Face directory (`shardline export`).

Runs in one process without a process group: the model is rebuilt exactly as the Trainer builds it (plain, no FSDP)
and the DCP shards of any world size are read into it with `no_dist=True`. Full fine-tunes give `save_pretrained`
safetensors + tokenizer + generation config; LoRA runs give a peft adapter directory (the base is rebuilt from the
spec, noted in `shardline_base.json`), or with `merge_lora` the merged full model (a QLoRA run's NF4 base
dequantized, then merged). Weights are written in the checkpoint's own dtype unless `dtype` names another
(`export_dtype`): the training's fp32 master weights, cast in place tensor by tensor, would otherwise make an export
of a bf16 base twice its size. An adapter names its base (`base_model_name_or_path`: `model.path`) with the module
paths of the model `from_pretrained` builds from it — a multimodal Gemma 3, whose language model alone trained, keeps
it under `model.language_model.` — and export proves on a meta-device copy of that base that peft loads every adapter
weight into a module and leaves none of its LoRA modules without one. The result is built in a temporary sibling
directory and renamed into place, so `out` is either complete or absent.

A mixture of experts is written in its input checkpoint's layout: one tensor per expert and projection as the hub
keeps them (transformers' `save_pretrained` reverts its fused experts), or fused where `model.path` stored them
fused (`input_layout_is_fused`). Router biases (`train.router_bias_update_rate`) have no slot in these families'
transformers routers: the export leaves them out, and says so when the checkpoint's are not zero
(`router_bias_warning`), on the console and in `shardline_export.json`'s `warnings`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from peft import LoraConfig, get_peft_model
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerBase

from shardline.checkpointing.manager import CheckpointStore, checkpoint_spec, step_name
from shardline.checkpointing.storage import WeightsOnlyLoadPlanner
from shardline.data.prepare import prepare
from shardline.data.tokenizer import load_tokenizer, pad_id, special_ids
from shardline.errors import ShardlineError
from shardline.model.build import build_model, causal_lm
from shardline.model.expert_layout import stores_fused_experts
from shardline.model.expert_lora import (
    expert_target_parameters,
    has_expert_adapters,
    merge_expert_adapters,
    peft_expert_weights,
)
from shardline.model.lora import apply_lora, quantize_frozen_base
from shardline.model.moe import EXPERT_WEIGHTS
from shardline.model.nf4 import dequantize_base
from shardline.model.router_lora import (
    adapted_routers,
    merge_router_adapters,
    peft_router_weights,
    router_target_parameters,
)
from shardline.model.sharded_load import materialize
from shardline.rundir import checkpoint_location, read_manifest
from shardline.spec import JobSpec
from shardline.spec.resolve import load_spec, spec_hash
from shardline.storage import filesystem_for

EXPORT_INFO = "shardline_export.json"
BASE_INFO = "shardline_base.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
"""What peft puts before a module's path in an adapter's weight names."""
EXPORT_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
"""`--dtype` names besides `auto` (the checkpoint's own dtype, `export_dtype`)."""
SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}
"""Floating dtypes as a safetensors header names them."""


def checkpoint_store(spec: JobSpec, run_dir: Path) -> CheckpointStore:
    """Where the Trainer of this run put its checkpoints."""
    location = checkpoint_location(spec, run_dir)
    filesystem_for(location, "checkpoint.dir")  # a missing s3fs/gcsfs is a SpecError naming the field
    return CheckpointStore(location)


def resolve_step(store: CheckpointStore, step: int | None) -> int:
    """`step` if it is committed (default: the latest committed); a ShardlineError otherwise."""
    committed = store.committed()
    if step is None:
        if not committed:
            raise ShardlineError(store.location, "has no committed checkpoint",
                                 "train the run first (`shardline train RUN_DIR` resumes it)")
        return committed[-1]
    if step not in committed:
        state = "is not committed (its save did not finish)" if step in store.steps() else "does not exist"
        choices = ", ".join(map(str, committed)) or "none"
        raise ShardlineError(store.path(step), f"checkpoint of step {step} {state}",
                             f"use --step with a committed step ({choices}) or omit --step for the latest")
    return step


def build_plain(spec: JobSpec, vocab_size: int, ids: dict[str, int], quantized_base: bool = True) -> nn.Module:
    """The model as the Trainer builds it, whole on the CPU (base from model.path or model.init_seed). A QLoRA base
    (`model.lora.quantize_base: nf4`) is quantized as the Trainer does and held dequantized in fp32: the values the
    run computed with; `quantized_base=False` skips that (the original base weights, where only adapters matter)."""
    with torch.random.fork_rng(devices=[]):
        model = build_model(spec.model, vocab_size, ids, device="meta")
        if spec.model.lora.enabled:
            model = apply_lora(model, spec.model.lora)
        if quantized_base:
            quantize_frozen_base(model, spec.model.lora, spec.train.precision)
    materialize(model, spec.model, torch.device("cpu"))
    dequantize_base(model, torch.float32)
    return model


def load_model_entry(model: nn.Module, store: CheckpointStore, step: int, lora: bool) -> None:
    """Read the checkpoint's "model" entry into a plain model, in this process only (no process group)."""
    opts = StateDictOptions(ignore_frozen_params=lora)
    msd = get_model_state_dict(model, options=opts)
    meta = store.reader(step).read_metadata().state_dict_metadata
    saved = {k.removeprefix("model.") for k in meta if k.startswith("model.")}
    if saved != set(msd):
        missing, unexpected = sorted(set(msd) - saved), sorted(saved - set(msd))
        raise ShardlineError(store.path(step), f"checkpoint does not fit the model built from its spec (missing "
                             f"{missing[:3]}, unexpected {unexpected[:3]})",
                             "export with the run's own spec and model.path, unchanged since training")
    state = {"model": msd}
    with warnings.catch_warnings():  # dcp warns on every no_dist load, even when asked for one
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=store.reader(step), planner=WeightsOnlyLoadPlanner(), no_dist=True)
    # With LoRA the base weights are absent on purpose (rebuilt from the spec): not strict.
    set_model_state_dict(model, state["model"], options=StateDictOptions(ignore_frozen_params=lora, strict=not lora))


def stored_dtype(path: str) -> torch.dtype:
    """The floating dtype that holds most of the weights of the Hugging Face checkpoint at `path` (read from the
    safetensors headers only; float32 when it stores none)."""
    from shardline.model.sharded_load import _stored_keys  # the one place that finds a checkpoint's files

    elements: Counter[torch.dtype] = Counter()
    by_file: dict[Path, list[str]] = {}
    for key, file in _stored_keys(path).items():
        by_file.setdefault(file, []).append(key)
    for file, keys in by_file.items():
        with safe_open(file, "pt") as f:
            for key in keys:
                tensor = f.get_slice(key)
                if (dtype := SAFETENSORS_DTYPES.get(tensor.get_dtype())) is not None:
                    elements[dtype] += math.prod(tensor.get_shape())
    return elements.most_common(1)[0][0] if elements else torch.float32


def export_dtype(spec: JobSpec, requested: str, full: bool) -> torch.dtype:
    """The dtype an export writes its weights in. `requested` is a name of EXPORT_DTYPES, or `auto`: the
    checkpoint's own dtype — for full weights (a full fine-tune or merged LoRA) the base's: that of `model.path`'s
    safetensors weights, else (a model built from `model.arch`, or `model.random_init`) the run's compute dtype
    `train.precision` (bf16 -> bfloat16, fp32 -> float32); for a LoRA adapter float32, the dtype its few weights
    trained in."""
    if requested != "auto":
        if requested not in EXPORT_DTYPES:
            raise ShardlineError("--dtype", f"unknown dtype {requested!r}",
                                 f"use one of auto, {', '.join(EXPORT_DTYPES)}")
        return EXPORT_DTYPES[requested]
    if not full:
        return torch.float32
    if spec.model.path is not None and not spec.model.random_init:
        return stored_dtype(spec.model.path)
    # create_run writes the chosen precision into the run's spec; an older spec may still say auto (then fp32)
    return torch.bfloat16 if spec.train.precision == "bf16" else torch.float32


def export_run(run_dir: Path, out: Path, step: int | None = None, merge_lora: bool = False,
               dtype: str = "auto", say: Callable[[str], None] = lambda line: None) -> Path:
    """Write a consolidated Hugging Face directory for a run's committed checkpoint (latest, or `step`), its weights
    in `dtype` (`auto`: the checkpoint's own, see `export_dtype`); `say` gets the warnings a person should see."""
    run_dir, out = Path(run_dir), Path(out)
    if not (run_dir / "spec.yaml").is_file():
        raise ShardlineError(str(run_dir), "is not a run directory (no spec.yaml)",
                             "give a directory created by `shardline train`, e.g. runs/<run_id>")
    run_spec = load_spec(str(run_dir / "spec.yaml"))  # a bad field is a SpecError, not a traceback
    store = checkpoint_store(run_spec, run_dir)
    step = resolve_step(store, step)
    if problems := store.verify(step):
        raise ShardlineError(store.path(step), "is damaged: " + "; ".join(problems[:5]),
                             "export an earlier committed step (--step)")
    spec = checkpoint_spec(store, step) or run_spec
    lora = spec.model.lora.enabled
    if merge_lora and not lora:
        raise ShardlineError("--merge-lora", "the run was trained without LoRA (model.lora.enabled=false)",
                             "drop --merge-lora: the export is already a full model")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ShardlineError(str(out), "exists and is not empty", "choose a new --out directory or remove this one")
    full = not lora or merge_lora
    weights_dtype = export_dtype(spec, dtype, full)
    warning = router_bias_warning(store, step)
    if warning:
        say(f"warning: {warning}")

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        tok, dataset_version = _tokenizer(store, step, spec, run_dir, tmp / "_tokenizer")
        ids = special_ids(tok, pad_id(tok))
        model = build_plain(spec, len(tok), ids, quantized_base=full)  # an adapter alone does not hold the base
        load_model_entry(model, store, step, lora)
        shutil.rmtree(tmp / "_tokenizer", ignore_errors=True)
        if full:
            # Module.to casts parameter by parameter in place: at most one extra tensor at a time, never a second
            # model; save_pretrained then writes config.json's `dtype` from the weights.
            _save_full((_merged(model) if lora else model).to(weights_dtype), ids, tmp,
                       original_format=not input_layout_is_fused(spec))
        else:
            base = _save_adapter(model.to(weights_dtype), spec, len(tok), ids, tmp, out)
            (tmp / BASE_INFO).write_text(json.dumps(_base_info(spec, len(tok), ids, base), indent=2) + "\n")
        tok.save_pretrained(tmp)
        info = {"run_id": spec.run.id, "step": step, "checkpoint": store.path(step), "spec_hash": spec_hash(spec),
                "dataset_version": dataset_version, "lora": lora, "merged": lora and merge_lora,
                "format": "full" if full else "peft_adapter", "dtype": str(weights_dtype).removeprefix("torch."),
                "warnings": [warning] if warning else []}
        (tmp / EXPORT_INFO).write_text(json.dumps(info, indent=2) + "\n")
        tmp.chmod(0o755)  # mkdtemp makes it private
        os.rename(tmp, out)  # atomic; replaces `out` only if it is an empty directory
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def router_bias_warning(store: CheckpointStore, step: int) -> str | None:
    """What an export of the checkpoint of `step` loses when it holds nonzero router biases (the Trainer's
    `train.router_bias` entry, [layers, E]); None when it holds none or only zeros."""
    saved = store.reader(step).read_metadata().state_dict_metadata.get("train.router_bias")
    if saved is None:
        return None
    state = {"train": {"router_bias": torch.zeros(saved.size, dtype=saved.properties.dtype)}}
    with warnings.catch_warnings():  # dcp warns on every no_dist load, even when asked for one
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=store.reader(step), planner=WeightsOnlyLoadPlanner(), no_dist=True)
    bias = state["train"]["router_bias"]
    if not bias.any():
        return None
    layers, experts = bias.shape
    return (f"the checkpoint of step {step} routes with router biases (train.router_bias_update_rate: max |bias| "
            f"{bias.abs().max().item():.4g}, mean |bias| {bias.abs().mean().item():.4g}, over {layers} layers × "
            f"{experts} experts) that the export leaves out: transformers' routers of this family have no bias, so "
            "the exported model sends each token to the plain top-k of its router's probabilities, not to the "
            "experts the run chose; its outputs can differ from the run's (evaluate the export before serving it)")


def _merged(model: nn.Module) -> nn.Module:
    """The LoRA model's base with every adapter folded in: peft's layers, the routed experts' and the routers'."""
    base = model.merge_and_unload() if hasattr(model, "merge_and_unload") else model
    merge_expert_adapters(base)
    merge_router_adapters(base)
    return base


def _tokenizer(store: CheckpointStore, step: int, spec: JobSpec, run_dir: Path,
               scratch: Path) -> tuple[PreTrainedTokenizerBase, str | None]:
    """The training tokenizer and dataset version: saved with the checkpoint, else the prepared data."""
    folder = f"{store.root}/{step_name(step)}/tokenizer"
    meta_version = read_manifest(run_dir).get("dataset_version")
    with contextlib.suppress(FileNotFoundError):
        meta_version = json.loads(store.read_text(step, "meta.json")).get("dataset_version", meta_version)
    try:
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in store.fs.ls(folder, detail=False)]
    except FileNotFoundError:
        names = []
    if names:
        scratch.mkdir(parents=True)
        for name in names:
            (scratch / name).write_text(store.read_text(step, f"tokenizer/{name}"))
        return load_tokenizer(str(scratch)), meta_version
    data = prepare(spec)
    if meta_version not in (None, data.version):
        raise ShardlineError(str(run_dir), f"the run trained on dataset {meta_version}, but its spec prepares "
                             f"{data.version} here (the tokenizer may differ)",
                             "export from the directory the run was started in, with the same data and cache")
    return data.tokenizer(), data.version


def input_layout_is_fused(spec: JobSpec) -> bool:
    """Whether `model.path` stores a mixture of experts' routed experts fused (`mlp.experts.gate_up_proj`), not per
    expert as the hub does."""
    from shardline.model.sharded_load import _stored_keys  # the one place that finds a checkpoint's files

    return (spec.model.path is not None and not spec.model.random_init
            and stores_fused_experts(_stored_keys(spec.model.path)))


def _save_full(model: nn.Module, ids: dict[str, int], out: Path, original_format: bool = True) -> None:
    """`save_pretrained` of the full model; `original_format`: in transformers' original (hub) key layout."""
    model.config.use_cache = True  # training turns the KV cache off; inference wants it
    model.generation_config = GenerationConfig(**ids)
    model.save_pretrained(out, safe_serialization=True, save_original_format=original_format)
    if not (out / "generation_config.json").exists():
        model.generation_config.save_pretrained(out)


def _base_skeleton(spec: JobSpec, vocab_size: int, ids: dict[str, int]) -> nn.Module:
    """The base an adapter of this run loads onto, on the meta device: what `AutoModelForCausalLM.from_pretrained
    (model.path)` builds (the whole multimodal model for a multimodal Gemma 3), else the random-init model."""
    if spec.model.path is None:
        return build_model(spec.model, vocab_size, ids, device="meta")
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(spec.model.path), dtype=torch.float32)


def _save_adapter(model: nn.Module, spec: JobSpec, vocab_size: int, ids: dict[str, int], out: Path,
                  where: Path) -> nn.Module:
    """peft's adapter of the trained model in `out`, its modules renamed to their paths in the base it names,
    checked to load there whole (else an error about `where`, the export's destination); returns that base (meta)."""
    base = _base_skeleton(spec, vocab_size, ids)
    if not hasattr(model, "peft_config"):  # LoRA on the routed experts alone: no peft layer trained
        LoraConfig(r=spec.model.lora.r, lora_alpha=spec.model.lora.alpha, target_modules=[], task_type="CAUSAL_LM",
                   base_model_name_or_path=spec.model.path).save_pretrained(out)
        save_file({}, out / ADAPTER_WEIGHTS, metadata={"format": "pt"})
        rename = None
    else:
        rename = _module_renamer(causal_lm(model), base)
        # peft takes the name from the model's config; a multimodal checkpoint's text config carries none
        model.peft_config["default"].base_model_name_or_path = spec.model.path
        model.save_pretrained(out, safe_serialization=True)
    if has_expert_adapters(causal_lm(model)) or adapted_routers(causal_lm(model)):
        _add_parameter_adapters(causal_lm(model), spec, vocab_size, ids, out)
    if rename is not None:
        config = LoraConfig.from_pretrained(out)
        # Exact module paths: the attention names alone would also match the vision tower's q/k/v projections.
        config.target_modules = sorted(rename(name) for name in model.targeted_module_names)
        config.save_pretrained(out)
        weights = load_file(out / ADAPTER_WEIGHTS)
        save_file({PEFT_PREFIX + rename(k.removeprefix(PEFT_PREFIX)): v for k, v in weights.items()},
                  out / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    _check_adapter_loads(base, spec, out, where)
    return base


def _add_parameter_adapters(trained: nn.Module, spec: JobSpec, vocab_size: int, ids: dict[str, int],
                            out: Path) -> None:
    """Add the routed experts' adapters (`shardline.model.expert_lora`) and the routers' (`.router_lora`) to the
    adapter in `out` as peft writes them: `target_parameters` naming both fused projections and the routers' weight,
    the weights in peft's layout under the keys of its `ParamWrapper`s (found on a meta-device base with that
    config), in place of the tensors peft's own save picked up by their `lora_` names."""
    config = LoraConfig.from_pretrained(out)
    config.target_parameters = ((expert_target_parameters(trained) if has_expert_adapters(trained) else [])
                                + router_target_parameters(trained))
    config.save_pretrained(out)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        probe = get_peft_model(_base_skeleton(spec, vocab_size, ids), config, low_cpu_mem_usage=True)
    ours = (*EXPERT_WEIGHTS, ".lora_A", ".lora_B")  # per-expert adapters, a router's
    weights = {k: v for k, v in load_file(out / ADAPTER_WEIGHTS).items() if not k.endswith(ours)}
    weights.update(peft_expert_weights(trained, probe))
    weights.update(peft_router_weights(trained, probe))
    save_file({k: v.contiguous() for k, v in weights.items()}, out / ADAPTER_WEIGHTS, metadata={"format": "pt"})


def _module_renamer(trained: nn.Module, base: nn.Module) -> Callable[[str], str] | None:
    """Module path in the trained causal LM -> path in `base`, when base holds the trained decoder deeper (a
    multimodal Gemma 3's `model.language_model` for the text model's `model`); None when the paths agree."""
    ours, theirs = _path_of(trained, trained.get_decoder()), _path_of(base, base.get_decoder())
    if ours == theirs:
        return None
    return lambda name: theirs + name[len(ours):] if name == ours or name.startswith(ours + ".") else name


def _path_of(model: nn.Module, module: nn.Module) -> str:
    return next(name for name, m in model.named_modules() if m is module)


def _check_adapter_loads(base: nn.Module, spec: JobSpec, out: Path, where: Path) -> None:
    """Load the adapter as `PeftModel.from_pretrained` does, onto the meta base: peft only warns when weights match
    no module (and then applies nothing); here any unmatched weight or weightless LoRA module is an error."""
    config = LoraConfig.from_pretrained(out)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft's own warning about the keys, reported below instead
        peft_model = get_peft_model(base, config, low_cpu_mem_usage=True)
        result = peft_model.load_adapter(str(out), "default", low_cpu_mem_usage=True)
    missing = sorted(k for k in result.missing_keys if "lora_" in k)
    if missing or result.unexpected_keys:
        raise ShardlineError(str(where), f"the adapter does not load onto {type(base).__name__} of "
                             f"{spec.model.path or 'model.init_seed'}: {len(result.unexpected_keys)} weights match "
                             f"no module (e.g. {sorted(result.unexpected_keys)[:2]}), {len(missing)} LoRA weights "
                             f"would stay untrained (e.g. {missing[:2]})",
                             "export with --merge-lora (a full model, no module names to match) and report this "
                             "model's layout as a shardline bug")


def _base_info(spec: JobSpec, vocab_size: int, ids: dict[str, int], base: nn.Module) -> dict:
    m = spec.model
    if m.path is not None:
        how = f"AutoModelForCausalLM.from_pretrained({m.path!r}, dtype=torch.float32) (a {type(base).__name__})"
    else:
        how = (f"random init from spec arch with init_seed {m.init_seed}: shardline.model.build.build_model("
               "ModelSpec(**model_spec), vocab_size, special_ids) with the values in this file")
    return {"model_path": m.path, "init_seed": None if m.path else m.init_seed, "how": how,
            "class": type(base).__name__, "vocab_size": vocab_size, "special_ids": ids,
            "model_spec": m.model_dump(mode="json")}
