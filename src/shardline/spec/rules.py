"""Cross-field rules of the job spec: combinations that cannot run, caught before any process starts."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from shardline.errors import SpecError
from shardline.hardware import price_table, tpu_slice
from shardline.spec.sections import JobSections, ParallelSpec


def check_combinations(spec: JobSections) -> None:
    check_tpu(spec)  # first: with MaxText the world size is the slices' chips, which the batch rules below divide
    t, a, p = spec.train, spec.model.arch, spec.parallel
    world = spec.world_size
    check_tensor_parallel_degree(spec)
    check_context_parallel_degree(spec)
    check_expert_parallel_degree(spec)
    data_parallel = world // p.ranks_per_row  # tensor- and context-parallel peers train the same rows
    per_step = data_parallel * t.micro_batch_size
    if t.global_batch_size % per_step:
        lower = max(per_step, t.global_batch_size // per_step * per_step)
        raise SpecError(
            "train.global_batch_size",
            f"{t.global_batch_size} is not divisible by {data_parallel_ranks(world, p)} × micro-batch = "
            f"{data_parallel} × {t.micro_batch_size} = {per_step}",
            f"use a multiple of {per_step} (e.g. --set train.global_batch_size={lower}) "
            "or change train.micro_batch_size / parallel.nproc_per_node",
        )
    shard = p.dp_shard or data_parallel // p.dp_replicate
    if p.dp_replicate * shard * p.ranks_per_row != world:
        names = " × ".join(["dp_replicate", "dp_shard", *(["cp"] if p.cp > 1 else []), "tp"])
        values = " × ".join(str(n) for n in [p.dp_replicate, shard, *([p.cp] if p.cp > 1 else []), p.tp])
        raise SpecError(
            "parallel.dp_replicate", f"{names} = {values} does not equal the world size {world} "
            "(launch.nnodes × parallel.nproc_per_node)",
            "choose dp_replicate, dp_shard, cp and tp whose product is the world size (e.g. replicate = nodes, "
            "shard × tp = GPUs per node)",
        )
    if spec.model.path is None:
        if spec.model.random_init:
            raise SpecError("model.random_init", "is true, but model.path is unset: it random-initialises the "
                            "config.json of model.path (a model built from model.arch is always random-initialised)",
                            "point model.path at a directory with config.json, or set model.random_init=false")
        if a.hidden_size % a.num_heads:
            raise SpecError(
                "model.arch.hidden_size",
                f"{a.hidden_size} is not divisible by model.arch.num_heads={a.num_heads}",
                "pick a hidden size that is a multiple of the head count",
            )
        if a.num_heads % p.tp or a.num_kv_heads % p.tp:
            raise SpecError(
                "parallel.tp", f"{p.tp} does not divide model.arch.num_heads={a.num_heads} and num_kv_heads="
                f"{a.num_kv_heads}: each rank must hold whole heads", "choose a tp that divides both head counts")
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
    trained_tokenizer = spec.model.path is None and spec.model.tokenizer is None
    chat_sources = [f"data.sources[{i}].prompt_format" for i, s in enumerate(spec.data.sources)
                    if s.prompt_format == "chat"]
    for field in (["data.prompt_format"] if spec.data.prompt_format == "chat" else []) + chat_sources:
        if trained_tokenizer and spec.data.chat_template is None:
            raise SpecError(
                field,
                "'chat' needs a tokenizer with a chat template, but no model.path or model.tokenizer is set",
                "use data.prompt_format=auto or plain with the trained tokenizer, point model.tokenizer at one, or "
                "name a template that needs no special tokens (data.chat_template=alpaca)",
            )
    check_data_sources(spec)
    check_base_quantization(spec)
    check_float8(spec)
    check_objective(spec)
    # Installed packages (flash-attn, trackers) are checked where training starts: shardline/environment.py.
    w = spec.observe.wandb_project
    if w is not None and not w.strip():
        raise SpecError("observe.wandb_project", "is empty", "name a W&B project, or use null to turn W&B off")
    check_cost(spec)
    check_elastic(spec)
    check_hang_timeout(spec)


FLEX_BLOCK = 128
"""flex attention's block size: torch's context-parallel block mask needs rows of a multiple of cp × this."""
MIN_HANG_TIMEOUT_S = 5.0  # below this, a slow step on a busy host reads as a hang
MAX_HANG_TIMEOUT_S = 1800.0  # the collective timeout (parallel.mesh): past it, gloo/NCCL fail first


def data_parallel_ranks(world: int, p: ParallelSpec) -> str:
    """What the global batch is split over, as the batch errors name it."""
    degrees = " × ".join(f"parallel.{name} {n}" for name, n in (("tp", p.tp), ("cp", p.cp)) if n > 1)
    return f"data-parallel ranks (world size {world} ÷ {degrees})" if degrees else "world size"


def check_context_parallel_degree(spec: JobSections) -> None:
    """cp splits rows into load-balanced chunks flex attention's block mask can cover; what it composes with."""
    p, t = spec.parallel, spec.train
    if p.cp == 1:
        return
    if p.tp > 1:
        raise SpecError("parallel.cp", f"{p.cp} with parallel.tp={p.tp}: context parallel does not compose with "
                        "tensor parallel's sequence-parallel shards yet", "use one of them: tp inside a node for "
                        "wide models, cp for long rows")
    if spec.world_size % p.cp:
        raise SpecError("parallel.cp", f"{p.cp} does not divide the world size {spec.world_size}",
                        "choose a cp that divides launch.nnodes × parallel.nproc_per_node")
    if t.seq_len % (p.cp * FLEX_BLOCK):
        raise SpecError("train.seq_len", f"{t.seq_len} is not a multiple of parallel.cp × {FLEX_BLOCK} = "
                        f"{p.cp * FLEX_BLOCK}: context parallel splits each row into 2 × cp load-balanced chunks "
                        f"and flex attention's block mask into {FLEX_BLOCK}-token blocks",
                        f"use a seq_len that is a multiple of {p.cp * FLEX_BLOCK}")
    if spec.model.attn_implementation != "sdpa":
        raise SpecError("model.attn_implementation", f"is {spec.model.attn_implementation}, but parallel.cp="
                        f"{p.cp} runs shardline's document attention", "set model.attn_implementation=sdpa")


