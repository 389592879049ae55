"""Loss-bearing tokens/s: shardline vs Hugging Face Trainer on the same model, data, batch, dtype, threads.

Contenders (each in its own process, run one after another so they never share the 2 cores):
  shardline      `shardline train bench/throughput.yaml` (FSDP2, packed rows, mixed precision)
  hf-padded      transformers.Trainer, one example per row padded to seq_len (what the reference job did)
  hf-packed      transformers.Trainer with DataCollatorWithFlattening (HF's own packing, position ids)
  hf-same-rows   transformers.Trainer fed shardline's own packed rows, in shardline's step order, with position
                 ids, so HF applies its own block-diagonal (document) attention: the fair comparison
  torchtune      bench/peers/torchtune_contender.py (stock recipe, same rows, packed document mask), with --peers-python
  torchtitan     bench/peers/torchtitan_contender.py (its Trainer, same rows), with --peers-python; causal over the
                 whole row: torchtitan cannot mask documents on CPU (bench/peers/FINDINGS.md)

Same model (Llama architecture, hidden 512, 8 layers, seq 512, same init seed), same tokenized examples,
same rows × seq_len per step for the padded baseline and the same tokens per step for the packed one; the
same-rows contenders train exactly the global batches shardline trains, step for step. Every contender uses the
precision `train.precision: auto` chooses on this machine (bf16 on GPUs and CPUs with native bf16 matmul, else fp32):
HF Trainer's bf16 autocast vs shardline's FSDP2 mixed precision, or fp32 for both; 2 threads in total each.
Loss-bearing tokens are shifted targets that are not -100, counted alike for all. tokens/s counts non-padding
tokens.

MFU (column "MFU") is model FLOPs (shardline.model.flops.FORMULA, document-masked attention) over the whole
machine's bf16 matmul probe. shardline's TFLOP/s is its records' tflops_per_device × world; a same-rows contender
does the same model FLOPs per step, so its TFLOP/s is shardline's scaled by the loss-token rate ratio. Unknown
(—) for hf-padded and hf-packed, which train other batches.

    .venv/bin/python bench/throughput.py [--steps 40] [--nproc 2] [--peers-python /tmp/peers-venv/bin/python]
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
        "mfu_causal": statistics.fmean(r["mfu_causal"] for r in timed),
        "hfu": statistics.fmean(r["hfu"] for r in timed),
        "model_tflops": statistics.fmean(r["tflops_per_device"] for r in timed) * setup["world"],
        "peak_tflops_per_device": setup["peak_tflops"], "peak_source": setup["peak_source"],
        "first_loss": train[0]["loss"], "last_loss": train[-1]["loss"],
        "prepared": str(workdir / "prepared"), "world": setup["world"],
        "precision": json.loads((run / "manifest.json").read_text())["spec"]["train"]["precision"],
    }


def export_rows(prepared_root: Path, steps: int, out: Path, overrides: list[str]) -> dict:
    """shardline's training stream for `steps` steps as .npy files (rows.npy, labels.npy, positions.npy, n_real.npy),
    one global batch after another: row i belongs to step i // global_batch_size, as shardline trains it (the
    stream depends only on the step and the global batch, so StepSampler with world 1 gives the same rows).
    labels are HF-style, unshifted: the token where it carries loss, else -100; shifting them gives exactly the
    targets of shardline.data.loader.make_batch."""
    import numpy as np

    from shardline.data.loader import IGNORE_INDEX, StepSampler
    from shardline.data.prepare import PreparedData
    from shardline.spec.resolve import load_spec

    spec = load_spec(str(SPEC), ["parallel.nproc_per_node=1", *overrides])
    t = spec.train
    rows = PreparedData(prepared_root).rows("train")
    sampler = StepSampler(len(rows.n_real), t.seed, t.global_batch_size, t.global_batch_size, world=1)
    index = np.concatenate([sampler.micro_indices(step, 0, 0) for step in range(steps)])
    tokens = np.asarray(rows.tokens[index], dtype=np.int64)
    labels = np.where(np.asarray(rows.loss_mask[index], dtype=bool), tokens, IGNORE_INDEX)
    arrays = {"rows": tokens, "labels": labels, "positions": np.asarray(rows.position_ids[index], dtype=np.int64),
              "n_real": np.asarray(rows.n_real[index], dtype=np.int64)}
    out.mkdir(parents=True, exist_ok=True)
    for name, array in arrays.items():
        np.save(out / f"{name}.npy", array)
    timed = slice(WARMUP * t.global_batch_size, None)
    return {"dir": out, "global_batch": t.global_batch_size,
            "timed_loss_tokens": int((labels[timed, 1:] != IGNORE_INDEX).sum()),
            "timed_tokens": int(arrays["n_real"][timed].sum())}


def hf_worker(mode: str, prepared_root: Path, steps: int, threads: int, rows_dir: Path | None,
              overrides: list[str]) -> dict:
    """One Trainer run in this process; returns its timing (called in a child process)."""
    import numpy as np
    import torch
    from transformers import DataCollatorWithFlattening, Trainer, TrainerCallback, TrainingArguments

    from shardline.data.prepare import PreparedData
    from shardline.data.template import encode_answer, encode_prompt
    from shardline.data.tokenizer import special_ids
    from shardline.model.build import build_model
    from shardline.precision import choose_precision
    from shardline.spec.resolve import load_spec
    from shardline.tasks import get_task

    torch.set_num_threads(threads)
    spec = load_spec(str(SPEC), ["parallel.nproc_per_node=1", *overrides])
    bf16 = choose_precision(spec.train.precision, accelerator=torch.cuda.is_available()).precision == "bf16"
    data = PreparedData(prepared_root)
    tok, pad, seq = data.tokenizer(), data.meta["pad_id"], spec.train.seq_len
    special = special_ids(tok, pad)
    model = build_model(spec.model, data.meta["vocab_size"], special)
    mean_len = None
    if mode == "same-rows":
        # shardline's packed rows in its step order: an IterableDataset, so the Trainer neither shuffles nor drops
        # rows; no attention mask, so HF derives the document (block-diagonal) mask from the position ids.
        arrays = {name: torch.from_numpy(np.load(rows_dir / f"{name}.npy")) for name in ("rows", "labels", "positions")}
        batch_size = spec.train.global_batch_size

        class StreamRows(torch.utils.data.IterableDataset):
            def __iter__(self):
                for i in range(len(arrays["rows"])):
                    yield {"input_ids": arrays["rows"][i], "labels": arrays["labels"][i],
                           "position_ids": arrays["positions"][i]}

        features = StreamRows()

        def base_collate(batch):
            return {key: torch.stack([f[key] for f in batch]) for key in batch[0]}
    else:
        template = get_task(spec.data.task).prompt
        features = []
        for ex in data.examples("train"):
            prompt = encode_prompt(tok, template, ex.question, ex.context, "plain")
            answer = encode_answer(tok, ex.answer)
            if len(prompt) + len(answer) <= seq:
                features.append({"input_ids": prompt + answer, "labels": [-100] * len(prompt) + answer})
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
    elif mode == "packed":
        batch_size = round(spec.train.global_batch_size * seq / mean_len)  # same tokens per step
        base_collate = DataCollatorWithFlattening(return_position_ids=True, separator_id=-100)
    loss_tokens: list[int] = []
    real_tokens: list[int] = []  # non-padding; same-rows recounts them from the rows in main()

    def collate(batch):
        out = base_collate(batch)
        loss_tokens.append(int((out["labels"][:, 1:] != -100).sum()))
        real_tokens.append(int(out["attention_mask"].sum()) if "attention_mask" in out else out["input_ids"].numel())
        return out

    stamps: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, max_steps=steps, per_device_train_batch_size=batch_size, learning_rate=spec.train.lr,
            lr_scheduler_type="cosine", warmup_steps=spec.train.warmup_steps, weight_decay=spec.train.weight_decay,
            max_grad_norm=spec.train.max_grad_norm, bf16=bf16, use_cpu=not torch.cuda.is_available(),
            logging_steps=10_000,
            save_strategy="no", report_to=[], dataloader_num_workers=0, remove_unused_columns=False, seed=0,
            disable_tqdm=True,
        )
        result = Trainer(model=model, args=args, train_dataset=features, data_collator=collate,
                         callbacks=[Clock()]).train()
    wall = stamps[-1] - stamps[WARMUP - 1]
    return {"loss_tokens_per_s": sum(loss_tokens[WARMUP:steps]) / wall,
            "tokens_per_s": sum(real_tokens[WARMUP:steps]) / wall,
            "batch_examples": batch_size, "train_loss": result.training_loss, "mean_example_tokens": mean_len,
            "timed_loss_tokens": sum(loss_tokens[WARMUP:steps])}


def run_hf(mode: str, prepared: Path, steps: int, threads: int, overrides: list[str],
           rows_dir: Path | None = None) -> dict:
    cmd = [sys.executable, __file__, "--hf-worker", mode, "--prepared", str(prepared), "--steps", str(steps),
           "--threads", str(threads), *[a for s in overrides for a in ("--set", s)]]
    cmd += ["--rows-dir", str(rows_dir)] if rows_dir else []
    out = subprocess.run(cmd, check=True, capture_output=True, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false"))
    return json.loads(out.stdout.strip().splitlines()[-1])


HF_MODES = ("padded", "packed", "same-rows")
PEERS = {  # name: (script, arguments beyond --rows/--steps/--threads, what the table says about it)
    "torchtune": ("torchtune_contender.py", ("labels", "positions"), "document mask; pure bf16, no fp32 masters"),
    "torchtitan": ("torchtitan_contender.py", ("labels",), "NO document mask: causal over the row (CPU)"),
}


def run_peer(name: str, python: str, rows: dict, steps: int, threads: int, nproc: int) -> dict:
    """One peer contender on the exported rows, with shardline's process count and the same threads in total;
    a failure is reported, not raised (the others still count)."""
    script, inputs, note = PEERS[name]
    cmd = [python, str(BENCH_DIR / "peers" / script), "--rows", str(rows["dir"] / "rows.npy"), "--steps", str(steps),
           "--threads", str(threads), "--nproc", str(nproc)]
    cmd += [a for key in inputs for a in (f"--{key}", str(rows["dir"] / f"{key}.npy"))]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        print(f"{name} contender failed (exit {proc.returncode}):\n{tail}", file=sys.stderr)
        return {"error": f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}", "note": note}
    return json.loads(proc.stdout.strip().splitlines()[-1]) | {"note": note}


def same_rows_rates(result: dict, rows: dict, ours: dict) -> None:
    """tokens/s and model TFLOP/s of a contender that trained shardline's timed global batches: the same loss and
    non-padding tokens and the same model FLOPs, so its wall time follows from its loss-token rate."""
    wall = rows["timed_loss_tokens"] / result["loss_tokens_per_s"]
    result["tokens_per_s_as_reported"] = result.get("tokens_per_s")  # peers count padding too
    result["tokens_per_s"] = rows["timed_tokens"] / wall
    result["model_tflops"] = ours["model_tflops"] * result["loss_tokens_per_s"] / ours["loss_tokens_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--nproc", type=int, default=2, help="shardline processes (threads each: 2 / nproc)")
    parser.add_argument("--threads", type=int, default=2, help="threads of the single HF Trainer process")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="extra shardline overrides")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--hf", default="padded,packed,same-rows",
                        help="the HF Trainer contenders to run, comma-separated (a GPU lease runs only same-rows)")
    parser.add_argument("--peers-python", help="python of the peer venv (bench/peers/setup-peers-venv.sh); "
                        "runs the torchtune and torchtitan contenders")
    parser.add_argument("--hf-worker", choices=HF_MODES, help=argparse.SUPPRESS)
    parser.add_argument("--prepared", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--rows-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hf_worker:
        print(json.dumps(hf_worker(args.hf_worker, args.prepared, args.steps, args.threads, args.rows_dir,
                                   args.overrides)))
        return
    if args.steps <= WARMUP:
        parser.error(f"--steps must be more than the {WARMUP} warm-up steps")
    hf_modes = [m for m in args.hf.split(",") if m]
    if unknown := set(hf_modes) - set(HF_MODES):
        parser.error(f"--hf: unknown contender(s) {', '.join(sorted(unknown))}; choose from {', '.join(HF_MODES)}")
    import torch

    from shardline.engines.torchrun import worker_allocator_env

    # shardline's CPU workers run with these malloc settings (engines/torchrun.py); every contender gets them, so
    # the ratios measure the trainers, not the allocator (they lift HF Trainer as much: bench/RESULTS.md)
    os.environ.update(worker_allocator_env(on_gpu=torch.cuda.is_available()))

    from shardline.model.flops import probe_cpu_peak_tflops

    peers: dict[str, dict | None] = dict.fromkeys(PEERS)
    with tempfile.TemporaryDirectory() as tmp:
        ours = shardline_run(args.steps, args.nproc, Path(tmp), args.overrides)
        prepared = next(p for p in Path(ours["prepared"]).iterdir() if (p / "stats.json").exists())
        rows = export_rows(prepared, args.steps, Path(tmp) / "rows", args.overrides)
        padded, packed, same = (run_hf(mode, prepared, args.steps, args.threads, args.overrides,
                                       rows["dir"] if mode == "same-rows" else None) if mode in hf_modes else None
                                for mode in HF_MODES)
        if same is not None:
            assert same["timed_loss_tokens"] == rows["timed_loss_tokens"], (same["timed_loss_tokens"], rows)
            same_rows_rates(same, rows, ours)
        if args.peers_python:
            for name in PEERS:
                peers[name] = run_peer(name, args.peers_python, rows, args.steps, args.threads, args.nproc)
                if "error" not in peers[name]:
                    same_rows_rates(peers[name], rows, ours)
    if torch.cuda.is_available():  # every contender on one GPU: the catalogue's dense bf16 peak of that GPU
        machine_peak = ours["peak_tflops_per_device"]
    else:
        torch.set_num_threads(args.threads)
        machine_peak, _ = probe_cpu_peak_tflops(torch.bfloat16, sizes=(512, 2048), seconds=1.0)

    def ratio(other: dict | None) -> float | None:
        ok = other is not None and "error" not in other
        return ours["loss_tokens_per_s"] / other["loss_tokens_per_s"] if ok else None

    results = {
        "model": "Llama hidden 512, 8 layers, seq 512 (bench/throughput.yaml)", "steps": args.steps,
        "torch": torch.__version__, "shardline": ours, "hf_padded": padded, "hf_packed": packed,
        "hf_same_rows": same, **{name: peer for name, peer in peers.items()},
        "ratio_vs_hf_padded": ratio(padded), "ratio_vs_hf_packed": ratio(packed),
        "ratio_vs_hf_same_rows": ratio(same), **{f"ratio_vs_{name}": ratio(peer) for name, peer in peers.items()},
        "machine_bf16_peak_tflops": machine_peak, "mfu_vs_machine_peak": ours["model_tflops"] / machine_peak,
        "hfu": ours["hfu"],
    }
    table = [(f"shardline ({ours['world']} proc, FSDP2)", ours, None, "document-masked SDPA")]
    table += [row for row in (("HF Trainer, padded", padded, ratio(padded), "one example per row"),
                              ("HF Trainer, packed", packed, ratio(packed), "DataCollatorWithFlattening"),
                              ("HF Trainer, same rows", same, ratio(same), "shardline's rows, position ids"))
              if row[1] is not None]
    table += [(f"{name} (peer)", peer, ratio(peer), peer["note"]) for name, peer in peers.items() if peer]
    print(f"\n{args.steps} steps, first {WARMUP} excluded, {ours['precision']}, {args.threads} threads total; "
          f"MFU = model FLOPs ÷ the machine's bf16 matmul probe ({machine_peak:.3f} TFLOP/s)")
    print(f"  {'contender':30} {'loss tok/s':>10} {'tok/s':>8} {'shardline is':>12} {'MFU':>6}  notes")
    for name, r, ratio_, note in table:
        if "error" in r:
            print(f"  {name:30} {'failed':>10} {'':>8} {'':>12} {'':>6}  {r['error'][:60]}")
            continue
        tps = f"{r['tokens_per_s']:8,.0f}" if "tokens_per_s" in r else f"{'—':>8}"
        mfu = f"{100 * r['model_tflops'] / machine_peak:5.1f}%" if "model_tflops" in r else f"{'—':>6}"
        ratio_s = f"{ratio_:11.2f}×" if ratio_ is not None else f"{'':>12}"
        print(f"  {name:30} {r['loss_tokens_per_s']:10,.0f} {tps} {ratio_s} {mfu}  {note}")
    if not args.peers_python:
        print("peers (torchtune, torchtitan) skipped: build their venv with bench/peers/setup-peers-venv.sh and "
              "pass --peers-python /tmp/peers-venv/bin/python")
    print(f"shardline per rank: MFU {100 * ours['mfu']:.1f}% (causal-only {100 * ours['mfu_causal']:.1f}%), "
          f"HFU {100 * ours['hfu']:.1f}% of the per-rank peak ({ours['peak_tflops_per_device']:.3f} TFLOP/s/device, "
          f"{ours['peak_source']})")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
