"""Memory planner: per-device bytes of a training job from its spec, without building the model.

Symbols: P parameters (P_t trainable), S = parallel.dp_shard (FSDP shards; HSDP replicas hold copies),
t = parallel.tp (each block's projections, attention heads and MLP columns ÷ t per rank: `tensor_parallel_shape`;
norms and block inputs on N/t tokens (sequence parallel), an untied head's vocabulary ÷ t (loss parallel; its
logits and cross-entropy still counted whole: see `_loss_bytes`'s caller); embeddings and the projections'
gathered inputs whole),
cp = parallel.cp (a rank's N/cp tokens of each row; FSDP over S·cp; attention keeps the gathered keys and
values of the other (cp−1)/cp of the row), c = compute bytes (2 bf16, 4 fp32), N = micro_batch_size × seq_len
tokens (÷ cp), L layers, d hidden,
I intermediate, q = heads × head_dim, kv = kv_heads × head_dim, V vocab.

- parameters (4P_t + c(P − P_t))/S (fp32 master shards of what trains, a frozen LoRA base in c), gradients
  4P_t/S (fp32, sharded), AdamW 8P_t/S (two fp32 moments); a QLoRA base (`model.lora.quantize_base: nf4`) holds
  its block projections as NF4 instead, whole on every rank: 0.5 + 1/64 + c/16384 bytes per parameter
  (`shardline.model.nf4.nf4_bytes`), and FSDP gathers only the rest of a block; dequantizing one of them for a
  matmul adds (8 + 3c) bytes per element of the largest to the temporaries while backward runs.
  `train.float8` (`shardline.model.float8`): the same fp32 masters, gradients and moments (the weights stay fp32
  and bf16; float8 copies exist only around each matmul); the largest float8 linear's casts (input, weight, output
  gradient and their transposes, 1 byte each: `float8_cast_bytes`) join the temporaries; with tensorwise scaling on
  CUDA, FSDP2 gathers those weights in float8, 1 byte instead of c.
  with `parallel.offload` all three live in host memory instead.
- gather buffers: FSDP's unsharded compute-dtype copies - the root (embeddings, norm, lm_head; kept from
  forward through backward) + two blocks (current and prefetched): c·(P_root + 2·P_block).
- activations: bytes saved for backward per token and block (`block_saved_bytes`), counted from the HF
  Llama code path (RMSNorm upcasts to fp32, SDPA saves q, k, v, output and logsumexp - no T² term - but
  the packed-sequence mask B×T×T in c per block; GQA heads are repeated when a mask is used; a frozen
  linear does not save its input). AC `full` keeps only block inputs (c·d), `selective` the matmul and
  attention outputs; a checkpointed block is recomputed once in backward (+1 block). Every k-th block
  only with `activation_checkpointing_every`. A compiled block (`parallel.compile`) keeps each RMSNorm's input in
  c, not fp32, and not act(gate): inductor recomputes them in backward.
- logits and loss: 12·N·V (fp32 log-softmax output, its gradient and the logits gradient); with
  `train.loss_chunk_tokens` = k the same for one chunk, 12·min(N, k)·V, plus the loss-bearing hidden states
  the chunks read and their gradient, 2·c·N·d.
- temporaries: the unsharded lm_head gradient c·V·d (held through backward), block backward
  intermediates, the root's fp32 reduce-scatter buffer, AdamW's foreach temporaries (CPU, unfused).
The peak is the largest of five moments: start of backward, first block reduce-scatter, end of backward,
root reduce-scatter, optimizer step. Fixed runtime memory and CPU allocator retention: `plan.devices`; a CPU
run's measured runtime and the steady-state growth of its kernel caches: `plan.cpu_runtime`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from shardline.errors import SpecError
from shardline.hardware import FLOAT8_DIM_MULTIPLE, match_device
from shardline.model.families import (
    BY_MODEL_TYPE,
    EXPERTS_TARGET,
    LLAMA,
    MULTIMODAL_LANGUAGE_MODELS,
    ROUTER_TARGET,
    Family,
    family_of,
    language_model_config,
    layer_windows,
)
from shardline.model.nf4_layout import nf4_bytes, nf4_quantizable
from shardline.planning import moe
from shardline.planning.cpu_runtime import steady_growth_bytes
from shardline.planning.devices import (
    CPU_RETAINED_BLOCKS_PLAIN,
    CPU_RETAINED_BLOCKS_RECOMPUTE,
    CPU_RETAINED_TRANSIENT,
    Device,
    GiB,
    current_device,
    get_device,
    planned_precision,
)
from shardline.planning.moe import Experts
from shardline.spec import JobSpec, LoraSpec, ModelSpec, TrainSpec
from shardline.spec.objective import frozen_reference_copy

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tie: bool = False
    head_dim: int | None = None
    family: Family = LLAMA
    windows: tuple[int | None, ...] = ()
    """Each layer's sliding window (None: global); empty: every layer global."""
    moe: Experts | None = None
    """A mixture of experts' routed experts (`planning.moe`; every layer a MoE layer, `intermediate` the expert's);
    None: a dense MLP."""
    tp: int = 1
    """The tensor-parallel degree this shape is one rank of (`tensor_parallel_shape`): the norms run on 1/tp of
    the tokens (sequence parallel) and an untied head holds 1/tp of the vocabulary (loss parallel)."""

    @property
    def head_vocab(self) -> int:
        """Vocabulary rows of the output projection this rank holds and computes logits for."""
        return self.vocab if self.tie else self.vocab // self.tp

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def norms_per_block(self) -> int:
        """RMSNorms over the hidden size in one block: 2, or 4 with Gemma's norms after attention and MLP."""
        return 4 if self.family.sandwich_norms else 2


