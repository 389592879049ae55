"""The sections of the job spec: one typed tree that every part of shardline reads (docs/architecture.md §3).

Every field here is read by some part of the code; unknown keys are errors.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

Precision = Literal["auto", "bf16", "fp32"]
Float8Recipe = Literal["none", "tensorwise", "rowwise"]
"""torchao's float8 training recipes `train.float8` can name (shardline.model.float8)."""
AttentionImpl = Literal["sdpa", "flash_attention_2", "eager"]
BaseQuantization = Literal["none", "nf4"]
PromptFormat = Literal["auto", "plain", "chat"]
ChatTemplateName = Literal["chatml", "llama3", "alpaca"]
"""The chat templates shardline writes itself (`shardline.data.named_templates`), for `data.chat_template`."""
DataFormat = Literal["auto", "messages", "conversations", "preference", "prompt_completion", "instruction",
                     "question_answer", "text"]
Objective = Literal["sft", "dpo", "grpo"]
DpoLoss = Literal["sigmoid", "ipo", "sigmoid_norm"]
DpoReference = Literal["auto", "adapters_off", "precomputed"]
GrpoLoss = Literal["dapo", "grpo", "bnpo", "dr_grpo"]
RewardScaling = Literal["group", "batch", "none"]
TaskName = Literal["text_to_sql", "none", "random_tokens"]
"""The tasks `data.task` can name (shardline.tasks.TASKS holds one for each)."""
WARMUP_PERCENT = 5  # default linear warmup, as a share of train.max_steps
ActivationCheckpointing = Literal["none", "full", "selective"]


Quantity = Annotated[str, BeforeValidator(lambda v: str(v) if isinstance(v, int | float) else v),
                    Field(pattern=r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|Ki|Mi|Gi|Ti)?$")]
"""A Kubernetes resource quantity ("8", "500m", "64Gi"); numbers from `--set` are accepted."""

EnvName = Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]
"""The name of an environment variable (HF_TOKEN); a secret is passed by this name, never by value."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


class RunSpec(Section):
    name: str = Field("tiny", pattern=r"^[a-z0-9]([a-z0-9-]{0,40}[a-z0-9])?$")
    """Run name: lowercase letters, digits and '-', so it can name Kubernetes objects too."""
    dir: str = "runs"
    """Parent directory of run directories (`<dir>/<id>/`)."""
    id: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,99}$")
    """Assigned at launch (`<name>-<UTC yyyymmdd-hhmmss>-<4 hex>`); set it to reuse an existing run directory.
    Letters, digits, '_' and '-' only: it names a directory under `run.dir`, cluster objects and shell words."""


class ArchSpec(Section):
    """Llama-architecture shape, used when the model is built from a config rather than loaded."""

    vocab_size: int = Field(2048, ge=256)
    """Vocabulary size: the size the byte-level BPE is trained to; the model takes the tokenizer's if larger."""
    hidden_size: int = Field(256, ge=8)
    """Width of the residual stream."""
    intermediate_size: int = Field(688, ge=8)
    """Width of the MLP's gated hidden layer."""
    num_layers: int = Field(4, ge=1)
    """Decoder blocks."""
    num_heads: int = Field(4, ge=1)
    """Attention (query) heads; hidden_size must divide by it."""
    num_kv_heads: int = Field(4, ge=1)
    """Key/value heads (grouped-query attention); num_heads must divide by it."""
    max_position_embeddings: int = Field(2048, ge=16)
    """Longest position the rotary embedding is built for; at least train.seq_len."""
    rope_theta: float = Field(10000.0, gt=0)
    """Rotary embedding base."""
    tie_embeddings: bool = False
    """Share the input embedding with the output projection."""


class LoraSpec(Section):
    enabled: bool = False
    """Train low-rank adapters on a frozen base instead of every weight."""
    r: int = Field(16, ge=1)
    """Adapter rank."""
    alpha: float = Field(16.0, gt=0)
    """Adapter scale numerator: the update is (alpha / r) · B·A."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input (training only)."""
    target_modules: list[str] | None = None
    """Module names to adapt; None: the family's attention projections (q/k/v/o_proj; Phi-3's qkv_proj, o_proj)."""
    quantize_base: BaseQuantization = "none"
    """none (the frozen base in the compute dtype) | nf4 (QLoRA: every frozen linear weight of the decoder blocks as
    torchao's 4-bit NormalFloat with double-quantized block scales, 0.52 bytes per parameter, whole on every rank
    and dequantized for each matmul; the output head, embeddings and norms stay in the compute dtype; a weight whose
    element count is not a multiple of 16,384 stays too, named in the log). Not with parallel.tp > 1 or
    parallel.offload."""


class ModelSpec(Section):
    path: str | None = None
    """Local HF checkpoint directory (config.json + safetensors) or hub name; None builds `arch`."""
    arch: ArchSpec = ArchSpec()
    local_cache: str | None = None
    """Node-local directory to stage `path` into once per node before loading (e.g. local SSD under a
    GCS FUSE mount); None loads straight from `path`."""
    tokenizer: str | None = None
    """Tokenizer directory; defaults to `path`. With neither, a byte-level BPE is trained on the data."""
    attn_implementation: AttentionImpl = "sdpa"
    """sdpa (torch's scaled-dot-product attention, per-document masks when packed) | flash_attention_2 (needs
    flash-attn) | eager."""
    init_seed: int = 0
    """Seed of the random initialisation when the model is built from `arch` (or with `random_init`)."""
    random_init: bool = False
    """Build `path`'s config.json with the random initialisation of `init_seed` instead of reading its weights (none
    need be there): a same-shape model of any family whose weights cannot travel, for benchmarks. The tokenizer is
    still `tokenizer` or `path`'s own."""
    lora: LoraSpec = LoraSpec()


