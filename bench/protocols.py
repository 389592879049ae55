"""The peers' published benchmark protocols, run through the real trainer (`shardline train`) on random-token rows
(`data.task: random_tokens`: one document of `train.seq_len` random ids per row, every token a target).

  A  NeMo AutoModel's Llama-3.1-8B LoRA on one GPU (its docs/performance-summary.mdx: 12,473 tok/s/GPU on an H100;
     recipe examples/llm_benchmark/llama3_1/llama3_1_8b_peft_benchmark.yaml): seq 4096, micro-batch 2, global
     batch 32, LoRA r16 α32 on every *_proj, bf16 weights, 10 steps of which the first 5 are excluded.
  B  torchtitan's Llama-3-8B full training: FSDP, local batch 2 × 8192, selective activation checkpointing,
     per-block torch.compile, 10 steps of which the first 5 are excluded.

    python bench/protocols.py A|B [--size full|small] [--shapes llama-3.1-8b|qwen2.5-7b] [--nproc N] [--model DIR]
                              [--out DIR] [--baseline hf|hf-checkpointed|bf16-base] [--set KEY=VALUE]...

`full`: Llama-3.1-8B's shapes (random weights, or --model DIR for a real checkpoint) on GPUs; `--shapes qwen2.5-7b`
Qwen2.5-7B's instead (NeMo AutoModel publishes 14,110 tok/s/GPU for it under protocol A on one H100): transformers'
own Qwen2 model (q/k/v biases) built from a config.json written here, random weights (`model.random_init`: no weights
travel to a lent GPU). `small`: the same protocol on a 4-layer model of the family at 1/32 of the sequence, which a
CPU runs in a minute (tests/bench/test_protocols.py runs both in CI). Prints and writes (OUT/protocol-X.json) tok/s
per device over the measured steps, MFU by shardline's formula (the run's own FLOPs per token) and by torchtitan's
(6·N + 12·L·H·D·S per token, N without embeddings), peak memory (and the planner's), startup apart from the steps,
and the versions. NeMo AutoModel publishes tok/s/GPU, the number protocol A compares; its TFLOP/s formula is not
reproduced here. Numbers are compared only with a baseline run on the same machine (bench/RESULTS-gpu.md):
`--baseline hf` trains HF `Trainer` (+ peft's LoRA for A; in bench/hf_baseline.py) on the same model, initial weights
and rows in shardline's order, one process, and reports both rates, the ratio and both first losses (equal in fp32:
the same work). HF has no selective checkpointing: for B it checkpoints whole blocks and compiles the whole model
(`torch_compile`); `--baseline hf-checkpointed` checkpoints whole blocks for A too (HF Trainer + peft does not fit
protocol A on an 80 GB H100 without it). `--baseline bf16-base` is QLoRA's: with `--set model.lora.quantize_base=nf4`
it trains the same protocol again on a bf16 base in the same call and sets the two peaks beside the planner's NF4
dequantization transient (`qlora_memory`). A baseline that fails (out of memory, say) is recorded in the result with
its last error line, and the command exits 1.

Start-up (`startup`): from the command to the first step's start, by part — the launcher (CLI, run directory,
data, torchrun), the worker's own laps (`start-up:` in its log: imports and spec, process group, run directory,
data, tokenizer, model on meta, parallelize, weights, …), setup to the first step — and the first step's excess over
the median step apart (compile warm-up when compiled).

A profiled run (`--set observe.profile_steps=N`) keeps its rank-0 ops table and gzipped Chrome trace in OUT and
writes where the profiled steps' time goes into its result (`profile_breakdown`: attention, matmuls, LoRA's matmuls,
optimizer, communication, other, host gaps, in ms a step and % — bench/profile_breakdown.py).

The run is stopped once its last step is recorded: its final checkpoint, which no protocol times (two minutes for
a 3.9B-parameter full fine-tune's weights and AdamW state on a GPU host's disk), is not waited for.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LLAMA_3_1_8B = {"model.arch.vocab_size": 128256, "model.arch.hidden_size": 4096,
                "model.arch.intermediate_size": 14336, "model.arch.num_layers": 32, "model.arch.num_heads": 32,
                "model.arch.num_kv_heads": 8, "model.arch.max_position_embeddings": 8192,
                "model.arch.rope_theta": 500000.0}
SMALL = {"model.arch.vocab_size": 2048, "model.arch.hidden_size": 256, "model.arch.intermediate_size": 688,
         "model.arch.num_layers": 4, "model.arch.num_heads": 4, "model.arch.num_kv_heads": 2,
         "model.arch.max_position_embeddings": 1024, "model.arch.rope_theta": 500000.0}
QWEN2_5_7B = {"vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
              "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 32768,
              "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "rms_norm_eps": 1e-6,
              "tie_word_embeddings": False, "use_sliding_window": False}
"""Qwen2.5-7B's config.json as published (Qwen/Qwen2.5-7B; head_dim 3584 / 28 = 128), for `--shapes qwen2.5-7b`."""
SMALL_QWEN2 = {**QWEN2_5_7B, "vocab_size": 2048, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
               "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024}
SHAPES = ("llama-3.1-8b", "qwen2.5-7b")
STEPS, WARMUP_STEPS = 10, 5
EVERY_PROJ = "[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"


def child_env() -> dict[str, str]:
    """This environment without a torch.distributed job's variables: the runs below start their own."""
    job = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
    return {k: v for k, v in os.environ.items() if k not in job and not k.startswith("TORCHELASTIC_")}


RUN_MARK = "SHARDLINE_PROTOCOL_RUN"  # in the environment of every process of one protocol run


def _last_step(runs: Path) -> int:
    """The highest training step the run under `runs` has recorded so far (0 before its first)."""
    last = 0
    for metrics in runs.glob("*/metrics.jsonl"):
        for line in metrics.read_text().splitlines():
            if '"kind": "train"' in line:
                with contextlib.suppress(ValueError, KeyError):  # a line being written
                    last = max(last, json.loads(line)["step"])
    return last


def _kill_marked(mark: str) -> None:
    """SIGKILL every process whose environment carries `RUN_MARK=mark`: torchrun starts its workers in sessions
    of their own, so the launcher's process group does not reach them."""
    needle = f"{RUN_MARK}={mark}".encode()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                if needle in (proc / "environ").read_bytes().split(b"\0"):
                    os.kill(int(proc.name), signal.SIGKILL)
            except (OSError, ValueError):  # gone, or not ours to read
                pass


def run_until_last_step(cmd: list[str], log: Path, runs: Path, steps: int, env: dict[str, str] | None = None) -> int:
    """Run the trainer (its output into `log`, `env` added to its environment) until it exits or has recorded step
    `steps`; then stop it."""
    mark = f"{os.getpid()}-{time.monotonic_ns()}"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                env={**child_env(), **(env or {}), RUN_MARK: mark})
        while proc.poll() is None:
            if _last_step(runs) >= steps:
                _kill_marked(mark)
                proc.wait()
                return 0
            time.sleep(0.5)
    return proc.returncode


