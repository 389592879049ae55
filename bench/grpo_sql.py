"""SFT then GRPO on the embedded default (issue 40's behaviour check): does GRPO with the built-in text-to-SQL
reward raise SQL execution accuracy on the held-out test questions above the SFT checkpoint's?

1. `shardline train` with no arguments' spec (the tiny Llama, generated text-to-SQL, 2 processes): the SFT run and
   its SQL execution accuracy on the test questions (reused from `--tmp` when there);
2. `shardline export` of it;
3. `shardline train --set train.objective=grpo --set model.path=<export>`: GRPO from the SFT weights on the same
   training questions, G completions each sampled per step, rewarded by test-suite execution match (+0.1 for a
   query that runs); its SQL evaluation runs greedy on the same test questions as the SFT run's.

Prints one table: SQL execution accuracy and exact match after SFT and after GRPO (with the test questions each
solves that the other does not, and McNemar's exact two-sided p of that difference), and the training reward and
solved share of the first and last ten steps. `--data-set` changes both runs' data (more test questions:
`--data-set data.test_size=1000 --data-set train.eval_examples=1000`; the test questions come first, so the SFT
run then trains on other questions and is retrained in its own `--tmp`).

    .venv/bin/python bench/grpo_sql.py [--steps 100] [--generations 8] [--lr 1e-4] [--beta 0] [--tmp DIR]
                                       [--set KEY=VALUE]... [--data-set KEY=VALUE]...
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from dpo_sql import gained_and_lost, mcnemar_p, only_run, records, set_args, sft_export, shardline


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--batch", type=int, default=32, help="completions per step (train.global_batch_size)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--beta", type=float, default=0.0)
    ap.add_argument("--warmup", type=int, default=10, help="train.warmup_steps")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="another spec override for the GRPO run (repeatable), e.g. train.grpo.loss=dr_grpo")
    ap.add_argument("--data-set", action="append", default=[], metavar="KEY=VALUE",
                    help="a data or evaluation override for the SFT and the GRPO run (repeatable)")
    ap.add_argument("--tmp", type=Path, default=None, help="work directory; an SFT run already there is reused")
    args = ap.parse_args()
    root = args.tmp or Path(tempfile.mkdtemp(prefix="grpo-sql-"))
    cache, sft = sft_export(root, tuple(args.data_set))
    out = root / (f"grpo-g{args.generations}-b{args.batch}-lr{args.lr:g}-w{args.warmup}-beta{args.beta:g}"
                  f"-t{args.temperature:g}-s{args.steps}" + "".join(f"-{kv.split('.')[-1]}" for kv in args.set))
    shardline("train", "--set", f"run.dir={out}", "--set", cache, "--set", "train.objective=grpo",
              "--set", f"model.path={root / 'sft-export'}", "--set", f"train.max_steps={args.steps}",
              "--set", f"train.grpo.num_generations={args.generations}",
              "--set", f"train.global_batch_size={args.batch}",
              "--set", f"train.lr={args.lr}", "--set", f"train.grpo.beta={args.beta}",
              "--set", f"train.grpo.temperature={args.temperature}",
              "--set", f"train.grpo.max_new_tokens={args.max_new_tokens}", "--set", f"train.warmup_steps={args.warmup}",
              "--set", f"train.eval_every={max(1, args.steps // 4)}",
              *set_args([*args.data_set, *args.set]))
    grpo = only_run(out)
    steps = [r["grpo"] for r in records(grpo, "train") if r.get("grpo")]
    first, last = steps[:10], steps[-10:]
    mean = lambda rows, key: statistics.fmean(r[key] for r in rows)  # noqa: E731
    sql_before = json.loads((sft / "eval.json").read_text())
    sql_after = json.loads((grpo / "eval.json").read_text())
    print(f"SFT run {sft.name} → GRPO run {grpo.name} ({args.steps} steps, G={args.generations}, {args.batch} "
          f"completions per step, lr={args.lr}, beta={args.beta}, temperature={args.temperature}"
          f"{''.join(' ' + kv for kv in args.set)}); "
          f"{sql_after['n']} test questions")
    print("| measure | after SFT | after GRPO |\n|---|---|---|")
    print(f"| SQL execution accuracy (test questions, greedy) | {100 * sql_before['sql_execution_accuracy']:.1f}% | "
          f"{100 * sql_after['sql_execution_accuracy']:.1f}% |")
    gained, lost = gained_and_lost(sql_before, sql_after)
    print(f"| test questions GRPO solves that SFT did not / the reverse (paired; McNemar exact p "
          f"{mcnemar_p(gained, lost):.2g}) | – | {gained} / {lost} |")
    print(f"| SQL exact match | {100 * sql_before['sql_exact_match']:.1f}% | "
          f"{100 * sql_after['sql_exact_match']:.1f}% |")
    print(f"| training reward, mean of steps 1-10 → last 10 (sampled) | {mean(first, 'reward'):.3f} | "
          f"{mean(last, 'reward'):.3f} |")
    if "solved" in steps[0]:  # the task's own check (a user's reward says nothing of solving)
        print(f"| training completions solved, steps 1-10 → last 10 | {100 * mean(first, 'solved'):.1f}% | "
              f"{100 * mean(last, 'solved'):.1f}% |")
    if "sampled_zero_std" in steps[0]:  # train.grpo.oversample: before the selection
        print(f"| sampled groups with no reward spread, steps 1-10 → last 10 | "
              f"{100 * mean(first, 'sampled_zero_std'):.1f}% | {100 * mean(last, 'sampled_zero_std'):.1f}% |")
    print(f"| trained groups with no reward spread (no signal), steps 1-10 → last 10 | "
          f"{100 * mean(first, 'zero_std'):.1f}% | {100 * mean(last, 'zero_std'):.1f}% |")
    print(f"| seconds per step sampling / scoring | {mean(steps, 'generation_s'):.2f} | "
          f"{mean(steps, 'reward_s'):.2f} |")
    print(f"runs under {root}")


if __name__ == "__main__":
    main()