class ColumnsSpec(Section):
    """The source's column name for each field a data format reads (docs/data.md): map yours here."""

    question: str = "question"
    """question_answer: the question."""
    context: str = "context"
    """question_answer: the optional context (a schema for text_to_sql)."""
    answer: str = "answer"
    """question_answer: the answer the loss is on."""
    messages: str = "messages"
    """messages: the list of {role, content} turns."""
    conversations: str = "conversations"
    """conversations: ShareGPT's list of {from, value} turns."""
    prompt: str = "prompt"
    """prompt_completion: the prompt."""
    completion: str = "completion"
    """prompt_completion: the completion the loss is on."""
    instruction: str = "instruction"
    """instruction: the instruction."""
    input: str = "input"
    """instruction: the optional input."""
    output: str = "output"
    """instruction: the output the loss is on."""
    text: str = "text"
    """text: the document (loss on every token)."""
    chosen: str = "chosen"
    """preference: the preferred completion (text, or a list of assistant turns when the prompt is a conversation)."""
    rejected: str = "rejected"
    """preference: the dispreferred completion, in the chosen one's form."""


class SourceSpec(Section):
    """One source of a mixture (`data.sources`): its rows, how they read, and its share of the training examples."""

    path: str
    """As `data.path`: a file, a directory or glob of shards, or a hub dataset name."""
    weight: float = Field(1.0, gt=0)
    """Relative share of the training examples drawn from this source (weights 3 and 1: 75 % and 25 %); a source
    whose share exceeds its rows is repeated, one below them is subsampled, both by a draw seeded by data.seed."""
    format: DataFormat = "auto"
    """How this source's rows read, as `data.format`."""
    columns: ColumnsSpec = ColumnsSpec()
    name: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    """Names the source in summaries, metrics and the report; None: the file's or dataset's name."""
    prompt_format: PromptFormat | None = None
    """How this source's prompts render, as `data.prompt_format`; None: `data.prompt_format` (one for the whole
    mixture)."""


class DataSpec(Section):
    sources: list[SourceSpec] = []
    """Several sources mixed by weight (docs/data.md#mixtures); empty: the one source `path` (or the task's own)."""
    path: str | None = None
    """A local .jsonl, .json (an array of rows) or .parquet file, a directory or glob of such shards, or a hub
    dataset name; None uses the task's own data set (`task`)."""
    format: DataFormat = "auto"
    """How a row reads (docs/data.md): `messages` (chat turns), `conversations` (ShareGPT from/value), `preference`
    (prompt, chosen, rejected: DPO's pairs; SFT trains the chosen), `prompt_completion`, `instruction` (Alpaca
    instruction/input/output), `question_answer` (question, optional context, answer) or `text` (raw documents, loss
    on every token); `auto` detects it from the first row's columns. With `train.objective: dpo` and the generated
    set, `preference` (set when left `auto`) draws each question with a wrong query as the rejected answer."""
    assistant_turns: Literal["all", "last"] = "all"
    """Chat formats: loss on every assistant turn of a conversation, or on the last one only."""
    roles: dict[str, Literal["system", "user", "assistant", "tool", "function_call"]] = {}
    """Chat formats: turn roles of other names and the role each is read as, besides the format's own (e.g.
    `{bot: assistant, ipython: tool}`); `function_call`: an assistant turn whose content is its tool call(s) as JSON
    (`{"name", "arguments"}`)."""
    group_by: str | None = None
    """A column whose rows stay in one split together (one user's turns, one document's questions); None: the
    split is by row."""
    task: TaskName | None = None
    """What the examples are for (shardline/tasks/). `text_to_sql`: the schema + question prompt, its generated
    set when `path` is unset, and at the end SQL generated for the test questions, scored by test-suite
    execution accuracy. `none`: a neutral prompt (question or instruction, blank line, context or input), no data
    of its own, validation loss only. `random_tokens`: the throughput benchmarks' rows — each one document of
    `train.seq_len` uniformly random ids, every token a target, `train_size`/`validation_size` rows, no `path`.
    None: `text_to_sql` without `path`, `none` with it (written out in the resolved spec)."""
    columns: ColumnsSpec = ColumnsSpec()
    seed: int = 1234
    """Seeds the generated set and the split of a user dataset into train/validation/test."""
    train_size: int | None = Field(4000, ge=1)
    """Training examples (generated), or the cap on training rows taken from `path` (None: all)."""
    validation_size: int | None = Field(None, ge=1)
    """Rows held out for the validation loss (per source); None: 5 % of a source's rows, at least 1 and at most
    200, for your own data (`path`, `sources`), and 200 for a task's own set (written out in the resolved spec)."""
    test_size: int | None = Field(None, ge=0)
    """Rows held out for the task's generation metric; None: 200 where the task scores generations
    (text_to_sql), 0 where none does (written out in the resolved spec)."""
    prompt_format: PromptFormat = "auto"
    """How prompts of prompt/answer rows (prompt_completion, instruction, question_answer, the generated set)
    render: `plain`, a fixed text template; `chat`, a user turn in the tokenizer's chat template (instruct models);
    `auto`, chat when the tokenizer has a chat template (its own or `chat_template`), else plain (the prepare
    summary says which). Conversations always render with the chat template."""
    chat_template: ChatTemplateName | None = None
    """A chat template written in shardline (docs/data.md#defaults) that replaces the tokenizer's: `chatml`
    (`<|im_start|>`/`<|im_end|>`), `llama3` (Llama 3's header and `<|eot_id|>` tokens) or `alpaca` (`### Instruction:`
    / `### Response:`, the tokenizer's EOS ends a turn: any tokenizer); the tokenizer must have the template's special
    tokens. None: the tokenizer's own, if any."""
    packing: bool = True
    """Pack whole examples into `train.seq_len` rows; False pads one example per row."""
    cache_dir: str | None = None
    """Where prepared data is cached, content-addressed; default `<run.dir>/prepared`."""

    @model_validator(mode="after")
    def _default_task(self) -> DataSpec:
        if self.task is None:  # the generated set is text-to-SQL; a user's own data is not assumed to be
            self.task = "text_to_sql" if self.path is None and not self.sources else "none"
        if self.test_size is None:  # held-out rows only where something scores them
            self.test_size = 200 if self.task == "text_to_sql" else 0
        if self.validation_size is None and self.path is None and not self.sources:
            self.validation_size = 200  # a task's own set keeps its explicit size; a user's is sized by its rows
        return self