def keep_profile(run: Path, out: Path, protocol: str, sets: dict) -> dict | None:
    """A profiled run's (`--set observe.profile_steps=N`) rank-0 ops table and gzipped Chrome trace, kept in `out`
    before the run's temporary directory goes; returns where the profiled steps' time goes
    (bench/profile_breakdown.py, LoRA's matmuls apart by the run's rank), None without a trace. A trace that cannot
    be read is recorded as such (`failed`): the run's own numbers are not lost to it."""
    profile = run / "profile"
    if (table := profile / "ops-rank-0.txt").exists():
        shutil.copyfile(table, out / f"protocol-{protocol}-ops.txt")
    if not (trace := profile / "trace-rank-0.json").exists():
        return None
    with open(trace, "rb") as src, gzip.open(out / f"protocol-{protocol}-trace.json.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    lora = str(sets.get("model.lora.enabled", "false")).lower() == "true"
    try:  # the spec's default rank where the protocol names none
        return _breakdown_module().breakdown_file(trace, int(sets.get("model.lora.r", 16)) if lora else None)
    except Exception as e:  # noqa: BLE001 - a window's run outweighs its profile
        return {"failed": f"{type(e).__name__}: {e}"}


def _breakdown_module():
    """bench/profile_breakdown.py, a script beside this one (bench/ is no package): loaded by path, under the name
    tests/conftest.py's bench_module gives it (a dataclass needs its module in sys.modules)."""
    name = "bench_profile_breakdown"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("profile_breakdown.py"))
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def config_only_model(shapes: str, size: str, where: Path) -> Path:
    """A directory holding `shapes`' config.json at `size` (transformers' own config class) and a byte-level BPE
    (random-token rows only draw ids), no weights: the trainer random-initialises it (`model.random_init`)."""
    from transformers import Qwen2Config

    if shapes != "qwen2.5-7b":
        raise ValueError(f"no config-only model for {shapes!r}: {SHAPES[0]} is built from model.arch")
    return write_config_only(Qwen2Config(**(QWEN2_5_7B if size == "full" else SMALL_QWEN2)), where)