# Hub models the planner knows offline (config.json values; Instruct variants share the base shape).
KNOWN_MODELS: dict[str, ModelShape] = {
    "meta-llama/llama-3.1-8b": ModelShape(4096, 14336, 32, 32, 8, 128256),
    "meta-llama/llama-3.1-70b": ModelShape(8192, 28672, 80, 64, 8, 128256),
    "meta-llama/llama-3.1-405b": ModelShape(16384, 53248, 126, 128, 8, 128256),
    "qwen/qwen3-8b": ModelShape(4096, 12288, 36, 32, 8, 151936, head_dim=128, family=BY_MODEL_TYPE["qwen3"]),
    "mistralai/mistral-7b-v0.3": ModelShape(4096, 14336, 32, 32, 8, 32768, head_dim=128,
                                            family=BY_MODEL_TYPE["mistral"]),  # v0.3: no sliding window
    # Gemma 3 12B's language model (the checkpoint's `text_config`): 5 local layers (window 1024) per global one
    "google/gemma-3-12b": ModelShape(3840, 4 * 3840, 48, 16, 8, 262208, tie=True, head_dim=256,
                                     family=BY_MODEL_TYPE["gemma3_text"],
                                     windows=tuple(None if (i + 1) % 6 == 0 else 1024 for i in range(48))),
    # a mixture of experts: 128 experts of 768 per layer, 8 per token (3.3B of its 30.5B parameters active)
    "qwen/qwen3-30b-a3b": ModelShape(2048, 768, 48, 32, 4, 151936, head_dim=128, family=BY_MODEL_TYPE["qwen3_moe"],
                                     moe=Experts(128, 8, 768)),
}


def _from_config(cfg: dict) -> ModelShape:
    family = family_of(cfg)
    experts = moe.experts_of(cfg) if family.experts else None
    heads = cfg["num_attention_heads"]
    return ModelShape(cfg["hidden_size"], experts.intermediate if experts else cfg["intermediate_size"],
                      cfg["num_hidden_layers"], heads, cfg.get("num_key_value_heads") or heads, cfg["vocab_size"],
                      bool(cfg.get("tie_word_embeddings", False)), cfg.get("head_dim"), family, layer_windows(cfg),
                      experts)


def model_shape(spec: ModelSpec) -> ModelShape:
    """Shape from `model.arch`, a local `config.json`, or the table of known hub models."""
    if spec.path is None:
        a = spec.arch
        return ModelShape(a.hidden_size, a.intermediate_size, a.num_layers, a.num_heads, a.num_kv_heads,
                          a.vocab_size, a.tie_embeddings)
    config = Path(spec.path).expanduser() / "config.json"
    if config.is_file():
        try:
            raw = json.loads(config.read_text())
            if raw.get("model_type") in MULTIMODAL_LANGUAGE_MODELS:  # its text_config lists only non-defaults
                from transformers import AutoConfig

                raw = language_model_config(AutoConfig.from_pretrained(config.parent)).to_dict()
            return _from_config(raw)
        except (KeyError, ValueError) as e:
            raise SpecError("model.path", f"{config} lacks a decoder field ({e})",
                            "point at a decoder-only causal LM checkpoint") from e
    name = spec.path.lower().removesuffix("-instruct").removesuffix("-it").removesuffix("-pt")
    name = name.replace("meta-llama-3.1", "llama-3.1").replace("-instruct-", "-")
    if name in KNOWN_MODELS:
        return KNOWN_MODELS[name]
    try:  # a hub name already in the local Hugging Face cache
        from transformers import AutoConfig

        return _from_config(AutoConfig.from_pretrained(spec.path, local_files_only=True).to_dict())
    except (OSError, ValueError, KeyError):
        pass
    raise SpecError("model.path", f"{spec.path!r} is neither a local directory with config.json nor a model "
                    "the planner knows offline", f"download it, or use one of {', '.join(KNOWN_MODELS)}")