class DpoSpec(Section):
    """Direct preference optimisation (`train.objective: dpo`, docs/post-training.md)."""

    beta: float = Field(0.1, gt=0)
    """How far the policy may move from the reference: the scale of the implicit reward β·log(π/π_ref)."""
    loss: DpoLoss = "sigmoid"
    """sigmoid: DPO's −log σ(β·Δ); ipo: (Δ/len − 1/(2β))² on per-token log-ratios; sigmoid_norm: DPO on per-token
    log-ratios (length-normalised). Δ = chosen log-ratio − rejected log-ratio; TRL's `loss_type` of the same name."""
    sft_weight: float = Field(0.0, ge=0)
    """Adds this × the chosen completions' next-token loss (per token) to the DPO loss: DPO alone tends to lower
    the chosen completions' likelihood along with the rejected ones'; TRL's `loss_type=[…, "sft"]` (RPO)."""
    reference: DpoReference = "auto"
    """adapters_off: the reference is the same weights with the LoRA adapters off, one no-grad forward per step;
    precomputed: the reference log-probabilities of every pair, computed once before the first step with the starting
    weights and kept in the run directory; auto: adapters_off with LoRA, precomputed without."""


class GrpoSpec(Section):
    """Group relative policy optimisation with verifiable rewards (`train.objective: grpo`, docs/post-training.md).

    Each step samples `num_generations` completions of each of `train.global_batch_size / num_generations` training
    prompts with the model itself, scores them with the reward, and trains on the group-normalised advantages."""

    num_generations: int = Field(8, ge=2)
    """G: completions sampled per prompt; a prompt's advantages are its completions' rewards relative to the group."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature; the policy's log-probabilities are taken at the same temperature (as TRL does)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling: the smallest set of tokens whose probability reaches top_p (1: all)."""
    max_new_tokens: int = Field(128, ge=1)
    """Longest completion sampled; a completion cut here has no end token (and is trained as sampled)."""
    beta: float = Field(0.0, ge=0)
    """Weight of the per-token KL to the reference: the starting weights, as the LoRA adapters off or, in a full
    fine-tune, a frozen sharded copy in the compute dtype (one more model's weights in memory); 0 (TRL's default)
    runs no reference forward."""
    num_iterations: int = Field(1, ge=1)
    """μ: optimizer steps per sampled batch (TRL's `num_iterations`). Each step trains the whole batch again against
    the log-probabilities it was sampled with (π_old), so from the second step on the ratio moves and the clip acts;
    the batch is sampled every μ steps. Checkpoints fall on sampling steps only (`checkpoint.every_steps` and
    `train.max_steps` are multiples of μ; a time-based save or a stop signal waits for the next one), so a resume
    samples exactly what the lost steps trained on."""
    oversample: int = Field(1, ge=1)
    """Dynamic sampling (DAPO's, at a fixed cost per step): each rank samples `oversample` × its prompts' groups and
    trains on the ones whose rewards spread most (ties: the first sampled). A group whose completions all scored
    alike has no advantage and teaches nothing; a model that solves most prompts, or fails them alike, makes most
    groups so. Sampling and scoring cost `oversample` × as much, one prompt share per `generate` call (the sampling
    memory does not grow). 1: train every group sampled."""
    epsilon: float = Field(0.2, gt=0)
    """The ratio π/π_old is clipped to [1 − epsilon, 1 + epsilon_high] (PPO's clip)."""
    epsilon_high: float | None = Field(None, gt=0)
    """The clip's upper side (DAPO's clip-higher); None: epsilon."""
    loss: GrpoLoss = "dapo"
    """How per-token losses become one: dapo (TRL's default): summed over the global batch's completion tokens and
    divided by their count; grpo: each completion's mean, then the mean over completions; bnpo: summed and divided
    by each process's tokens; dr_grpo: summed and divided by completions × max_new_tokens. TRL's `loss_type`."""
    scale_rewards: RewardScaling = "group"
    """Advantages are rewards minus their group's mean, divided by the group's std (group), the batch's std (batch)
    or nothing (none: Dr. GRPO's advice); TRL's `scale_rewards`."""
    reward: str = "auto"
    """auto: the task's own reward (text-to-SQL: 1 for a query whose result matches the gold's on every database of
    its test suite, plus 0.1 for a query that runs); or `module:function`, importable on every worker, called as
    TRL calls a reward function: `function(prompts=[...], completions=[...], **columns)` with the rows' columns
    (question, context, answer, db_id, source) as lists; it returns one number per completion."""

    @field_validator("reward")
    @classmethod
    def _reward_reference(cls, value: str) -> str:
        if value != "auto" and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", value):
            raise ValueError(f"{value!r} is neither auto nor module:function (e.g. my_rewards:sql_reward)")
        return value