def check_expert_parallel_degree(spec: JobSections) -> None:
    """ep borrows ranks from dp_shard; what it does not compose with (yet) is named. That the model has experts
    and ep divides their number is checked on its config (`shardline.parallel.expert.check_expert_parallel`)."""
    p = spec.parallel
    if p.ep == 1:
        return
    others = {"parallel.tp": p.tp > 1, "parallel.cp": p.cp > 1, "parallel.compile": p.compile,
              "parallel.offload": p.offload,
              "model.lora.quantize_base": spec.model.lora.enabled and spec.model.lora.quantize_base != "none"}
    for field, on in others.items():
        if on:
            raise SpecError("parallel.ep", f"{p.ep} with {field}: expert parallel composes with FSDP and HSDP so "
                            "far (tensor and context parallel split the tokens a MoE layer dispatches; compile, "
                            "offload and a quantized base are not built with it yet)",
                            f"set parallel.ep=1, or leave {field} at its default")
    shard = p.dp_shard or spec.world_size // (p.dp_replicate * p.ranks_per_row)
    if shard % p.ep:
        raise SpecError("parallel.ep", f"{p.ep} does not divide the {shard} data-parallel shard ranks it borrows "
                        "from", f"choose an ep that divides {shard} (launch.nnodes × parallel.nproc_per_node)")


def check_tensor_parallel_degree(spec: JobSections) -> None:
    """tp splits a node's GPUs (its collectives run every layer: never across nodes) and the world."""
    p, world = spec.parallel, spec.world_size
    if p.async_tp and (p.tp == 1 or not p.compile):
        raise SpecError("parallel.async_tp", f"needs tensor parallel and compiled blocks (tp={p.tp}, compile="
                        f"{str(p.compile).lower()}): torch's compiler does the overlap",
                        "set parallel.tp > 1 and parallel.compile=true, or parallel.async_tp=false")
    if p.tp == 1:
        return
    per_node = p.nproc_per_node
    if per_node is not None and per_node % p.tp:
        raise SpecError("parallel.tp", f"{p.tp} does not divide parallel.nproc_per_node={per_node}: a "
                        "tensor-parallel group must sit inside one node (it communicates in every layer)",
                        f"choose a tp that divides {per_node} (typically the node's GPU count, e.g. 8)")
    if world % p.tp:
        raise SpecError("parallel.tp", f"{p.tp} does not divide the world size {world}",
                        "choose a tp that divides launch.nnodes × parallel.nproc_per_node")
    lora = spec.model.lora
    if lora.enabled and any(t.split(".")[-1] == "lm_head" for t in lora.target_modules or []):
        raise SpecError("model.lora.target_modules", f"includes lm_head with parallel.tp={p.tp}: under tensor "
                        "parallel the head is split over the vocabulary, and a LoRA factor on a split head is not "
                        "built", "drop lm_head from the targets (or train with tp=1; the head can be trained fully "
                        "with LoRA off)")