def shape_config(s: ModelShape) -> PretrainedConfig:
    """A transformers config of the shape's family (the model a hub name stands for, offline)."""
    from transformers import AutoConfig

    window = max((w for w in s.windows if w), default=None)
    windows = {"sliding_window": window} if window else {}
    if window and s.family.model_types[0] not in ("mistral", "phi3"):  # they window every layer
        windows["layer_types"] = ["sliding_attention" if w else "full_attention" for w in s.windows]
    model_type = s.family.model_types[0] if s.family.tested else "llama"
    experts = moe.config_fields(s.moe, AutoConfig.for_model(model_type)) if s.moe else {}
    fields = dict(vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate,
                  num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                  head_dim=s.hd, tie_word_embeddings=s.tie, use_cache=False)
    return AutoConfig.for_model(model_type, **(fields | windows | experts))


LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def tensor_parallel_shape(s: ModelShape, tp: int) -> ModelShape:
    """What one rank of a `tp`-way tensor-parallel group holds: its heads, kv-heads and MLP columns (the
    projections split column- then row-wise), 1/tp of the tokens between them (sequence parallel: norms, block
    inputs), 1/tp of an untied head's vocabulary (loss parallel); embeddings whole, and the projections' inputs
    gathered whole."""
    if tp == 1:
        return s
    if s.moe:
        raise SpecError("parallel.tp", f"{s.family.name} is a mixture of experts: the tensor-parallel plan splits "
                        "dense MLPs and does not know the fused experts",
                        "set parallel.tp=1 for this model (parallel.ep splits the experts)")
    if s.heads % tp or s.kv_heads % tp or s.intermediate % tp:
        raise SpecError("parallel.tp", f"{tp} does not divide the model's heads ({s.heads}), kv-heads "
                        f"({s.kv_heads}) and intermediate size ({s.intermediate})",
                        "choose a tp that divides all three")
    return replace(s, heads=s.heads // tp, kv_heads=s.kv_heads // tp, intermediate=s.intermediate // tp,
                   head_dim=s.hd, tp=tp)


def layout_name(dp_replicate: int, dp_shard: int, tp: int, cp: int = 1, ep: int = 1) -> str:
    """How `plan` and the dry run name a parallel layout: `FSDP ×8`, `HSDP 2×8`, `FSDP ×4 × TP 8`, `FSDP ×4 × CP 2`,
    `FSDP ×8 (EP 8 × efsdp 1)` (expert parallel borrows its ranks from the shards)."""
    data = f"HSDP {dp_replicate}×{dp_shard}" if dp_replicate > 1 else f"FSDP ×{dp_shard}"
    data += f" (EP {ep} × efsdp {dp_shard // ep})" if ep > 1 else ""
    return data + (f" × CP {cp}" if cp > 1 else "") + (f" × TP {tp}" if tp > 1 else "")


def block_linears(s: ModelShape) -> tuple[str, ...]:
    """A block's linear projections; a mixture of experts' MLP is its own (`planning.moe`)."""
    return LINEARS[:4] if s.moe else FUSED_LINEARS if s.family.fused else LINEARS


def linear_dims(s: ModelShape) -> dict[str, tuple[int, int]]:
    """(in, out) features of each projection of a block (fused where the family fuses them), and of the head."""
    d, q, kv, i = s.hidden, s.heads * s.hd, s.kv_heads * s.hd, s.intermediate
    if s.moe:  # the router and the fused experts are no linears (a LoRA target among them is refused)
        return {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d), "lm_head": (d, s.vocab)}
    if s.family.fused:
        return {"qkv_proj": (d, q + 2 * kv), "o_proj": (q, d), "gate_up_proj": (d, 2 * i), "down_proj": (i, d),
                "lm_head": (d, s.vocab)}
    return {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d),
            "gate_proj": (d, i), "up_proj": (d, i), "down_proj": (i, d), "lm_head": (d, s.vocab)}


def lora_targets(shape: ModelShape, lora: LoraSpec) -> list[str]:
    """The adapted modules: `target_modules`, or the family's default (its attention projections)."""
    if not lora.enabled:
        return []
    targets = list(lora.target_modules or shape.family.lora_targets)
    known = set(linear_dims(shape)) | ({EXPERTS_TARGET, ROUTER_TARGET} if shape.moe else set())
    unknown = [m for m in targets if m not in known]
    if unknown:
        raise SpecError("model.lora.target_modules", f"{unknown} are not modules of this model",
                        f"choose from {sorted(known)}")
    return targets


def head_trainable(lora: LoraSpec) -> bool:
    return not lora.enabled or "lm_head" in (lora.target_modules or ())


