"""SFT then DPO on the embedded default (issue 40's behaviour check): does DPO on (correct SQL, wrong SQL) pairs
raise the held-out preference and keep SQL execution accuracy?

1. `shardline train` with no arguments' spec (the tiny Llama, generated text-to-SQL, 2 processes): the SFT run and
   its SQL execution accuracy on the test questions;
2. `shardline export` of it (a transformers directory: weights and tokenizer);
3. `shardline train --set train.objective=dpo --set model.path=<export>`: DPO from the SFT weights on the generated
   pairs of the same questions (the same seed and sizes: the same train, validation and test questions). Its step-0
   validation is the SFT model's preference on the held-out pairs; its last validation, DPO's; its SQL evaluation runs
   on the same test questions as the SFT run's.

Prints one table: held-out pairs whose correct query the model finds more likely than the wrong one, DPO's reward
accuracy and margin, and SQL execution accuracy, before and after DPO.

    .venv/bin/python bench/dpo_sql.py [--dpo-steps 200] [--beta 0.1] [--lr 1e-4] [--sft-weight 0] [--tmp DIR]
                                      [--data-set KEY=VALUE]...
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def shardline(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "shardline.cli", *args], cwd=REPO, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"shardline {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout


def only_run(runs: Path) -> Path:
    (run,) = [p for p in runs.iterdir() if (p / "manifest.json").exists()]
    return run


def records(run: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r.get("kind") == kind]


def sft_export(root: Path, sets: tuple[str, ...] = ()) -> tuple[str, Path]:
    """The data cache setting and the SFT run under `root` (trained with no arguments' spec and `sets`, and exported
    to `root/sft-export` unless there already)."""
    cache = f"data.cache_dir={root / 'prepared'}"
    if not (root / "sft-export").is_dir():
        shardline("train", "--set", f"run.dir={root / 'sft'}", "--set", cache,
                  *set_args(sets))
        shardline("export", str(only_run(root / "sft")), "--out", str(root / "sft-export"))
    return cache, only_run(root / "sft")


def set_args(pairs) -> list[str]:
    """`--set KEY=VALUE` for each pair, as `shardline train` takes them."""
    return [arg for kv in pairs for arg in ("--set", kv)]


def gained_and_lost(before: dict, after: dict) -> tuple[int, int]:
    """Test questions the second run's SQL solves that the first's did not, and the reverse (two eval.json)."""
    pairs = list(zip(before["samples"], after["samples"], strict=True))
    return (sum(not a["match"] and b["match"] for a, b in pairs), sum(a["match"] and not b["match"] for a, b in pairs))


def mcnemar_p(gained: int, lost: int) -> float:
    """McNemar's exact two-sided p: how often a fair coin splits `gained + lost` discordant questions this unevenly."""
    n = gained + lost
    return min(1.0, 2 * sum(math.comb(n, k) for k in range(min(gained, lost) + 1)) / 2**n) if n else 1.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dpo-steps", type=int, default=200)
    ap.add_argument("--beta", type=float, default=0.1)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--sft-weight", type=float, default=0.0, help="train.dpo.sft_weight")
    ap.add_argument("--data-set", action="append", default=[], metavar="KEY=VALUE",
                    help="a data or evaluation override for the SFT and the DPO run (repeatable), e.g. "
                         "data.test_size=1000 with train.eval_examples=1000")
    ap.add_argument("--tmp", type=Path, default=None, help="work directory; an SFT run already there is reused")
    args = ap.parse_args()
    root = args.tmp or Path(tempfile.mkdtemp(prefix="dpo-sql-"))
    cache, sft = sft_export(root, tuple(args.data_set))
    out = root / f"dpo-w{args.sft_weight:g}-b{args.beta:g}-lr{args.lr:g}-s{args.dpo_steps}"
    shardline("train", "--set", f"run.dir={out}", "--set", cache, "--set", "train.objective=dpo",
              "--set", f"model.path={root / 'sft-export'}", "--set", f"train.max_steps={args.dpo_steps}",
              "--set", f"train.dpo.beta={args.beta}", "--set", f"train.lr={args.lr}",
              "--set", f"train.dpo.sft_weight={args.sft_weight}",
              "--set", f"train.eval_every={max(1, args.dpo_steps // 4)}",
              *set_args(args.data_set))
    dpo = only_run(out)
    pref = [e for e in records(dpo, "eval") if "val_preference" in e]
    before, after = pref[0]["val_preference"], pref[-1]["val_preference"]
    sql_before = json.loads((sft / "eval.json").read_text())
    sql_after = json.loads((dpo / "eval.json").read_text())
    rows = [
        ("held-out pairs: correct query more likely", f"{100 * before['prefers_chosen']:.1f}%",
         f"{100 * after['prefers_chosen']:.1f}%"),
        ("held-out pairs: DPO reward accuracy", f"{100 * before['accuracy']:.1f}%", f"{100 * after['accuracy']:.1f}%"),
        ("held-out pairs: DPO reward margin", f"{before['margin']:+.4f}", f"{after['margin']:+.4f}"),
        ("held-out pairs: DPO loss", f"{before['loss']:.4f}", f"{after['loss']:.4f}"),
        ("held-out pairs: chosen log-probability", f"{before['chosen_logp']:.3f}", f"{after['chosen_logp']:.3f}"),
        ("held-out pairs: rejected log-probability", f"{before['rejected_logp']:.3f}",
         f"{after['rejected_logp']:.3f}"),
        ("SQL execution accuracy (test questions)", f"{100 * sql_before['sql_execution_accuracy']:.1f}%",
         f"{100 * sql_after['sql_execution_accuracy']:.1f}%"),
        ("SQL exact match", f"{100 * sql_before['sql_exact_match']:.1f}%",
         f"{100 * sql_after['sql_exact_match']:.1f}%"),
    ]
    print(f"SFT run {sft.name} → DPO run {dpo.name} ({args.dpo_steps} steps, β={args.beta}, lr={args.lr}, "
          f"sft_weight={args.sft_weight}); "
          f"{before['pairs']} held-out pairs, {sql_after['n']} test questions")
    print(f"| {'measure':<44} | after SFT | after DPO |\n|---|---|---|")
    for name, a, b in rows:
        print(f"| {name:<44} | {a:>9} | {b:>9} |")
    gained, lost = gained_and_lost(sql_before, sql_after)
    print(f"test questions DPO solves that SFT did not / the reverse: {gained} / {lost} "
          f"(McNemar exact p {mcnemar_p(gained, lost):.2g})")
    print(f"runs under {root}")


if __name__ == "__main__":
    main()