def check_base_quantization(spec: JobSections) -> None:
    """`model.lora.quantize_base: nf4` (QLoRA) quantizes the frozen base of a LoRA run; its NF4 weights stay whole
    on every rank, outside FSDP (shardline.model.nf4): layouts that split or move parameters cannot hold them."""
    lora, p = spec.model.lora, spec.parallel
    if lora.quantize_base == "none":
        return
    if not lora.enabled:
        raise SpecError("model.lora.quantize_base", f"is {lora.quantize_base}, but model.lora.enabled is false: only "
                        "a frozen base is quantized (a full fine-tune updates every weight)",
                        "set model.lora.enabled=true, or model.lora.quantize_base=none")
    if p.tp > 1:
        raise SpecError("model.lora.quantize_base", f"is {lora.quantize_base} with parallel.tp={p.tp}: tensor "
                        "parallel splits each projection over its ranks, and an NF4 weight is quantized and held "
                        "whole (its blocks and scales span the whole tensor)", "use parallel.tp=1 (QLoRA's base is "
                        "4× smaller: FSDP alone usually fits), or model.lora.quantize_base=none")
    if p.offload:
        raise SpecError("model.lora.quantize_base", f"is {lora.quantize_base} with parallel.offload=true: offload "
                        "moves FSDP's shards to host memory, but NF4 weights stay outside FSDP, on the device",
                        "use parallel.offload=false (the NF4 base takes 0.52 bytes per parameter), or "
                        "model.lora.quantize_base=none")


def check_float8(spec: JobSections) -> None:
    """`train.float8` (shardline.model.float8): a full fine-tune of the torch engine in bf16, without tensor
    parallel."""
    t, p, lora = spec.train, spec.parallel, spec.model.lora
    if t.float8 == "none":
        return
    if t.precision == "fp32":
        raise SpecError("train.float8", f"is {t.float8} with train.precision=fp32: float8 training keeps everything "
                        "but the block linears in bf16", "set train.precision=bf16 (or auto), or train.float8=none")
    if lora.enabled:
        raise SpecError("train.float8", f"is {t.float8} with model.lora.enabled=true: LoRA's frozen base would be "
                        "re-cast to float8 every step for a handful of adapter FLOPs, and the adapters' small matmuls "
                        "gain nothing from float8", "set train.float8=none for LoRA (or model.lora.quantize_base=nf4 "
                        "for a smaller base), or train.float8 with a full fine-tune")
    if p.tp > 1:
        raise SpecError("train.float8", f"is {t.float8} with parallel.tp={p.tp}: shardline's tensor-parallel plans "
                        "are written for plain linears, and torchao's float8 linears under them are not tested here "
                        "(torchtitan gives them float8 parallel styles of their own)",
                        "use parallel.tp=1 (FSDP alone) with float8, or train.float8=none")
    if t.engine != "torch":
        raise SpecError("train.float8", f"is {t.float8} with train.engine={t.engine}: float8 training is torchao's, "
                        "on the torch engine", "set train.float8=none (MaxText has its own quantization settings)")


def check_objective(spec: JobSections) -> None:
    """`train.objective: dpo | grpo` on the torch engine, each pair or completion whole on one rank; DPO trains
    preference rows, GRPO prompts a reward can score."""
    t, p = spec.train, spec.parallel
    if t.objective == "sft":
        return
    where = "train.objective"
    if t.engine != "torch":
        raise SpecError(where, f"is {t.objective} with train.engine={t.engine}: MaxText trains next-token loss only",
                        "use train.engine=torch (GPUs or CPU) for preference optimisation and GRPO")
    if spec.data.task == "random_tokens":
        raise SpecError(where, f"is {t.objective}, but data.task=random_tokens has no prompts or completions",
                        "use your own data (data.path) or the generated text-to-SQL set (data.task=text_to_sql)")
    if p.cp > 1 or p.tp > 1:
        name, degree = ("parallel.cp", p.cp) if p.cp > 1 else ("parallel.tp", p.tp)
        raise SpecError(where, f"is {t.objective} with {name}={degree}: shardline sums each completion's "
                        "log-probabilities on the rank that holds the whole row, which tensor and context parallel "
                        "split", f"use {name}=1 (FSDP shards the model; LoRA keeps the memory near SFT's)")
    if t.objective == "dpo":
        _check_dpo(spec)
    else:
        _check_grpo(spec)