@dataclass(frozen=True)
class ParamBudget:
    block: int  # one decoder block, LoRA adapters included
    block_trainable: int
    root: int  # embeddings + final norm + untied lm_head
    root_trainable: int
    layers: int

    @property
    def total(self) -> int:
        return self.layers * self.block + self.root

    @property
    def trainable(self) -> int:
        return self.layers * self.block_trainable + self.root_trainable


def param_budget(s: ModelShape, lora: LoraSpec) -> ParamBudget:
    """Analytic parameter counts: the block's projections, its norms (Gemma: four; QK-norm: two over head_dim),
    q/k/v biases (Qwen2); LoRA adds r·(in + out) per target module."""
    dims = linear_dims(s)
    block = sum(i * o for name, (i, o) in dims.items() if name in block_linears(s)) + s.norms_per_block * s.hidden
    block += (s.heads + s.kv_heads) * s.hd if s.family.qk_norm_whole else 2 * s.hd if s.family.qk_norm else 0
    block += moe.mlp_params(s) if s.moe else 0
    block += (s.heads + 2 * s.kv_heads) * s.hd if s.family.qkv_bias else 0
    root = (s.vocab + (0 if s.tie else s.head_vocab)) * s.hidden + s.hidden
    targets = lora_targets(s, lora)
    adapters = {m: lora.r * sum(dims[m]) for m in targets if m not in (EXPERTS_TARGET, ROUTER_TARGET)}
    block_lora = sum(n for m, n in adapters.items() if m in block_linears(s))
    block_lora += moe.expert_adapter_params(s, lora.r) if EXPERTS_TARGET in targets else 0
    block_lora += lora.r * (s.hidden + s.moe.count) if ROUTER_TARGET in targets else 0  # A [r, d], B [E, r]
    root_lora = adapters.get("lm_head", 0)
    if lora.enabled:
        return ParamBudget(block + block_lora, block_lora, root + root_lora, root_lora, s.layers)
    return ParamBudget(block, block, root, root, s.layers)


def nf4_block_weights(s: ModelShape, lora: LoraSpec) -> list[int]:
    """Element counts of the block weights a QLoRA base holds as NF4 (`shardline.model.nf4`): every projection of
    a block whose element count torchao can quantize (a multiple of 64 × 256); empty without
    `model.lora.quantize_base: nf4`. The head stays in the compute dtype."""
    if not lora.enabled or lora.quantize_base != "nf4":
        return []
    return [i * o for name, (i, o) in linear_dims(s).items()
            if name in block_linears(s) and nf4_quantizable((o, i))]


def float8_block_linears(s: ModelShape, float8: str) -> list[tuple[int, int]]:
    """(in, out) of each block projection `train.float8` multiplies in float8 (`shardline.model.float8`: both
    dimensions multiples of 16); empty with `train.float8: none`."""
    if float8 == "none":
        return []
    return [(i, o) for name, (i, o) in linear_dims(s).items()
            if name in block_linears(s) and i % FLOAT8_DIM_MULTIPLE == 0 and o % FLOAT8_DIM_MULTIPLE == 0]


def float8_cast_bytes(linears: list[tuple[int, int]], n: int) -> int:
    """Transient bytes of the largest float8 linear's casts while its backward runs: float8 (1 byte) copies of the
    input, the weight and the output gradient, and their transposed copies for the two gradient matmuls; the scales
    (one fp32 per tensor or per row) are left out (under 0.5 % of these). torchao saves the bf16 input for
    backward, so the saved activations are bf16's."""
    return max((2 * (n * (i + o) + i * o) for i, o in linears), default=0)


def nf4_dequantize_bytes(numel: int, c: int) -> int:
    """Transient bytes while torchao dequantizes one NF4 weight for a matmul (`NF4Tensor.get_original_weight`, all
    its locals alive until it returns): the two int64 code-index tensors (8 bytes per element in all), the two
    looked-up halves and the two scaled halves (c/2 each) and the interleaved result (c)."""
    return (8 + 3 * c) * numel