def write_config_only(config, where: Path) -> Path:
    """`config` (a transformers config) saved in `where` with a byte-level BPE of its vocabulary size, no weights."""
    from shardline.data.prepare import BPE_SEED_TEXT
    from shardline.data.tokenizer import train_bpe

    where.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(where)
    train_bpe([BPE_SEED_TEXT], config.vocab_size).save_pretrained(where)
    return where


def measured_run_sets(size: str, nproc: int, seq: int) -> dict[str, object]:
    """What every protocol run sets beside its model and batch: random-token rows of `seq` tokens, STEPS steps each
    logged, no evaluation, checkpoint, metrics port or report; bf16 at full size, fp32 at small (the same numbers on
    every CPU class)."""
    return {"data.task": "random_tokens", "data.validation_size": 1, "train.seq_len": seq,
            "train.max_steps": STEPS, "train.warmup_steps": 0, "train.log_every": 1, "train.eval_every": 10_000,
            "train.eval_examples": 0, "train.sample_generations": 0, "parallel.nproc_per_node": nproc,
            "checkpoint.every_steps": 10_000, "observe.metrics_port": "null", "observe.report": "false",
            "train.precision": "bf16" if size == "full" else "fp32"}


def protocol_sets(protocol: str, size: str, nproc: int, model: str | None,
                  random_init: bool = False) -> dict[str, object]:
    """The spec overrides of a protocol at a size (`small` divides the sequence by 32, keeps batch and steps);
    `model`: a checkpoint directory (`random_init`: a config-only one) instead of Llama-3.1-8B's `model.arch`."""
    seq = {"A": 4096, "B": 8192}[protocol] // (32 if size == "small" else 1)
    sets: dict[str, object] = dict(SMALL if size == "small" else LLAMA_3_1_8B)
    if model:
        sets = {"model.path": model} | ({"model.random_init": "true"} if random_init else {})
    sets |= measured_run_sets(size, nproc, seq)
    if protocol == "A":
        sets |= {"train.micro_batch_size": 2, "train.global_batch_size": 32, "model.lora.enabled": "true",
                 "model.lora.r": 16, "model.lora.alpha": 32, "model.lora.target_modules": EVERY_PROJ,
                 "data.train_size": 32 * STEPS}
    else:
        sets |= {"train.micro_batch_size": 2, "train.global_batch_size": 2 * nproc,
                 "parallel.activation_checkpointing": "selective", "parallel.compile": "true",
                 "data.train_size": 2 * nproc * STEPS}
    return sets


def torchtitan_flops_per_token(setup: dict, seq: int, layers: int, heads: int, head_dim: int) -> float:
    """torchtitan's `get_num_flop_per_token`: 6·(parameters without embeddings) + 12·L·H·D·S; of a mixture's routed
    experts only the top-k of E a token runs through (torchtitan's active parameters)."""
    params = setup["params"]
    inactive = (1 - params.get("active_experts", 1.0)) * (params.get("experts_trainable", 0)
                                                          + params.get("experts_frozen", 0))
    return 6 * (params["trainable"] + params["frozen"] - inactive) + 12 * layers * heads * head_dim * seq


CONFIG_KEYS = {"vocab_size": "vocab_size", "hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
               "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
               "num_kv_heads": "num_key_value_heads"}
"""`model.arch` field → config.json key."""