def _check_dpo(spec: JobSections) -> None:
    t = spec.train
    formats = {spec.data.format, *(s.format for s in spec.data.sources)} - {"auto", "preference"}
    if formats:
        raise SpecError("data.format", f"is {sorted(formats)[0]} with train.objective={t.objective}, which trains "
                        "(prompt, chosen, rejected) pairs", "use data.format=preference (or auto) with preference "
                        "rows, or train.objective=sft for these rows")
    if t.dpo.reference == "adapters_off" and not spec.model.lora.enabled:
        raise SpecError("train.dpo.reference", "is adapters_off, but model.lora.enabled is false: a full fine-tune "
                        "has no adapters to turn off, and its weights move away from the reference",
                        "use train.dpo.reference=precomputed (or auto), or enable LoRA")


def _check_grpo(spec: JobSections) -> None:
    t, g = spec.train, spec.train.grpo
    if "text" in {spec.data.format, *(s.format for s in spec.data.sources)}:
        raise SpecError("data.format", "is text with train.objective=grpo: raw text asks nothing to sample "
                        "completions for", "use rows with prompts (prompt/completion, messages, or question/answer)")
    if g.reward == "auto" and spec.data.task == "none":
        raise SpecError("train.grpo.reward", "is auto with data.task=none: your data has no built-in reward",
                        "name your reward function, train.grpo.reward=my_module:my_reward (called with prompts, "
                        "completions and the rows' columns), or use data.task=text_to_sql")
    groups = g.num_generations * spec.world_size  # every rank samples whole groups of its own prompts
    if t.global_batch_size % groups:
        raise SpecError("train.global_batch_size", f"is {t.global_batch_size} completions, not a multiple of "
                        f"train.grpo.num_generations × ranks = {g.num_generations} × {spec.world_size}: each rank "
                        "samples whole groups of completions of its own prompts", f"use a multiple of {groups}")
    mu = g.num_iterations
    for field, value in (("train.max_steps", t.max_steps), ("checkpoint.every_steps", spec.checkpoint.every_steps)):
        if value and value % mu:
            raise SpecError(field, f"is {value}, not a multiple of train.grpo.num_iterations={mu}: a checkpoint "
                            "between two samplings could not be resumed exactly (the sampled batch and its "
                            "sampling-time log-probabilities are not in it)", f"use a multiple of {mu}")
    if g.max_new_tokens >= t.seq_len:
        raise SpecError("train.grpo.max_new_tokens", f"is {g.max_new_tokens}, not below train.seq_len={t.seq_len}: "
                        "a prompt and its completion are trained in one row", "raise train.seq_len or lower "
                        "train.grpo.max_new_tokens")


def require_torch_engine(spec: JobSections, runner: str) -> None:
    """`runner` (a torch target, the worker) starts shardline's PyTorch worker: a MaxText (TPU) spec is refused."""
    if spec.train.engine != "torch":
        raise SpecError("train.engine", f"is {spec.train.engine}, which {runner} cannot run (it starts shardline's "
                        "PyTorch worker)", "use --target jobset or rayjob for MaxText on TPU slices, or "
                        "train.engine=torch")


def check_hang_timeout(spec: JobSections) -> None:
    t = spec.launch.hang_timeout_seconds
    if t and not MIN_HANG_TIMEOUT_S <= t < MAX_HANG_TIMEOUT_S:
        raise SpecError("launch.hang_timeout_seconds", f"{t:g} is outside [{MIN_HANG_TIMEOUT_S:g}, "
                        f"{MAX_HANG_TIMEOUT_S:g}) seconds",
                        "use more than the slowest step, validation or checkpoint save (e.g. 600), "
                        "less than the 1800 s collective timeout, or 0/null to turn hang detection off")


def check_elastic(spec: JobSections) -> None:
    lo, hi = spec.launch.min_nnodes, spec.launch.nnodes
    if lo is None:
        return
    if lo > hi:
        raise SpecError("launch.min_nnodes", f"{lo} is more than launch.nnodes={hi}",
                        f"use a value from 1 to {hi} (nnodes is the most nodes the job runs on)")
    p = spec.parallel
    if lo < hi and (p.dp_replicate != 1 or p.dp_shard is not None):
        raise SpecError("parallel.dp_replicate", "HSDP fixes the world size, but launch.min_nnodes lets it change",
                        "use plain FSDP (dp_replicate 1, dp_shard null) for elastic jobs")
    nproc = p.nproc_per_node or 1
    check_batch_divides(spec, spec.allowed_world_sizes,
                        lambda world: f"for {world // nproc} nodes, a size this elastic job may run at",
                        "make it a multiple of every world size from launch.min_nnodes to launch.nnodes")