def block_saved_bytes(s: ModelShape, c: int, lora: LoraSpec, attn: str, seq_len: int, kind: str = "cuda",
                      compiled: bool = False, imbalance: float = 1.0) -> float:
    """Bytes one decoder block saves for backward, per token, without activation checkpointing. A compiled block
    (`parallel.compile`) saves less: inductor's partitioner recomputes the cheap pointwise ops in the backward, so
    each RMSNorm keeps one compute-dtype tensor (not its fp32 copy) and the MLP keeps gate and up, not act(gate).
    `imbalance`: a mixture of experts' routed copies this rank computes against a balanced share."""
    d, i, h = s.hidden, s.intermediate, s.heads
    q, kv = h * s.hd, s.kv_heads * s.hd
    targets = set(lora_targets(s, lora))
    full = not lora.enabled
    dropout = lora.enabled and lora.dropout > 0

    def inputs(names: tuple[str, ...], width: int, shared: bool = False) -> float:
        """A linear saves its input only for its weight gradient (frozen base: only LoRA targets need it)."""
        if full:
            return 0 if shared else c * width
        hit = [n for n in names if n in targets]
        if dropout:  # peft: each target gets its own dropout output (c) and mask (CUDA bool; CPU: c-byte noise)
            return len(hit) * (c + (1 if kind == "cuda" else c)) * width
        return c * width if hit and not shared else 0

    # Packed rows: eager gets a dense block-diagonal mask and repeats GQA heads; shardline's sdpa runs per
    # document with no mask and native GQA; flash-attention reads the document offsets.
    kv_saved = q if (attn == "eager" and kv < q) else kv
    fused = s.family.fused
    # RMSNorms (2, Gemma's 4): fp32 input, normalized (weight grad), rsqrt; QK-norm the same over q and k
    norm = c if compiled else 4 + (c if full else 0)  # bytes per normalized element
    b = s.norms_per_block * (norm * d + 4) / s.tp  # sequence parallel: 1/tp of the tokens
    if s.family.qk_norm:  # over each head's head_dim (rsqrt per head), or over the whole q and k (OLMoE)
        b += norm * (q + kv) + 4 * (2 if s.family.qk_norm_whole else h + s.kv_heads)
    b += inputs(("qkv_proj",) if fused else ("q_proj", "k_proj", "v_proj"), d)
    # flash's output already has o_proj's layout; per-document SDPA's outputs are concatenated into a new tensor
    b += inputs(("o_proj",), q, shared=attn == "flash_attention_2")
    if attn == "eager":  # q, repeated k and v, fp32 softmax output and (bf16) its cast: a T² term
        b += c * (q + 2 * kv_saved) + h * seq_len * (4 + (c if c < 4 else 0))
    else:  # SDPA / flash: q, k, v, output and logsumexp
        b += c * (2 * q + 2 * kv_saved) + 4 * h
    if s.moe:  # the router, the dispatch and the experts (`planning.moe`); the router's input is the MLP's
        b += (c * d if full else 0) + moe.mlp_saved_bytes(s, c, full or EXPERTS_TARGET in targets, imbalance)
    else:
        b += inputs(("gate_up_proj",) if fused else ("gate_proj", "up_proj"), d)
        b += (2 if compiled else 3) * c * i  # gate, up and (eager) act(gate)
        b += inputs(("down_proj",), i)
    b += sum(c * lora.r for m in targets if m in block_linears(s))  # lora_A outputs
    return b


def selective_saved_bytes(s: ModelShape, c: int, lora: LoraSpec, imbalance: float = 1.0) -> float:
    """Selective AC: block input + outputs of every matmul and of attention (with logsumexp), per token."""
    d, i = s.hidden, s.intermediate
    q, kv = s.heads * s.hd, s.kv_heads * s.hd
    dims = linear_dims(s)
    adapters = sum(c * (lora.r + dims[m][1]) for m in lora_targets(s, lora) if m in block_linears(s))
    mlp = moe.mlp_selective_bytes(s, c, imbalance) if s.moe else c * (2 * i + d)
    return c * (d + 2 * q + 2 * kv + d) + mlp + 4 * s.heads + adapters


