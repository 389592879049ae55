"""Loss-bearing tokens/s: shardline vs Hugging Face Trainer on the same model, data, batch, dtype, threads.

Contenders (each in its own process, run one after another so they never share the 2 cores):
  shardline      `shardline train bench/throughput.yaml` (FSDP2, packed rows, bf16 mixed precision)
  hf-padded      transformers.Trainer, one example per row padded to seq_len (what the reference job did)
  hf-packed      transformers.Trainer with DataCollatorWithFlattening (HF's own packing, position ids)

Same model (Llama architecture, hidden 512, 8 layers, seq 512, same init seed), same tokenized examples,
same rows × seq_len per step for the padded baseline and the same tokens per step for the packed one,
bf16 autocast for HF vs bf16 FSDP2 mixed precision for shardline, 2 threads in total each.
Prints tokens/s for each, the ratios, and shardline's MFU against a bf16 matmul probe.

    .venv/bin/python bench/throughput.py [--steps 40] [--nproc 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
SPEC = BENCH_DIR / "throughput.yaml"
WARMUP = 3  # steps left out of every contender's timing


def shardline_run(steps: int, nproc: int, workdir: Path, extra: list[str]) -> dict:
    sets = [f"run.dir={workdir / 'runs'}", f"data.cache_dir={workdir / 'prepared'}", f"train.max_steps={steps}",
            *extra]
    cmd = [sys.executable, "-m", "shardline.cli", "train", str(SPEC), "--nproc", str(nproc)]
    cmd += [a for s in sets for a in ("--set", s)]
    subprocess.run(cmd, check=True, env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    run = next(p for p in (workdir / "runs").iterdir() if (p / "metrics.jsonl").exists())
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    setup = next(r for r in records if r.get("event") == "setup")
    timed = train[WARMUP:]
    wall = timed[-1]["time"] - train[WARMUP - 1]["time"]
    return {
        "loss_tokens_per_s": sum(r["tokens"] for r in timed) / wall,
        "tokens_per_s": sum(r["tokens_total"] for r in timed) / wall,
        "mfu": statistics.fmean(r["mfu"] for r in timed),
        "peak_tflops_per_device": setup["peak_tflops"], "peak_source": setup["peak_source"],
        "flops_per_token": setup["flops_per_token"], "first_loss": train[0]["loss"], "last_loss": train[-1]["loss"],
        "prepared": str(workdir / "prepared"), "world": setup["world"],
    }


def hf_worker(mode: str, prepared_root: Path, steps: int, threads: int) -> dict:
    """One Trainer run in this process; returns its timing (called in a child process)."""
    import torch
    from transformers import DataCollatorWithFlattening, Trainer, TrainerCallback, TrainingArguments

    from shardline.data.prepare import PreparedData
    from shardline.data.template import encode_answer, encode_prompt
    from shardline.data.tokenizer import special_ids
    from shardline.model.build import build_model
    from shardline.spec.resolve import load_spec
    from shardline.tasks import get_task

    torch.set_num_threads(threads)
    spec = load_spec(str(SPEC), ["parallel.nproc_per_node=1"])
    data = PreparedData(prepared_root)
    tok, pad, seq = data.tokenizer(), data.meta["pad_id"], spec.train.seq_len
    template = get_task(spec.data.task).prompt
    features = []
    for ex in data.examples("train"):
        prompt, answer = encode_prompt(tok, template, ex.question, ex.context, "plain"), encode_answer(tok, ex.answer)
        if len(prompt) + len(answer) <= seq:
            features.append({"input_ids": prompt + answer, "labels": [-100] * len(prompt) + answer})
    special = special_ids(tok, pad)
    model = build_model(spec.model, data.meta["vocab_size"], special)
    mean_len = statistics.fmean(len(f["input_ids"]) for f in features)
    if mode == "padded":
        batch_size = spec.train.global_batch_size

        def base_collate(batch):
            ids = torch.full((len(batch), seq), pad)
            labels = torch.full((len(batch), seq), -100)
            mask = torch.zeros((len(batch), seq), dtype=torch.long)
            for i, f in enumerate(batch):
                n = len(f["input_ids"])
                ids[i, :n], labels[i, :n], mask[i, :n] = torch.tensor(f["input_ids"]), torch.tensor(f["labels"]), 1
            return {"input_ids": ids, "labels": labels, "attention_mask": mask}
    else:
        batch_size = round(spec.train.global_batch_size * seq / mean_len)  # same tokens per step
        base_collate = DataCollatorWithFlattening(return_position_ids=True, separator_id=-100)
    loss_tokens: list[int] = []

    def collate(batch):
        out = base_collate(batch)
        loss_tokens.append(int((out["labels"][:, 1:] != -100).sum()))
        return out

    stamps: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, max_steps=steps, per_device_train_batch_size=batch_size, learning_rate=spec.train.lr,
            lr_scheduler_type="cosine", warmup_steps=spec.train.warmup_steps, weight_decay=spec.train.weight_decay,
            max_grad_norm=spec.train.max_grad_norm, bf16=True, use_cpu=True, logging_steps=10_000,
            save_strategy="no", report_to=[], dataloader_num_workers=0, remove_unused_columns=False, seed=0,
            disable_tqdm=True,
        )
        result = Trainer(model=model, args=args, train_dataset=features, data_collator=collate,
                         callbacks=[Clock()]).train()
    wall = stamps[-1] - stamps[WARMUP - 1]
    timed = len(stamps) - WARMUP
    return {"loss_tokens_per_s": statistics.fmean(loss_tokens) * timed / wall, "batch_examples": batch_size,
            "train_loss": result.training_loss, "mean_example_tokens": mean_len}


def run_hf(mode: str, prepared: Path, steps: int, threads: int) -> dict:
    cmd = [sys.executable, __file__, "--hf-worker", mode, "--prepared", str(prepared), "--steps", str(steps),
           "--threads", str(threads)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false"))
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--nproc", type=int, default=2, help="shardline processes (threads each: 2 / nproc)")
    parser.add_argument("--threads", type=int, default=2, help="threads of the single HF Trainer process")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="extra shardline overrides")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--hf-worker", choices=["padded", "packed"], help=argparse.SUPPRESS)
    parser.add_argument("--prepared", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hf_worker:
        print(json.dumps(hf_worker(args.hf_worker, args.prepared, args.steps, args.threads)))
        return
    import torch

    from shardline.model.flops import probe_matmul_tflops

    with tempfile.TemporaryDirectory() as tmp:
        ours = shardline_run(args.steps, args.nproc, Path(tmp), args.overrides)
        prepared = next(p for p in Path(ours["prepared"]).iterdir() if (p / "stats.json").exists())
        padded = run_hf("padded", prepared, args.steps, args.threads)
        packed = run_hf("packed", prepared, args.steps, args.threads)
    torch.set_num_threads(args.threads)
    machine_peak = probe_matmul_tflops(torch.bfloat16, torch.device("cpu"), n=2048, seconds=1.0)
    ours_tflops = ours["tokens_per_s"] * ours["flops_per_token"] / 1e12
    results = {
        "model": "Llama hidden 512, 8 layers, seq 512 (bench/throughput.yaml)", "steps": args.steps,
        "torch": torch.__version__, "shardline": ours, "hf_padded": padded, "hf_packed": packed,
        "ratio_vs_hf_padded": ours["loss_tokens_per_s"] / padded["loss_tokens_per_s"],
        "ratio_vs_hf_packed": ours["loss_tokens_per_s"] / packed["loss_tokens_per_s"],
        "machine_bf16_peak_tflops": machine_peak, "mfu_vs_machine_peak": ours_tflops / machine_peak,
    }
    print(f"\nloss-bearing tokens/s ({args.steps} steps, first {WARMUP} excluded, bf16, {args.threads} threads total)")
    print(f"  shardline ({ours['world']} proc)     {ours['loss_tokens_per_s']:10,.0f}")
    for name, key in (("padded", "hf_padded"), ("packed", "hf_packed")):
        ratio = results[f"ratio_vs_{key}"]
        print(f"  HF Trainer, {name}       {results[key]['loss_tokens_per_s']:10,.0f}   shardline is {ratio:.2f}×")
    print(f"shardline MFU {100 * ours['mfu']:.1f}% of the per-rank probe ({ours['peak_tflops_per_device']:.3f} "
          f"TFLOP/s/device, {ours['peak_source']}); {100 * results['mfu_vs_machine_peak']:.1f}% of the whole "
          f"machine's bf16 matmul peak ({machine_peak:.3f} TFLOP/s, {args.threads} threads)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