class TrainSpec(Section):
    objective: Objective = "sft"
    """sft: next-token loss on the completions; dpo: preference pairs (prompt, chosen, rejected) trained by
    `train.dpo` against a frozen reference; grpo: completions sampled by the model, scored by a reward and trained
    by `train.grpo` (docs/post-training.md)."""
    dpo: DpoSpec = DpoSpec()
    """DPO's settings; read only with `objective: dpo`."""
    grpo: GrpoSpec = GrpoSpec()
    """GRPO's settings; read only with `objective: grpo`."""
    max_steps: int = Field(300, ge=1)
    """Optimizer steps."""
    seed: int = 0
    """Seeds the sampler (data order) and dropout."""
    micro_batch_size: int = Field(8, ge=1)
    """Rows of seq_len tokens per rank per forward."""
    global_batch_size: int = Field(16, ge=1)
    """Rows per optimizer step; gradient accumulation = global / (data-parallel ranks × micro)."""
    seq_len: int = Field(256, ge=16)
    """Tokens per row."""
    lr: float = Field(3e-3, gt=0)
    """Peak learning rate (AdamW)."""
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    """The cosine schedule decays to lr × this."""
    warmup_steps: int | None = Field(None, ge=0)
    """Linear warmup steps; None: 5% of max_steps, rounded down (written out in the resolved spec)."""
    weight_decay: float = Field(0.1, ge=0)
    """AdamW weight decay, on matrices only (norms and biases are not decayed)."""
    max_grad_norm: float | None = Field(1.0, gt=0)
    """Clip the global gradient norm to this; None: no clipping (the norm is still logged)."""
    router_z_loss_coef: float = Field(0.0, ge=0)
    """Mixtures of experts: weight of the router z-loss (ST-MoE; transformers' `router_z_loss_func`: the mean over
    the real tokens and MoE layers of each router's logsumexp(logits)², which keeps router logits small) added to
    the training loss; 0: off. Above 0 with a dense model is an error."""
    expert_capacity_factor: float | None = Field(None, gt=0)
    """Mixtures of experts: each expert takes at most ceil(tokens·k / E · factor) routed copies per forward (one
    micro-batch of one rank: Megatron-Core's `get_capacity` of the tokens' k copies, GShard's and Switch's capacity);
    the copies over it are dropped, lowest routing weight first (Megatron-Core's "probs" policy; equal weights: the
    later position), before the expert-parallel dispatch, the same at every `parallel.ep`: a dropped copy adds
    nothing, its token keeps its other experts and the residual. Counted per step as `expert_dropped`. Validation
    forwards drop too. null: no capacity, no copy dropped. Set with a dense model is an error."""
    router_bias_update_rate: float = Field(0.0, ge=0)
    """Mixtures of experts: auxiliary-loss-free load balancing (DeepSeek-V3; torchtitan's `expert_bias`): a bias per
    expert and MoE layer, added to the router's probabilities for the top-k choice only (a token's weights stay its
    plain probabilities), moved after every step by this rate × sign(mean load − the expert's load) from the step's
    tokens per expert over all ranks, centred; kept in checkpoints. DeepSeek-V3 pre-trained with 0.001. 0: off.
    Above 0 with a dense model is an error. Exported checkpoints do not carry the biases (transformers' routers of
    these families have none)."""
    precision: Precision = "auto"
    """auto: bf16 on GPUs, TPUs and CPUs with native bf16 matmul (AMX, AVX512_BF16, Arm BF16), fp32 on other CPUs
    (where bf16 is emulated and far slower); chosen where the run is created and kept in its spec.yaml."""
    float8: Float8Recipe = "none"
    """FP8 full fine-tuning: the decoder blocks' linear layers multiply in float8 (torchao's float8 training,
    dynamic scaling per tensor or per row), everything else in bf16 (embeddings, output projection, norms, a
    mixture's router and experts); fp32 master weights as with bf16. tensorwise: one scale per tensor, and FSDP2
    all-gathers the weights in float8 on NCCL; rowwise: one scale per row, more accurate, bf16 all-gather. Needs
    bf16 (`train.precision` auto or bf16), a full fine-tune (no LoRA), `parallel.tp=1`, and a GPU with FP8 units
    (compute capability 8.9+: L4, L40S, H100, H200, B200; emulated on CPU). MFU stays against the bf16 peak."""
    peak_tflops: float | None = Field(None, gt=0)
    """Per-device peak for MFU; None: the device table on GPU, a matmul probe on CPU."""
    log_every: int = Field(10, ge=1)
    """Steps between step lines and records (the first and last step are always logged)."""
    eval_every: int = Field(100, ge=1)
    """Steps between validation losses (also at the end)."""
    eval_examples: int = Field(200, ge=0)
    """Test examples generated for at the end and scored by the task's metric (text_to_sql: execution
    accuracy); 0 skips it. A task without a generation metric (`data.task: none`) skips it always."""
    eval_max_new_tokens: int = Field(96, ge=1)
    """Most tokens generated per answer in the end-of-run evaluation."""
    sample_generations: int = Field(4, ge=0)
    """Where the task has no generation metric (a user's own data, `data.task: none`): validation examples the
    model answers at the end, shown beside their references in eval.json and the report (conversations up to their
    last assistant turn, prompts, instructions; never raw text); 0 skips it."""
    loss_chunk_tokens: int | None = Field(4096, ge=0)
    """The LM head and cross-entropy over chunks of this many loss-bearing tokens, each recomputed in backward, so
    the whole [tokens, vocab] logits never exist; 0 or null: the model's whole logits (transformers' path)."""
    engine: Literal["torch", "maxtext"] = "torch"
    """What trains: `torch` (shardline's FSDP2 worker under torchrun, on GPUs or CPU) or `maxtext` (MaxText, JAX, on
    the TPU slices of launch.tpu; shardline maps the spec to MaxText's config, engines/tpu/maxtext.py, docs/tpu.md)."""

    @model_validator(mode="after")
    def _scale_warmup(self) -> TrainSpec:
        if self.warmup_steps is None:  # a fixed default would make every short run invalid
            self.warmup_steps = self.max_steps * WARMUP_PERCENT // 100
        return self