def check_batch_divides(spec: JobSections, worlds: Iterable[int], why: Callable[[int], str], fix: str) -> None:
    """The global batch splits into whole micro-batches on every world size in `worlds`; `why(world)` says why
    the job may run at that size."""
    t, p = spec.train, spec.parallel
    for world in worlds:
        if t.global_batch_size % (world // p.ranks_per_row * t.micro_batch_size):
            raise SpecError("train.global_batch_size", f"{t.global_batch_size} is not divisible by "
                            f"{data_parallel_ranks(world, p)} × micro-batch = {world // p.ranks_per_row} × "
                            f"{t.micro_batch_size} "
                            f"{why(world)}", fix)


def check_cost(spec: JobSections) -> None:
    """Rules of the `cost` section: prices are not negative; a named GPU has a price for its provisioning."""
    c = spec.cost
    for gpu, row in c.prices.items():
        for provisioning, usd in row.items():
            if usd < 0:
                raise SpecError(f"cost.prices.{gpu}.{provisioning}", f"{usd} is negative",
                                "give the price of one GPU-hour in US dollars (≥ 0)")
    if c.usd_per_device_hour is None and c.gpu is not None:
        table = price_table(c.prices)
        gpu = c.gpu.lower()
        if gpu not in table:
            raise SpecError("cost.gpu", f"{c.gpu!r} is not in the price table",
                            f"use one of {', '.join(table)}, add its prices under cost.prices.{gpu}, "
                            "or set cost.usd_per_device_hour")
        if c.provisioning not in table[gpu]:
            raise SpecError("cost.provisioning", f"no {c.provisioning} price for {gpu}",
                            f"add cost.prices.{gpu}.{c.provisioning} or choose one of {', '.join(table[gpu])}")


def check_tpu(spec: JobSections) -> None:
    """train.engine maxtext: launch.tpu names real slices, and nodes × processes are exactly their hosts × chips, so
    that the world size every other rule (and `plan`, and cost) uses is the number of chips."""
    if spec.train.engine != "maxtext":
        return
    tp, launch = spec.launch.tpu, spec.launch
    try:
        sl = tpu_slice(tp.type, tp.topology)
    except ValueError as e:
        field = "launch.tpu.type" if "unknown TPU type" in str(e) else "launch.tpu.topology"
        raise SpecError(field, str(e), "use a topology GKE offers for the type, e.g. v6e 4x4, "
                        "v5e 2x4, v5p 2x2x4") from None
    if spec.parallel.nproc_per_node != sl.chips_per_host:
        raise SpecError("parallel.nproc_per_node", f"is {spec.parallel.nproc_per_node}, but a {tp.type} {tp.topology} "
                        f"host has {sl.chips_per_host} chips (one JAX process per host drives them all)",
                        f"set parallel.nproc_per_node={sl.chips_per_host}")
    if launch.nnodes != tp.slices * sl.hosts:
        raise SpecError("launch.nnodes", f"is {launch.nnodes}, but {tp.slices} slice(s) of {tp.type} {tp.topology} "
                        f"have {tp.slices * sl.hosts} hosts ({sl.hosts} per slice)",
                        f"set launch.nnodes={tp.slices * sl.hosts}, or change launch.tpu.slices")
    if sl.chips % tp.tensor_parallelism:
        raise SpecError("launch.tpu.tensor_parallelism", f"{tp.tensor_parallelism} does not divide the {sl.chips} "
                        f"chips of a {tp.topology} slice", "use a divisor of the slice's chip count (1, 2, 4, …)")
    if tp.min_slices is not None and tp.min_slices > tp.slices:
        raise SpecError("launch.tpu.min_slices", f"{tp.min_slices} is more than launch.tpu.slices={tp.slices}",
                        f"use a value from 1 to {tp.slices}")
    if launch.min_nnodes is not None:
        raise SpecError("launch.min_nnodes", "is torchrun's elastic node range; a TPU job grows and shrinks by "
                        "whole slices", "unset launch.min_nnodes and use launch.tpu.min_slices (--target rayjob)")


def check_data_sources(spec: JobSections) -> None:
    d = spec.data
    if d.task == "random_tokens" and (d.path is not None or d.sources):
        raise SpecError("data.task", "random_tokens draws its own rows and reads no data, but data.path or "
                        "data.sources is set", "unset data.path and data.sources, or choose another data.task")
    if d.sources and (d.path is not None or d.format != "auto" or d.columns != type(d.columns)()):
        raise SpecError("data.sources", "is set together with data.path/format/columns, which describe one source",
                        "move the path, format and columns into the entries of data.sources, or use data.path alone")
    names = [s.name for s in d.sources if s.name]
    if len(set(names)) != len(names):
        raise SpecError("data.sources", f"names a source twice ({names})", "give each source its own name")