@dataclass(frozen=True)
class MemoryPlan:
    """Per-device bytes at the peak moment (`phase`); the fields sum to `total_bytes`."""

    params: int
    grads: int
    optimizer: int
    gather_buffers: int
    activations: int
    logits: int
    temporaries: int
    allocator: int  # CPU: freed memory glibc keeps resident
    runtime: int  # CUDA context and workspaces, or the CPU process's resident runtime
    phase: str
    device: Device
    capacity_bytes: int
    host_offload_bytes: int  # per rank, with parallel.offload
    total_params: int
    trainable_params: int
    dp_shard: int
    saved_activations: int  # all blocks' activations at the start of backward (whatever moment peaks)
    family: Family = LLAMA
    """The decoder family the shape was read as (`shardline.model.families`)."""
    kv_cache: int = 0
    """GRPO: the keys and values of this rank's sampled sequences, when sampling is the peak moment."""
    moment_bytes: dict[str, int] = field(default_factory=dict)
    """Every moment's bytes (`phase` is the largest), without the allocator's and the runtime's."""
    growth: int = 0
    """CPU: what kernel caches and the allocator reach over a long run (`shardline.planning.cpu_runtime`)."""
    runtime_source: str = "typical"
    """How the runtime was obtained: "typical" (a constant, `plan.devices`) or "measured at startup" (a run's)."""
    growth_basis: str = ""

    @property
    def tensor_bytes(self) -> int:
        """The tensors at the peak moment: what neither the allocator, the caches nor the runtime hold."""
        return self.total_bytes - self.allocator - self.growth - self.runtime

    def terms(self) -> str:
        """The planned peak by what it counts, as a run's last line names it."""
        parts = [f"tensors {self.tensor_bytes / GiB:.2f}"]
        if self.allocator:
            parts.append(f"allocator retention {self.allocator / GiB:.2f}")
        if self.growth:
            parts.append(f"caches and heap growth {self.growth / GiB:.2f} (steady state, {self.growth_basis})")
        if self.metric_bytes == self.total_bytes:
            parts.append(f"runtime {self.runtime / GiB:.2f} ({self.runtime_source})")
        return " + ".join(parts) + ("" if self.metric_bytes == self.total_bytes else " (no runtime: CUDA's allocated)")

    @property
    def total_bytes(self) -> int:
        return sum(getattr(self, f) for f in COMPONENTS)

    @property
    def metric_bytes(self) -> int:
        """Comparable with the trainer's `mem_peak_bytes`: CUDA max_memory_allocated excludes the runtime."""
        return self.total_bytes - (self.runtime if self.device.kind == "cuda" else 0)

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.capacity_bytes


COMPONENTS = ("params", "grads", "optimizer", "gather_buffers", "activations", "logits", "kv_cache", "temporaries",
              "allocator", "growth", "runtime")
LABELS = {
    "params": "parameters (shards; frozen ones in the compute dtype or NF4)", "grads": "gradients (fp32 shards)",
    "optimizer": "optimizer state (AdamW, 2 × fp32)", "gather_buffers": "FSDP gather buffers (root + 2 blocks)",
    "activations": "activations", "logits": "logits + cross-entropy", "kv_cache": "KV cache (GRPO's sampling)",
    "temporaries": "temporary buffers",
    "allocator": "allocator retention (glibc)",
    "growth": "caches + heap growth, steady state", "runtime": "runtime (context / process)",
}