class ParallelSpec(Section):
    nproc_per_node: int | None = Field(None, ge=1)
    """Processes per node; None: one per GPU, or 2 on CPU."""
    dp_replicate: int = Field(1, ge=1)
    """HSDP: replicas of the model (typically one per node group); 1 = plain FSDP."""
    dp_shard: int | None = Field(None, ge=1)
    """Ranks each replica is sharded over; None = world size / dp_replicate."""
    tp: int = Field(1, ge=1)
    """Tensor-parallel degree: each decoder block's attention and MLP projections split over this many
    consecutive ranks of a node (column- then row-wise), sequence parallel between them, an untied output
    projection split over the vocabulary (loss parallel); FSDP shards over the rest. 1 = FSDP alone."""
    async_tp: bool = False
    """torch's micro-pipelined (async) tensor parallel: the compiled blocks overlap each column-wise matmul with the
    all-gather before it and each row-wise one with its reduce-scatter (inductor's `_micro_pipeline_tp`, symmetric
    memory). CUDA only, with tp > 1 and `compile`; not yet measured on a GPU."""
    cp: int = Field(1, ge=1)
    """Context-parallel degree: each row's tokens split over this many ranks (load-balanced causal chunks), whose
    attention all-gathers the row's keys and values; for rows too long for one device. FSDP shards over
    data-parallel × cp ranks. 1 = off."""
    ep: int = Field(1, ge=1)
    """Expert-parallel degree (mixtures of experts): each MoE layer's routed experts split over this many
    consecutive data-parallel ranks, E/ep experts each, tokens sent to the ranks that hold their experts by
    all-to-all; borrowed from dp_shard (FSDP shards each rank's experts over dp_shard/ep ranks, the rest of the
    model over all of them as without it). 1 = FSDP alone shards the experts."""
    offload: bool = False
    """Keep parameters, gradients and optimizer state on the host (FSDP2 CPUOffloadPolicy)."""
    reshard_after_forward: bool = True
    """FSDP2: free the gathered parameters after forward (re-gathered in backward); False keeps them, trading
    memory for communication."""
    activation_checkpointing: ActivationCheckpointing = "none"
    """none | full (recompute whole blocks) | selective (keep matmul/attention outputs, recompute the rest)."""
    activation_checkpointing_every: int = Field(1, ge=1)
    """With `full`/`selective`: checkpoint every k-th block only (k=1: all blocks)."""
    compile: bool = False
    """torch.compile each decoder block before sharding."""

    @property
    def ranks_per_row(self) -> int:
        """tp × cp: the ranks that train each row together (they read the same rows); the rest are data-parallel."""
        return self.tp * self.cp


class CheckpointSpec(Section):
    every_steps: int | None = Field(None, ge=1)
    """Save a checkpoint every N steps (always also at the end)."""
    every_minutes: float | None = Field(None, gt=0)
    """Also save when this much wall time passed since the last save (agreed across ranks)."""
    dir: str | None = None
    """Where checkpoints go: a path (local, NFS, GCS FUSE) or an fsspec URL (s3://, gs://). Each run writes
    under its own prefix `<dir>/<run.id>/`, so runs sharing a bucket never resume or delete each other's
    checkpoints; default `<run dir>/checkpoints`."""
    resume_from: str | None = Field(None, min_length=1)
    """Start from another run's checkpoint: its run directory or checkpoint location (path or URL), with
    `@<step>` for a given step (default: its newest intact one). Model, optimizer, schedule and data position
    continue from there under the resume rules; once this run has checkpoints of its own, they win."""
    async_save: bool | None = None
    """Write checkpoints in the background while training continues (never two in flight). None: on
    GPU yes (device→host staging frees the GPU while the host writes); on CPU no — staging is a host
    copy as slow as the write itself (bench/RESULTS-checkpoint.md)."""
    keep_last: int = Field(3, ge=1)
    """Committed checkpoints kept; older ones are deleted only after a newer one committed."""
    keep_every: int | None = Field(None, ge=1)
    """Also keep every checkpoint whose step is a multiple of this."""
    allow_spec_change: bool = False
    """Resume although settings changed that a checkpoint survives (lr, max_steps, eval/log cadence…)."""


class Toleration(Section):
    key: str
    """Taint key the pods tolerate."""
    operator: Literal["Exists", "Equal"] = "Exists"
    """Exists (any value) | Equal (`value`)."""
    value: str | None = None
    """Taint value, with operator Equal."""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    """Taint effect tolerated; None: all."""