def model_shape(sets: dict) -> dict:
    """The protocol's model shape in `model.arch`'s names, with its family and head dim: its arch, or the config.json
    of `model.path` (a checkpoint's, or a config-only directory's)."""
    if "model.path" in sets:
        config = json.loads((Path(str(sets["model.path"])) / "config.json").read_text())
        config = config.get("text_config", config)
        shape = {field: config[key] for field, key in CONFIG_KEYS.items()} | {"family": config["model_type"]}
        head_dim = config.get("head_dim")
    else:
        shape = {field: int(sets[f"model.arch.{field}"]) for field in CONFIG_KEYS} | {"family": "llama"}
        head_dim = None
    return shape | {"head_dim": head_dim or shape["hidden_size"] // shape["num_heads"]}


def _shape(sets: dict) -> tuple[int, int, int]:
    """(layers, attention heads, head dim) of the protocol's model."""
    shape = model_shape(sets)
    return shape["num_layers"], shape["num_heads"], shape["head_dim"]


def startup(records: list[dict], started: float) -> dict:
    """Where the seconds before the first step go (the command started at `started`, epoch seconds): the launcher
    (CLI, run directory, data, torchrun) to the worker's process start, the worker's laps (its `start-up:` line),
    setup to the first step's start, and the first step's excess over the median measured step apart (first-call
    costs: the compile warm-up when compiled, kernel selection and allocator growth when eager)."""
    setup = next(r for r in records if r["kind"] == "event" and r["event"] == "setup")
    steps = [r for r in records if r["kind"] == "train"]
    first = steps[0]
    first_start = first["time"] - first["step_time_s"]
    median = statistics.median(r["step_time_s"] for r in steps if r["step"] > WARMUP_STEPS)
    process_start = setup.get("process_start")
    return {"to_first_step_s": round(first_start - started, 2),
            "launcher_s": round(process_start - started, 2) if process_start else None,
            "worker_s": setup.get("startup_s"),
            "worker_prepare_s": setup.get("prepare_s"),
            "setup_to_first_step_s": round(first_start - setup["time"], 2),
            "first_batch_s": round(first["data_wait_s"], 3),
            "first_step_s": round(first["step_time_s"], 2),
            "first_step_warmup_s": round(first["step_time_s"] - median, 2)}


def summarize(run: Path, sets: dict, started: float) -> dict:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    setup = next(r for r in records if r["kind"] == "event" and r["event"] == "setup")
    steps = [r for r in records if r["kind"] == "train"]
    measured = [r for r in steps if r["step"] > WARMUP_STEPS]
    tok_s = statistics.mean(r["tokens_per_s_per_device"] for r in measured)
    layers, heads, head_dim = _shape(sets)
    titan = torchtitan_flops_per_token(setup, int(sets["train.seq_len"]), layers, heads, head_dim)
    return {
        "tokens_per_s_per_device": round(tok_s, 1),
        "mfu_shardline": round(statistics.mean(r["mfu"] for r in measured), 4),
        "mfu_torchtitan_formula": round(tok_s * titan / 1e12 / setup["peak_tflops"], 4),
        "step_time_s": round(statistics.median(r["step_time_s"] for r in measured), 4),
        "peak_memory_gib": round(max(r["mem_peak_bytes"] for r in steps) / 2**30, 3),
        "planned_peak_gib": round(setup["planned_peak_bytes"] / 2**30, 3) if setup.get("planned_peak_bytes") else None,
        "startup_s": round(setup["time"] - started, 1),
        "startup_parts_s": setup.get("startup_s"),  # the worker's own laps (imports, weights, …)
        "startup": startup(records, started),
        "model_shape": model_shape(sets),
        "steps_measured": [r["step"] for r in measured],
        "tokens_per_step": steps[-1]["tokens_total"], "loss_tokens_per_step": steps[-1]["tokens"],
        "first_loss": steps[0]["loss"],
        "peak_tflops": setup["peak_tflops"], "peak_source": setup["peak_source"],
        "flops_per_token_shardline": setup["flops_per_token"], "flops_per_token_torchtitan": titan,
        "world": setup["world"], "params": setup["params"],
    }


def versions() -> dict:
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "python": sys.version.split()[0],
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}


def qlora_memory(run: Path, nf4: dict, bf16: dict) -> dict:
    """QLoRA's peak against the bf16 base's (the same protocol, one call) and the planner's terms for it: the base
    bytes NF4 saves (torchao's layout, exact) and the dequantization transient (one whole weight at a time).
    `implied_transient_gib`: the saving less the measured peak difference, i.e. what the QLoRA peak holds beyond its
    smaller base — the transient, where both peaks fall at the same moment of the step."""
    from shardline.model.nf4_layout import nf4_bytes
    from shardline.planning.memory import model_shape as planned_shape
    from shardline.planning.memory import nf4_block_weights, nf4_dequantize_bytes
    from shardline.spec.resolve import load_spec

    spec = load_spec(str(run / "spec.yaml"))
    c = 2 if spec.train.precision == "bf16" else 4
    shape = planned_shape(spec.model)
    weights = nf4_block_weights(shape, spec.model.lora)
    saving = shape.layers * sum(c * n - nf4_bytes(n, c) for n in weights) / 2**30
    measured = bf16["peak_memory_gib"] - nf4["peak_memory_gib"]
    planned = (bf16["planned_peak_gib"] - nf4["planned_peak_gib"]) if bf16["planned_peak_gib"] else None
    return {"nf4_weights": shape.layers * len(weights),
            "planned_base_saving_gib": round(saving, 3),
            "planned_dequantize_transient_gib": round(nf4_dequantize_bytes(max(weights, default=0), c) / 2**30, 3),
            "planned_peak_difference_gib": round(planned, 3) if planned is not None else None,
            "measured_peak_difference_gib": round(measured, 3),
            "implied_transient_gib": round(saving - measured, 3)}