def _activations(spec: JobSpec, shape: ModelShape, c: int, kind: str, imbalance: float) -> tuple[float, float, int]:
    """(bytes saved at the start of backward, one block's saved bytes, checkpointed blocks)."""
    p, t, lora = spec.parallel, spec.train, spec.model.lora
    n, d = t.micro_batch_size * t.seq_len // p.cp, shape.hidden
    block = block_saved_bytes(shape, c, lora, spec.model.attn_implementation, t.seq_len, kind, p.compile,
                              imbalance) * n
    # context parallel: attention saves the keys and values it gathered from the other ranks of the row
    block += 2 * c * shape.kv_heads * shape.hd * t.micro_batch_size * (t.seq_len - t.seq_len // p.cp)
    n_ckpt = 0 if p.activation_checkpointing == "none" else math.ceil(shape.layers / p.activation_checkpointing_every)
    kept = (c * d * n / shape.tp if p.activation_checkpointing == "full"
            else selective_saved_bytes(shape, c, lora, imbalance) * n)
    final_norm = ((4 * d + (0 if lora.enabled else c * d)) / shape.tp + (c * d if head_trainable(lora) else 0)) * n
    saved = n_ckpt * kept + (shape.layers - n_ckpt) * block + (block if n_ckpt else 0) + final_norm
    if spec.model.attn_implementation == "eager":
        saved += c * t.seq_len * n  # one additive mask shared by all blocks
    return saved, block, n_ckpt


def check_float8_gpu(float8: str, device: Device) -> None:
    """`train.float8` needs FP8 tensor cores (compute capability 8.9 and up: the catalogue gives such a GPU an FP8
    peak); a GPU without them is refused by name, as the trainer would refuse it (`shardline.model.float8`)."""
    gpu = match_device(device.name) if device.kind == "cuda" and float8 != "none" else None
    if gpu is not None and gpu.fp8_tflops is None:
        raise SpecError("train.float8", f"is {float8}, but {gpu.name} has no FP8 tensor cores (compute capability "
                        "below 8.9; 8.9 and up: L4, L40S, RTX 4090, H100, H200, B200)",
                        "set train.float8=none (bf16) on this GPU, or plan for an FP8-capable one (--device h100)")


def kv_cache_bytes(shape: ModelShape, c: int, sequences: int, tokens: int) -> int:
    """Keys and values of `sequences` sequences of `tokens` tokens in a `c`-byte dtype, every layer."""
    return 2 * shape.layers * shape.kv_heads * shape.hd * c * sequences * tokens


def as_device(device: Device | str | None) -> Device:
    """A `Device`, a catalogue name, or None: this machine's device."""
    if device is None:
        return current_device()
    return get_device(device) if isinstance(device, str) else device


def plan_memory(spec: JobSpec, device: Device | str | None = None, runtime_bytes: int | None = None,
                imbalance: float = 1.0) -> MemoryPlan:
    """Estimate the per-device peak of `spec` on `device` (a `Device`, a table name, or None: this machine);
    `runtime_bytes`: a CPU run's own runtime, measured at startup (`cpu_runtime.resident_bytes`); `imbalance`: for a
    mixture of experts under expert parallel, the routed copies this rank computes against a balanced share (with
    `train.expert_capacity_factor` the capacity's bound instead, `moe.capacity_share`)."""
    dev = as_device(device)
    check_float8_gpu(spec.train.float8, dev)
    shape = model_shape(spec.model)
    p, t, lora = spec.parallel, spec.train, spec.model.lora
    real = param_budget(shape, lora)
    shape = tensor_parallel_shape(shape, p.tp)  # what one rank of a tensor-parallel group holds and computes
    pb = param_budget(shape, lora)
    # FSDP shards over dp_shard × cp (context-parallel peers' gradients are summed like data parallel's)
    shard = (p.dp_shard or spec.world_size // (p.dp_replicate * p.ranks_per_row)) * p.cp
    c = 2 if planned_precision(t.precision, dev) == "bf16" else 4
    n = t.micro_batch_size * t.seq_len // p.cp  # context parallel: this rank's tokens
    d = shape.hidden
    if shape.moe and t.expert_capacity_factor:  # the capacity bounds what a rank computes, whatever the routing
        imbalance = moe.capacity_share(shape, n, p.ep, t.expert_capacity_factor)

    # fp32 masters of what trains; frozen weights (a LoRA base) in the compute dtype (parallel.fsdp); a QLoRA base's
    # NF4 weights whole on every rank (not sharded) at torchao's storage per weight
    nf4 = nf4_block_weights(shape, lora)
    nf4_params = pb.layers * sum(nf4)
    params = ((4 * pb.trainable + c * (pb.total - pb.trainable - nf4_params)) / shard
              + pb.layers * sum(nf4_bytes(n, c) for n in nf4))
    if frozen_reference_copy(spec):  # GRPO's KL in a full fine-tune: the starting weights, frozen, sharded alike
        params += c * pb.total / shard
    dequantize = nf4_dequantize_bytes(max(nf4, default=0), c)  # one weight at a time, forward and backward
    grads, opt = 4 * pb.trainable / shard, 8 * pb.trainable / shard
    opt_temp = 0 if dev.kind == "cuda" else 4 * pb.trainable / shard  # fused AdamW on CUDA; foreach on CPU

    saved, block, n_ckpt = _activations(spec, shape, c, dev.kind, imbalance)
    head_grad = c * shape.head_vocab * d if head_trainable(lora) else 0
    # gradients of the MLP intermediates while a block runs backward (a mixture: and the all-to-all buffers)
    block_bwd = (moe.mlp_backward_bytes(shape, c, p.ep, imbalance) if shape.moe else 3 * c * shape.intermediate) * n
    # NF4 weights are outside FSDP: never gathered; expert parallel gathers only this rank's experts
    gathered = moe.gathered_block(shape, pb.block, p.ep)
    gathers = c * (pb.root + 2 * (gathered - sum(nf4)))
    float8 = float8_block_linears(shape, t.float8)
    if t.float8 == "tensorwise" and dev.kind == "cuda":  # FSDP2's float8 all-gather: 1 byte per converted weight
        gathers -= 2 * (c - 1) * sum(i * o for i, o in float8)
    dequantize += float8_cast_bytes(float8, n)  # one linear's float8 copies at a time, forward and backward
    # FSDP2 post-backward: unsharded grads (c) → fp32 reduce-scatter input; one earlier input stays in flight
    block_rs = (c + 8) * (pb.block_trainable - (0 if lora.enabled else pb.block - gathered))
    root_rs = (c + 4) * pb.root_trainable + 4 * (pb.block_trainable - (0 if lora.enabled else pb.block - gathered))

    grads_now = grads if spec.grad_accum_steps > 1 else 0  # earlier micro-batches' gradients
    at_loss_gathers, at_loss_saved = gathers, saved
    if shape.moe:
        # A mixture's block is large against the rest (its routed copies' activations; at ep 1 all of its experts),
        # so the loss's backward is planned as FSDP2 holds it then: the root and the one block prefetched for
        # backward gathered, no block recomputed yet (that is in the blocks' moments below). Dense plans keep the
        # older, conservative moment (two blocks, one recomputed), which tests/train/test_dry_run.py's gaps are of.
        at_loss_gathers = c * (pb.root + gathered - sum(nf4))
        at_loss_saved = saved - (block if n_ckpt else 0)
    moments = {
        "start of backward": dict(gather_buffers=at_loss_gathers, activations=at_loss_saved,
                                  # loss parallel: counted over the whole vocabulary, as the dry run measures
                                  # torch's loss_parallel backward (its temporaries are not 1/tp of the logits)
                                  logits=_loss_bytes(t, n, shape.vocab, d, c),
                                  temporaries=head_grad + dequantize, grads=grads_now),
        "first block reduce-scatter": dict(gather_buffers=gathers, activations=saved - block,
                                           temporaries=head_grad + block_rs + dequantize, grads=grads_now),
        "end of backward": dict(gather_buffers=gathers, activations=block,
                                temporaries=head_grad + block_bwd + block_rs + dequantize, grads=grads),
        "root reduce-scatter": dict(temporaries=root_rs, grads=grads),
        "optimizer step": dict(temporaries=opt_temp, grads=grads),
    }
    if t.objective == "grpo":  # sampling: every weight gathered in turn, this rank's sequences' keys and values
        sequences = t.global_batch_size // spec.world_size
        kv = kv_cache_bytes(shape, c, sequences, t.seq_len)
        # the dry run's sampling (`simulation/step_memory.py`) also holds: one layer's keys and values twice while
        # DynamicCache appends the new token (torch.cat), and the root's all-gather buffer beside its unsharded
        # parameters while they are copied out
        moments["GRPO sampling"] = dict(gather_buffers=gathers + c * pb.root, kv_cache=kv,
                                        temporaries=kv // shape.layers,
                                        logits=(c + 8) * sequences * shape.head_vocab)  # last position; fp32 softmax
    host = 0
    if p.offload and dev.kind == "cuda":
        host = params + grads + opt + opt_temp
        params = opt = 0
        for m in moments.values():
            m["grads"] = 0
        moments["optimizer step"]["temporaries"] = 0
    phase, parts = max(moments.items(), key=lambda kv: sum(kv[1].values()))
    moment_bytes = {name: int(params + opt + sum(m.values())) for name, m in moments.items()}
    parts = {k: int(x) for k, x in parts.items()}
    parts = {"grads": 0, "gather_buffers": 0, "activations": 0, "logits": 0, "kv_cache": 0, "temporaries": 0} | parts
    allocator, growth, basis = 0, 0, ""
    runtime, runtime_source = dev.runtime_bytes, "typical"
    if dev.kind == "cpu":
        transient = sum(x for k, x in parts.items() if k != "grads")
        blocks = CPU_RETAINED_BLOCKS_RECOMPUTE if n_ckpt else CPU_RETAINED_BLOCKS_PLAIN
        allocator = int(CPU_RETAINED_TRANSIENT * transient + blocks * block)
        growth, basis = steady_growth_bytes(c)
        if runtime_bytes:
            runtime, runtime_source = runtime_bytes, "measured at startup"
    capacity = dev.memory_bytes
    if dev.kind == "cpu":
        capacity //= spec.parallel.nproc_per_node or 1  # the processes of a node share its RAM
    return MemoryPlan(
        params=int(params), optimizer=int(opt), **parts,
        allocator=allocator, runtime=runtime, phase=phase, device=dev, capacity_bytes=capacity,
        host_offload_bytes=int(host), total_params=real.total, trainable_params=real.trainable, dp_shard=shard,
        saved_activations=int(saved), family=shape.family, moment_bytes=moment_bytes, growth=growth,
        runtime_source=runtime_source, growth_basis=basis,
    )


def _loss_bytes(t: TrainSpec, n: int, v: int, d: int, c: int) -> int:
    """Logits and cross-entropy of n tokens: whole, or one chunk of `train.loss_chunk_tokens` at a time."""
    k = t.loss_chunk_tokens
    return 12 * min(n, k) * v + 2 * c * n * d if k else 12 * n * v


def planned_peak_bytes(spec: JobSpec, runtime_bytes: int | None = None) -> int:
    """The planned counterpart of the trainer's `mem_peak_bytes` on the device this process runs on."""
    return plan_memory(spec, runtime_bytes=runtime_bytes).metric_bytes


def gib(n: float) -> str:
    return f"{n / GiB:,.2f}"


def plan_rows(plan: MemoryPlan) -> list[tuple[str, str]]:
    """(label, GiB) rows of the non-zero components; on the CPU the runtime and the growth say where they come
    from."""
    labels = dict(LABELS)
    if plan.device.kind == "cpu":
        labels["runtime"] = f"runtime ({plan.runtime_source})"
        labels["growth"] = f"{LABELS['growth']} ({plan.growth_basis})"
    return [(labels[f], gib(getattr(plan, f))) for f in COMPONENTS if getattr(plan, f)]