class SecretRef(Section):
    secret: str = Field(pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    """Name of a Kubernetes Secret in the job's namespace."""
    key: str = Field(pattern=r"^[-._a-zA-Z0-9]+$")
    """Key inside the Secret (Kubernetes' key characters: letters, digits, `-`, `_`, `.`)."""


class StorageSpec(Section):
    """Shared storage for run directories, prepared data and checkpoints; the container's working directory."""

    kind: Literal["none", "gcsfuse", "pvc"] = "none"
    """none (the container's own disk) | gcsfuse (`bucket`) | pvc (`claim`)."""
    bucket: str | None = None
    """GCS bucket (kind gcsfuse), mounted whole at mount_path (writes) and read_path (cached reads)."""
    claim: str | None = None
    """PersistentVolumeClaim (kind pvc), ReadWriteMany for multi-node jobs."""
    mount_path: str = "/mnt/shardline"
    """Read-write mount and the container's working directory: relative run.dir and caches land here."""
    read_path: str = "/mnt/shardline-data"
    """The same storage mounted read-only (file cache and parallel downloads on GCS FUSE) for weights and data."""
    file_cache: Quantity = "100Gi"
    """GCS FUSE read mount: most local disk its file cache may fill; the pod requests it as ephemeral storage."""


class KubernetesSpec(Section):
    namespace: str = Field("default", pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    """Namespace of the job's objects."""
    context: str | None = None
    """kubeconfig context for engines/status/logs/wait/cancel (None: the current context)."""
    service_account: str = Field("shardline-trainer", pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    """Pods run as this ServiceAccount (`shardline cluster bootstrap` creates it with no API permissions)."""
    queue: str | None = None
    """Kueue LocalQueue (label kueue.x-k8s.io/queue-name); Kueue then owns the job's suspend field."""
    workload_priority_class: str | None = None
    """Kueue WorkloadPriorityClass (label kueue.x-k8s.io/priority-class)."""
    priority_class: str | None = None
    """Pod priorityClassName."""
    max_run_seconds: int | None = Field(None, ge=60)
    """DWS flex-start: provreq.kueue.x-k8s.io/maxRunDurationSeconds (needs queue; at most 7 days)."""
    topology: str | None = None
    """Kueue TAS: node label of the topology level all pods must share, e.g. cloud.google.com/gce-topology-block."""
    topology_mode: Literal["required", "preferred"] = "preferred"
    """Kueue TAS: `required` waits for one topology domain; `preferred` packs as close as it can."""
    node_selector: dict[str, str] = {}
    """Pod nodeSelector labels."""
    tolerations: list[Toleration] = []
    """Pod tolerations."""
    gpu_resource: str | None = "nvidia.com/gpu"
    """Extended resource requested per process (nproc_per_node per pod); null on CPU-only clusters."""
    cpu: Quantity | None = None
    """CPU request per pod, e.g. "200" (Kueue quota needs explicit requests)."""
    memory: Quantity | None = None
    """Memory request per pod, e.g. "1800Gi"."""
    shm_size: Quantity = "64Gi"
    """Size of the memory-backed /dev/shm (data loader workers, NCCL)."""
    gpu_networks: list[str] | None = None
    """Cluster network names for the GPU NICs, in order (default: the profile's names)."""
    secret_env: dict[str, SecretRef] = {}
    """Environment variables from Secrets, e.g. HF_TOKEN: {secret: hf-token, key: token}; never values."""
    storage: StorageSpec = StorageSpec()
    restart_strategy: Literal["Recreate", "BlockingRecreate", "InPlaceRestart"] = "Recreate"
    """How `--target jobset` restarts the gang after a failure (JobSet failurePolicy.restartStrategy):
    InPlaceRestart keeps the healthy pods on their nodes and restarts their containers (needs Kubernetes
    ContainerRestartRules and JobSet's InPlaceRestart feature; docs/architecture.md §7.1)."""

    @property
    def restarts_in_place(self) -> bool:
        return self.restart_strategy == "InPlaceRestart"
    trainjob_runtime: str = "shardline"
    """Kubeflow Trainer (Cluster)TrainingRuntime the TrainJob references: by default shardline's own, which
    `cluster bootstrap --trainer-runtime` writes (engines/kubernetes/runtime.py; docs/kubeflow.md)."""


CollectiveOp = Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"]


class NetcheckSpec(Section):
    """`shardline netcheck` / worker `--task netcheck`: the collective bandwidth sweep (ops/checks/netcheck.py)."""

    ops: list[CollectiveOp] = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"]
    """Collectives measured."""
    min_bytes: int = Field(1 << 20, ge=4)
    """Smallest message size (bytes of the whole buffer, as nccl-tests counts them)."""
    max_bytes: int | None = Field(None, ge=4)
    """Largest message size; None: 8 GiB on GPU (the size the profiles' expected busbw is quoted at), 64 MiB on CPU."""
    factor: int = Field(2, ge=2)
    """Each size is the previous one times this."""
    warmup: int = Field(5, ge=0)
    """Untimed iterations per size before the timed ones."""
    iters: int = Field(20, ge=1)
    """Timed iterations per size; the time reported is their mean on the slowest rank."""
    expect_busbw_gbps: float | None = Field(None, gt=0)
    """Pass threshold for the all_gather bus bandwidth at the largest size (90 % of it must be reached);
    None: the profile's expected_busbw_gbps (launch.profile), or no threshold."""


class GpucheckSpec(Section):
    """`shardline gpucheck` / worker `--task gpucheck`: NVML health, matmul burn-in, memory bandwidth."""

    seconds: float = Field(5.0, gt=0, le=3600)
    """Duration of each measurement (matmul burn-in, memory copy) per device."""
    min_peak_fraction: float = Field(0.5, gt=0, le=1)
    """A device whose bf16 matmul TFLOP/s is below this fraction of its table peak fails."""
    straggler_threshold: float = Field(0.1, gt=0, lt=1)
    """A rank slower than the median of all ranks by more than this fraction is flagged as a straggler."""


class SlurmSpec(Section):
    """sbatch settings for `--target slurm` (engines/slurm.py)."""

    partition: str | None = None
    """sbatch --partition."""
    account: str | None = None
    """sbatch --account."""
    qos: str | None = None
    """sbatch --qos."""
    time_limit: str = Field("24:00:00", pattern=r"^(\d+-)?\d+(:\d{2}){0,2}$")
    """sbatch --time: minutes, HH:MM:SS or D-HH:MM:SS; the job gets SIGUSR1 launch.grace_seconds before it."""
    gpus_per_node: int | None = Field(None, ge=0)
    """sbatch --gpus-per-node; None: parallel.nproc_per_node (one GPU per process); 0: request none (CPU nodes)."""
    cpus_per_task: int | None = Field(None, ge=1)
    """sbatch --cpus-per-task (the one task per node runs torchrun and all its workers)."""
    exclusive: bool = True
    """sbatch --exclusive: the job owns its nodes."""
    workdir: str | None = None
    """Directory the job runs in (sbatch --chdir; relative run.dir resolves against it); None: where
    `shardline launch` runs, which must be on a filesystem every node mounts."""
    setup: list[str] = []
    """Shell lines run in the batch script before srun (module load, source a venv); their environment
    reaches every node. They are written into job.sbatch: secrets belong in `secret_env`."""
    secret_env: list[EnvName] = []
    """Environment variables (e.g. [HF_TOKEN, WANDB_API_KEY]) passed by name from the shell that runs
    `shardline launch` to every node (sbatch --export=ALL); values are never written to a file."""
    sbatch_args: list[str] = []
    """Further sbatch options, e.g. ["--constraint=h100", "--reservation=r1"]."""


class RaySpec(Section):
    """Ray Train settings for `--target ray` (a running Ray cluster) and `--target rayjob` (KubeRay)."""

    address: str = "http://127.0.0.1:8265"
    """Ray Jobs API address (the dashboard) of the cluster `--target ray` submits to."""
    max_failures: int = Field(3, ge=-1)
    """Ray Train FailureConfig(max_failures): worker-group restarts after a failure (-1: unlimited); each
    restart resumes from the last committed checkpoint."""
    cpus_per_worker: float = Field(1.0, gt=0)
    """CPUs each Ray Train worker (one per rank) reserves."""
    gpus_per_worker: float = Field(1.0, ge=0)
    """GPUs each Ray Train worker reserves; 0 trains on CPU workers over gloo."""
    ray_version: str = Field("2.60.0", pattern=r"^\d+\.\d+\.\d+$")
    """Ray version of the KubeRay cluster (rayVersion); the image must carry the same Ray."""
    secret_env: list[EnvName] = []
    """`--target ray`: environment variables (e.g. [HF_TOKEN]) copied by name from the environment of
    `shardline launch` into the job's runtime_env at submit; values are never written to a file. A RayJob's
    pods read Secrets instead (launch.kubernetes.secret_env)."""


SecretManagerName = Annotated[str, Field(
    pattern=r"^(projects/[a-z0-9-]+/secrets/)?[A-Za-z0-9_-]{1,255}(/versions/([0-9]+|latest))?$")]
"""A Secret Manager secret: its id (in launch.vertex.project) or full name, with `/versions/N` or the latest one."""


class VertexSpec(Section):
    """Vertex AI custom training settings for `--target vertex` (engines/vertex/backend.py). The machine comes from
    launch.profile, the scheduling strategy from cost.provisioning (spot, dws-flex-start, reservation)."""

    project: str | None = Field(None, pattern=r"^[a-z][a-z0-9-]{4,28}[a-z0-9]$")
    """Google Cloud project the CustomJob is created in; also expands short `secret_env` names."""
    region: str = Field("us-central1", pattern=r"^[a-z]+-[a-z]+[0-9]+$")
    """Vertex AI region: the API endpoint `<region>-aiplatform.googleapis.com` and where the machines run."""
    output_dir: str | None = Field(None, pattern=r"^gs://[a-z0-9][a-z0-9._-]*[a-z0-9](/[^\s]*)?$")
    """`base_output_directory` (gs://bucket/prefix), required: Vertex mounts it at /gcs/bucket/prefix, the
    container's working directory, so a relative run.dir and its checkpoints live in the bucket."""
    machine_type: str | None = Field(None, pattern=r"^[a-z0-9][a-z0-9-]*$")
    """With launch.profile generic only: the machine type (e.g. g2-standard-24); a GPU profile names its own."""
    accelerator: str | None = Field(None, pattern=r"^[A-Z][A-Z0-9_]*$")
    """With launch.profile generic only: Vertex AI's accelerator type (e.g. NVIDIA_L4), parallel.nproc_per_node
    of them per machine; null: a CPU machine."""
    service_account: str | None = Field(None, pattern=r"^[^@\s]+@[^@\s]+\.iam\.gserviceaccount\.com$")
    """The job runs as this service account (null: Vertex AI's Custom Code Service Agent)."""
    network: str | None = Field(None, pattern=r"^projects/[0-9]+/global/networks/[a-z]([-a-z0-9]*[a-z0-9])?$")
    """VPC the job is peered with (projects/<project number>/global/networks/<name>); null: none."""
    reservation: str | None = Field(None, pattern=r"^projects/[^/\s]+/zones/[^/\s]+/reservations/[^/\s]+$")
    """With cost.provisioning reservation: the reservation's full name (projects/P/zones/Z/reservations/R)."""
    max_run_seconds: int | None = Field(None, ge=60)
    """Scheduling timeout: Vertex stops the job after this long (null: Vertex's default, 7 days)."""
    max_wait_seconds: int | None = Field(None, ge=0)
    """With cost.provisioning dws-flex-start: how long to wait for capacity (0: no limit; null: Vertex's 24 h)."""
    restart_job_on_worker_restart: bool = True
    """Restart every replica when one restarts: a torchrun gang cannot take a rejoining node."""
    secret_env: dict[EnvName, SecretManagerName] = {}
    """Environment variables read from Secret Manager when each replica starts, e.g. HF_TOKEN: hf-token (a
    secret in launch.vertex.project, latest version) or projects/P/secrets/S/versions/V; never values."""


class TpuSpec(Section):
    """TPU slices for train.engine maxtext (engines/tpu/maxtext.py; the chips are in hardware.py's catalogue). A slice
    is `topology` chips of `type` on its hosts; `slices` of them talk over the data-center network (multislice)."""

    type: str = "v6e"
    """TPU generation, a key of hardware.TPU_GENERATIONS (v5e, v5p, v6e: GKE cloud.google.com/gke-tpu-accelerator,
    machine types ct5lp/ct5p/ct6e); checked with train.engine maxtext."""
    topology: str = Field("4x4", pattern=r"^[0-9]+x[0-9]+(x[0-9]+)?$")
    """Chips of one slice: AxB (v5e, v6e) or AxBxC (v5p); GKE cloud.google.com/gke-tpu-topology."""
    slices: int = Field(1, ge=1)
    """Slices in the job (JobSet replicas; MaxText dcn_*_parallelism); launch.nnodes = slices × hosts per slice."""
    min_slices: int | None = Field(None, ge=1)
    """--target rayjob: elastic on spot, the TPU worker group may shrink to this many slices (KubeRay minReplicas);
    None: exactly `slices`."""
    tensor_parallelism: int = Field(1, ge=1)
    """MaxText ici_tensor_parallelism: chips of a slice each layer is split across; the rest of the slice is FSDP."""
    load_parameters_path: str | None = Field(None, pattern=r"^gs://[a-z0-9][a-z0-9._-]*[a-z0-9](/[^\s]*)?$")
    """MaxText (Orbax) checkpoint of model.path's weights, converted once with maxtext.checkpoint_conversion.to_maxtext;
    required with model.path (MaxText does not read Hugging Face safetensors in training)."""


class LaunchSpec(Section):
    nnodes: int = Field(1, ge=1)
    """Nodes in the job; world size = nnodes × parallel.nproc_per_node. Local runs need 1."""
    min_nnodes: int | None = Field(None, ge=1)
    """Elastic jobs: keep training while at least this many of the `nnodes` nodes are up (torchrun
    --nnodes=min:max, c10d rendezvous; each change restarts from the checkpoint). None: exactly nnodes."""
    max_restarts: int = Field(0, ge=0)
    """torchrun --max-restarts: restarts of the worker group after a failure."""
    grace_seconds: int = Field(60, ge=1)
    """After a stop signal, how long workers may take to checkpoint before SIGKILL
    (torchrun --shutdown-timeout; Kubernetes terminationGracePeriodSeconds; Slurm --signal lead time)."""
    hang_timeout_seconds: float | None = Field(None, ge=0)
    """Hang detection (resilience/watchdog.py): when a rank's step or phase makes no progress for this long,
    every rank dumps its Python stacks to logs/stack-rank-<k>.txt, the run names the rank(s) whose heartbeat
    stopped (step, phase, stack top, host), and the workers exit 76 so that torchrun (launch.max_restarts) or
    the engine restarts them from the last checkpoint. Must exceed the slowest step, validation and checkpoint
    save; None or 0: off."""
    image: str | None = None
    """Container image for cluster launches (built from the project's Dockerfile)."""
    image_digest: str | None = Field(None, pattern=r"^sha256:[0-9a-f]{64}$")
    """Pins launch.image by digest: pods run `<image without tag>@<digest>`."""
    profile: Literal["generic", "a3-high", "a3-mega", "a3-ultra", "a4"] = "generic"
    """Machine and network profile (network_profiles.py): NCCL environment, GPU NICs, host libraries."""
    kubernetes: KubernetesSpec = KubernetesSpec()
    slurm: SlurmSpec = SlurmSpec()
    ray: RaySpec = RaySpec()
    vertex: VertexSpec = VertexSpec()
    tpu: TpuSpec = TpuSpec()
    netcheck: NetcheckSpec = NetcheckSpec()
    gpucheck: GpucheckSpec = GpucheckSpec()


Provisioning = Literal["on-demand", "spot", "dws-flex-start", "reservation"]


class ObserveSpec(Section):
    """Metrics endpoint, experiment trackers, the run report and alert thresholds (observe/)."""

    metrics_port: int | None = Field(9405, ge=0, le=65535)
    """Port of the Prometheus endpoint (`/metrics`) that rank 0 serves; 0 picks a free port (printed and
    written to manifest.json as `metrics_url`); null turns it off."""
    metrics_host: str | None = None
    """Address the endpoint binds; null: 127.0.0.1 for a local run, all interfaces (0.0.0.0) in the spec a cluster
    launcher renders, so that the cluster's scraper reaches the pod or node."""
    metrics_linger_s: float = Field(0.0, ge=0, le=600)
    """Keep serving this long after training ends, so that a scrape sees the final values (≥ scrape interval)."""
    report: bool = True
    """Write `<run>/report/` (index.html + PNG plots) when training ends."""
    tensorboard: bool = False
    """Also write the metrics as TensorBoard scalars to `<run>/tensorboard/` (needs `shardline[observe]`)."""
    wandb_project: str | None = None
    """Also log to this Weights & Biases project (needs `pip install wandb`); null: off."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """offline: W&B writes to `<run>/wandb/` only, nothing leaves the machine (`wandb sync` later); online uploads."""
    no_progress_minutes: float = Field(15.0, gt=0)
    """Alert rules (`shardline observe render`): a run that finished no step for this long is stuck."""
    profile_steps: int = Field(0, ge=0, le=100)
    """Record this many training steps (from step 4) with torch.profiler: `<run>/profile/` holds a Chrome trace
    and an ops/phases table per rank; 0: off."""


class CostSpec(Section):
    """Prices for the cost shown by `shardline plan`, step records and the summary (planning/cost.py)."""

    gpu: str | None = None
    """Price-table row (h100, h200, b200, a100, l4, or a row of `prices`); null: the device the run uses."""
    provisioning: Provisioning = "on-demand"
    """How the devices are bought: on-demand | spot | dws-flex-start | reservation (the price-table column)."""
    usd_per_device_hour: float | None = Field(None, ge=0)
    """$ per device-hour, overriding the table; a CPU run is priced only with this (a device is a rank)."""
    prices: dict[str, dict[Provisioning, float]] = {}
    """Overrides or extends the price table, $/GPU-hour: {h100: {spot: 2.9}, my-gpu: {on-demand: 1.5}}."""
    assumed_mfu: float = Field(0.4, gt=0, le=1)
    """MFU `shardline plan` assumes for the projected step time when no measured run is given (--from-run)."""


class JobSections(Section):
    """The sections of a job spec and what follows from them; `JobSpec` adds the cross-field rules."""

    run: RunSpec = RunSpec()
    model: ModelSpec = ModelSpec()
    data: DataSpec = DataSpec()
    train: TrainSpec = TrainSpec()
    parallel: ParallelSpec = ParallelSpec()
    checkpoint: CheckpointSpec = CheckpointSpec()
    launch: LaunchSpec = LaunchSpec()
    observe: ObserveSpec = ObserveSpec()
    cost: CostSpec = CostSpec()

    @property
    def world_size(self) -> int:
        return self.launch.nnodes * (self.parallel.nproc_per_node or 1)

    @property
    def is_elastic(self) -> bool:
        """`launch.min_nnodes` below `launch.nnodes`: the job runs on any node count in between."""
        return self.launch.min_nnodes is not None and self.launch.min_nnodes < self.launch.nnodes

    @property
    def node_counts(self) -> range:
        low = self.launch.min_nnodes if self.is_elastic else self.launch.nnodes
        return range(low, self.launch.nnodes + 1)

    @property
    def allowed_world_sizes(self) -> list[int]:
        return [n * (self.parallel.nproc_per_node or 1) for n in self.node_counts]

    @property
    def grad_accum_steps(self) -> int:
        t = self.train
        return t.global_batch_size // (self.world_size // self.parallel.ranks_per_row * t.micro_batch_size)