def train(sets: dict, nproc: int, runs: Path, log: Path,
          env: dict[str, str] | None = None) -> tuple[int, Path | None, float]:
    """One protocol run through `shardline train` (its run directory under `runs`, its output in `log`, `env` added
    to its environment), stopped at its last step: (exit code, run directory, the command's start in epoch
    seconds)."""
    overrides = {**sets, "run.dir": str(runs)}
    cmd = [sys.executable, "-m", "shardline.cli", "train", "--nproc", str(nproc),
           *(a for k, v in overrides.items() for a in ("--set", f"{k}={v}"))]
    started = time.time()
    # The run's own output goes to its log as it comes: a run stopped at a time limit leaves it.
    returncode = run_until_last_step(cmd, log, runs, int(sets["train.max_steps"]), env)
    if returncode != 0:
        print(log.read_text()[-8000:], file=sys.stderr)
        return returncode, None, started
    return 0, next(p for p in runs.iterdir() if (p / "metrics.jsonl").exists()), started


def hf_trainer(run: Path, protocol: str, checkpointing: bool, timeout: float | None = None) -> dict:
    """HF Trainer on the run's model, initial weights and rows (bench/hf_baseline.py, a process of its own): its
    result, or `failed` with its last error line (out of memory, say, or `timeout` seconds passed)."""
    cmd = [sys.executable, str(REPO / "bench" / "hf_baseline.py"), str(run), protocol,
           "--warmup-steps", str(WARMUP_STEPS), *(["--checkpointing"] if checkpointing else [])]
    try:
        child = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=child_env(), timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"failed": f"timed out after {timeout:.0f} s", "gradient_checkpointing": checkpointing}
    if child.returncode != 0:
        print(child.stdout[-4000:] + child.stderr[-4000:], file=sys.stderr)
        failed = (child.stderr.strip().splitlines() or [f"exit {child.returncode}"])[-1][:500]
        return {"failed": failed, "gradient_checkpointing": checkpointing}
    return json.loads(child.stdout.strip().splitlines()[-1])


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("protocol", choices=["A", "B"])
    parser.add_argument("--size", choices=["full", "small"], default="full")
    parser.add_argument("--shapes", choices=SHAPES, default=SHAPES[0],
                        help="the model's shapes (qwen2.5-7b: Qwen2 built from a config.json, random weights)")
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--model", help="a real checkpoint directory instead of Llama-3.1-8B's shapes")
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    parser.add_argument("--baseline", choices=["hf", "hf-checkpointed", "bf16-base"],
                        help="also train HF Trainer on the same model and rows (hf-checkpointed: with whole-block "
                             "gradient checkpointing; B always checkpoints); bf16-base: a QLoRA run's protocol again "
                             "on a bf16 base")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="one change to the protocol's spec (a variant: parallel.compile=true, say)")
    args = parser.parse_args(argv)
    if args.model and args.shapes != SHAPES[0]:
        parser.error(f"--model {args.model} and --shapes {args.shapes}: a checkpoint has shapes of its own")
    args.sets = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--set {item!r}: expected KEY=VALUE")
        args.sets[key] = value
    if args.baseline == "bf16-base" and args.sets.get("model.lora.quantize_base") != "nf4":
        parser.error("--baseline bf16-base compares a QLoRA run with its bf16 base: add "
                     "--set model.lora.quantize_base=nf4 (protocol A)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    checkpointing = args.protocol == "B" or args.baseline == "hf-checkpointed"
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"protocol-{args.protocol}"
    with tempfile.TemporaryDirectory(prefix="shardline-protocol-") as tmp:
        model, random_init = args.model, args.shapes != SHAPES[0]
        if random_init:
            model = str(config_only_model(args.shapes, args.size, Path(tmp, args.shapes)))
        sets = protocol_sets(args.protocol, args.size, args.nproc, model, random_init) | args.sets
        returncode, run, started = train(sets, args.nproc, Path(tmp, "runs"), args.out / f"{name}-shardline.log")
        if run is None:
            return returncode
        profiled = keep_profile(run, args.out, args.protocol, sets)
        result = {"protocol": args.protocol, "size": args.size, "shapes": args.shapes, "overrides": sets,
                  **summarize(run, sets, started), "versions": versions()}
        if profiled:
            result["profile_breakdown"] = profiled
        # shardline's numbers are written before the baseline starts, so a baseline cut short does not lose them.
        (args.out / f"{name}.json").write_text(json.dumps(result, indent=2))
        failed = None
        if args.baseline == "bf16-base":
            base_sets = sets | {"model.lora.quantize_base": "none"}
            code, base_run, base_started = train(base_sets, args.nproc, Path(tmp, "bf16-base"),
                                                 args.out / f"{name}-bf16-base.log")
            if base_run is None:
                failed = f"the bf16-base run exited {code}"
                result["bf16_base"] = {"failed": failed}
            else:
                base = summarize(base_run, base_sets, base_started)
                result["bf16_base"] = {k: base[k] for k in ("tokens_per_s_per_device", "mfu_shardline", "step_time_s",
                                                            "peak_memory_gib", "planned_peak_gib", "first_loss",
                                                            "startup")}
                result["ratio_vs_bf16_base"] = round(result["tokens_per_s_per_device"]
                                                     / base["tokens_per_s_per_device"], 3)
                result["qlora_memory"] = qlora_memory(run, result, base)
        elif args.baseline:
            result["hf_trainer"] = hf = hf_trainer(run, args.protocol, checkpointing)
            failed = hf.get("failed")
            if not failed:
                result["ratio_vs_hf_trainer"] = round(result["tokens_per_s_per_device"]
                                                      / hf["tokens_per_s_per_device"], 3)
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=2))
    report(result)
    if failed:
        print(f"baseline failed: {failed}", file=sys.stderr)
        return 1
    return 0


def report(result: dict) -> None:
    """The result's lines for people: the run, its start-up, and its baseline from the same call."""
    r, up = result, result["startup"]
    print(f"protocol {r['protocol']} ({r['size']}, {r['shapes']}, world {r['world']}): "
          f"{r['tokens_per_s_per_device']:,.0f} tok/s/device over steps {r['steps_measured'][0]}-"
          f"{r['steps_measured'][-1]} · MFU {r['mfu_shardline']:.1%} (shardline's formula), "
          f"{r['mfu_torchtitan_formula']:.1%} (torchtitan's) · step {r['step_time_s']:.3f} s · peak "
          f"{r['peak_memory_gib']:.2f} GiB · startup {r['startup_s']:.0f} s · {r['versions']['device']}")
    worker = " · ".join(f"{k} {v:.1f}s" for k, v in (up["worker_s"] or {}).items())
    print(f"start-up to the first step {up['to_first_step_s']:.1f} s: launcher {up['launcher_s'] or 0:.1f} s · "
          f"worker {worker} · setup to first step {up['setup_to_first_step_s']:.1f} s; first step "
          f"{up['first_step_s']:.1f} s, {up['first_step_warmup_s']:.1f} s over the median (warm-up)")
    if (hf := r.get("hf_trainer")) and "failed" not in hf:
        print(f"HF Trainer{' + peft' if r['protocol'] == 'A' else ''} on the same rows: "
              f"{hf['tokens_per_s_per_device']:,.0f} tok/s/device · shardline is {r['ratio_vs_hf_trainer']:.2f}× · "
              f"first loss {r['first_loss']:.5f} (shardline) vs {hf['first_loss']:.5f} (HF)")
    if prof := r.get("profile_breakdown"):
        print(f"profile breakdown failed: {prof['failed']}" if "failed" in prof else _breakdown_module().describe(prof))
    if (base := r.get("bf16_base")) and "failed" not in base:
        q = r["qlora_memory"]
        print(f"bf16 base, same protocol: {base['tokens_per_s_per_device']:,.0f} tok/s/device, peak "
              f"{base['peak_memory_gib']:.2f} GiB · QLoRA is {r['ratio_vs_bf16_base']:.2f}× its speed, peak "
              f"{q['measured_peak_difference_gib']:.2f} GiB lower (planned {q['planned_peak_difference_gib']}) · "
              f"NF4 saves {q['planned_base_saving_gib']:.2f} GiB of base: implied transient "
              f"{q['implied_transient_gib']:.2f} GiB vs the planner's {q['planned_dequantize_transient_gib']:.2f} GiB")


if __name__ == "__main__":
    sys.exit(main())
