"""Data preparation tokens/s and peak memory: `shardline prepare` vs Hugging Face `datasets.map(batched=True)`.

One synthetic chat dataset (JSONL, `{"messages": [system?, user, assistant, ...]}`, 1–3 turns of varied length,
deterministic with --seed) and one byte-level BPE tokenizer with a ChatML template (or --tokenizer DIR, a model's
own), both written to a temp dir; then, one after another, each in a fresh process:

  shardline      `python -m shardline.cli prepare` on the file: read, split (validation 100 rows, no test), render
                 each conversation with the chat template, tokenize, locate the assistant turns' loss, pack into
                 rows of --seq-len, write the prepared directory (stats.json gives the tokens)
  datasets.map   `load_dataset("json", data_files=FILE, split="train").map(fn, batched=True, num_proc=N,
                 remove_columns=...)` with fn = `tokenizer.apply_chat_template(batch["messages"], tokenize=True)`,
                 the same fast tokenizer (AutoTokenizer) and a fresh datasets cache: the same rendering and
                 tokenizing, without loss masks or packing

Each is timed by wall clock from process start to exit (interpreter start and imports included, alike for both).
Peak memory: the largest single process's peak RSS (`ru_maxrss` of the waited child, which covers its waited
descendants) and the peak of the process tree's summed PSS, sampled every 0.1 s (datasets.map's workers are forked:
PSS shares their common pages out instead of counting them in every worker). tokens/s
counts the tokens each produced; the ratio is shardline tokens/s ÷ datasets.map tokens/s, both from this run.

--memory-limit-gb G also runs shardline's prepare under `RLIMIT_DATA` = G GiB (heap and private mappings) and
reports whether it completed, its peak RSS and the source's size: a source larger than the memory it is given.

    .venv/bin/python bench/prepare.py [--rows 200000] [--num-proc N] [--tokenizer DIR] [--memory-limit-gb G]
        [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import itertools
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

GIB = 2**30
MIB = 2**20
VALIDATION_ROWS = 100
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SYSTEM_PROMPTS = ("You are a helpful assistant.", "You answer briefly and precisely.",
                  "You are a careful reviewer; explain your reasoning step by step.")
CHILD_ENV = {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def words(rng: random.Random, n: int = 3000) -> list[str]:
    """Pseudo-words of 1–4 syllables (a stand-in vocabulary; a BPE of a few thousand ids learns most whole)."""
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"] + ["th", "qu", "sh", "ing", "er", "on"]
    out = {"".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(2 * n)}
    return sorted(out)[:n]


def conversations(rows: int, seed: int) -> Iterator[dict]:
    """Deterministic chat rows: an optional system prompt, 1–3 user/assistant turns of Zipf-distributed words."""
    rng = random.Random(seed)
    vocab = words(rng)
    cum = list(itertools.accumulate(1 / (rank + 1) for rank in range(len(vocab))))

    def text(lo: int, hi: int) -> str:
        picked = rng.choices(vocab, cum_weights=cum, k=rng.randint(lo, hi))
        for i in range(7, len(picked), rng.randint(6, 14)):  # sentences, numbers
            picked[i] += rng.choice((".", ",", "?", f" {rng.randint(0, 9999)}."))
        return " ".join(picked).capitalize() + "."

    for _ in range(rows):
        messages = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] if rng.random() < 0.7 else []
        for _ in range(rng.randint(1, 3)):
            messages += [{"role": "user", "content": text(3, 40)}, {"role": "assistant", "content": text(5, 90)}]
        yield {"messages": messages}


def write_data(path: Path, rows: int, seed: int) -> list[str]:
    """The JSONL source; returns a sample of its texts (the first 2,000 rows) to train the tokenizer on."""
    sample: list[str] = []
    with path.open("w") as f:
        for i, row in enumerate(conversations(rows, seed)):
            f.write(json.dumps(row) + "\n")
            if i < 2000:
                sample += [m["content"] for m in row["messages"]]
    return sample


def write_tokenizer(path: Path, texts: list[str], vocab_size: int) -> None:
    from shardline.data.tokenizer import train_bpe

    tok = train_bpe(texts, vocab_size)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    tok.save_pretrained(path)


def _children(pid: int) -> list[int]:
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    out: list[int] = []
    for tid in tasks:
        with contextlib.suppress(OSError):
            out += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
    return out


def _pss_bytes(pid: int) -> int:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


def tree_pss(pid: int) -> int:
    """Summed PSS of a process and all its descendants: a page shared by k of them counts 1/k in each (forked
    workers share their parent's pages), so the sum is the memory the tree holds."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += _pss_bytes(p)
        todo += _children(p)
    return total


def measure(cmd: list[str], log: Path, preexec: Callable[[], None] | None = None) -> dict:
    """Run `cmd` to its end; wall seconds, exit code, the largest process's peak RSS and the tree's sampled peak
    PSS."""
    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, preexec_fn=preexec,
                                env=dict(os.environ, **CHILD_ENV))
    peak_tree = 0  # sampled, so a peak shorter than 0.1 s may be missed
    done = threading.Event()

    def sample() -> None:
        nonlocal peak_tree
        while not done.wait(0.1):
            peak_tree = max(peak_tree, tree_pss(proc.pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    _, status, usage = os.wait4(proc.pid, 0)  # rusage of this child alone (and its waited descendants)
    seconds = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    done.set()
    sampler.join()
    lines = log.read_text(errors="replace").strip().splitlines()
    return {"seconds": seconds, "exit_code": proc.returncode, "peak_rss_bytes": usage.ru_maxrss * 1024,
            "peak_tree_pss_bytes": peak_tree, "output_tail": lines[-6:]}


def shardline_prepare(data: Path, tok: Path, work: Path, seq_len: int, name: str,
                      memory_limit_gb: float | None = None) -> dict:
    """`shardline prepare` in a fresh process with a fresh cache; its stats.json's counts."""
    sets = [f"data.path={data}", f"model.tokenizer={tok}", f"data.validation_size={VALIDATION_ROWS}",
            "data.test_size=0", "data.train_size=null", f"train.seq_len={seq_len}",
            f"model.arch.max_position_embeddings={max(seq_len, 512)}", f"run.dir={work / name / 'runs'}",
            f"data.cache_dir={work / name / 'cache'}"]
    cmd = [sys.executable, "-m", "shardline.cli", "prepare", *[a for s in sets for a in ("--set", s)]]
    preexec = None
    if memory_limit_gb is not None:
        limit = int(memory_limit_gb * GIB)

        def preexec() -> None:
            resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))

    (work / name).mkdir()
    result = measure(cmd, work / name / "prepare.log", preexec) | {"command": cmd}
    stats_files = list((work / name / "cache").glob("*/stats.json"))
    if result["exit_code"] != 0 or not stats_files:
        return result | {"completed": False, "error": "\n".join(result["output_tail"])}
    stats = json.loads(stats_files[0].read_text())
    splits = stats["splits"]
    tokens = sum(s.get("tokens", 0) for s in splits.values())
    return result | {"completed": True, "tokens": tokens, "tokens_per_s": tokens / result["seconds"],
                     "conversations": sum(s["kept"] for s in splits.values()),
                     "examples": sum(s["examples"] for s in splits.values()), "rows_read": stats["rows_read"],
                     "dropped": stats["dropped"], "splits": splits}


def datasets_worker(data: Path, tok_dir: Path, num_proc: int, cache: Path) -> dict:
    """The baseline, in this (child) process: load the JSONL, render and tokenize with datasets.map."""
    import datasets
    from transformers import AutoTokenizer

    datasets.disable_progress_bars()
    tok = AutoTokenizer.from_pretrained(tok_dir)

    def fn(batch: dict) -> dict:
        out = tok.apply_chat_template(batch["messages"], tokenize=True, return_dict=True)
        ids = out["input_ids"]
        return {"input_ids": ids, "n_tokens": [len(x) for x in ids]}

    start = time.perf_counter()
    ds = datasets.load_dataset("json", data_files=str(data), split="train", cache_dir=str(cache))
    mapped = ds.map(fn, batched=True, num_proc=num_proc, remove_columns=ds.column_names)
    seconds = time.perf_counter() - start
    return {"conversations": len(mapped), "tokens": int(sum(mapped["n_tokens"])), "load_map_seconds": seconds,
            "num_proc": num_proc, "fast_tokenizer": bool(tok.is_fast)}


def datasets_map(data: Path, tok: Path, work: Path, num_proc: int) -> dict:
    (work / "datasets").mkdir()
    cmd = [sys.executable, __file__, "--datasets-worker", "--data", str(data), "--tokenizer-dir", str(tok),
           "--num-proc", str(num_proc), "--hf-cache", str(work / "datasets" / "hf-cache")]
    result = measure(cmd, work / "datasets" / "map.log") | {"command": cmd}
    if result["exit_code"] != 0:
        return result | {"completed": False, "error": "\n".join(result["output_tail"])}
    counts = json.loads(result["output_tail"][-1])
    return result | counts | {"completed": True, "tokens_per_s": counts["tokens"] / result["seconds"]}


def size(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.1f} MiB"


def machine() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), None)
    cores = len(os.sched_getaffinity(0))
    versions = {}
    for package in ("shardline", "torch", "transformers", "tokenizers", "datasets", "pyarrow"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return {"cpu": model, "cores": cores, "cpu_count": os.cpu_count(), "python": sys.version.split()[0],
            "versions": versions}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=200_000, help="conversations in the generated source")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seq-len", type=int, default=1024, help="shardline's train.seq_len (rows it packs)")
    parser.add_argument("--vocab-size", type=int, default=4096, help="the generated BPE's vocabulary")
    parser.add_argument("--tokenizer", type=Path, metavar="DIR",
                        help="a model's tokenizer directory (with a chat template) instead of the generated BPE")
    parser.add_argument("--num-proc", type=int, default=os.cpu_count(), metavar="N", help="datasets.map workers")
    parser.add_argument("--memory-limit-gb", type=float, metavar="G",
                        help="also run shardline prepare under RLIMIT_DATA = G GiB")
    parser.add_argument("--tmp", type=Path, metavar="DIR",
                        help="where the data and outputs go (default: the system temp dir)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the results here")
    parser.add_argument("--datasets-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--hf-cache", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.datasets_worker:
        print(json.dumps(datasets_worker(args.data, args.tokenizer_dir, args.num_proc, args.hf_cache)))
        return
    if args.rows <= VALIDATION_ROWS:
        parser.error(f"--rows must be more than the {VALIDATION_ROWS} validation rows")
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        work = Path(tmp)
        data = work / "chat.jsonl"
        sample = write_data(data, args.rows, args.seed)
        tok = args.tokenizer or work / "tokenizer"
        if args.tokenizer is None:
            write_tokenizer(tok, sample, args.vocab_size)
        source_bytes = data.stat().st_size
        ours = shardline_prepare(data, tok, work, args.seq_len, "shardline")
        theirs = datasets_map(data, tok, work, args.num_proc)
        limited = (shardline_prepare(data, tok, work, args.seq_len, "shardline-limited", args.memory_limit_gb)
                   if args.memory_limit_gb is not None else None)
    baseline = f"datasets.map(batched=True, num_proc={args.num_proc})"
    ok = ours["completed"] and theirs["completed"]
    ratio = ours["tokens_per_s"] / theirs["tokens_per_s"] if ok else None
    info = machine()
    results = {"rows": args.rows, "seed": args.seed, "seq_len": args.seq_len, "source_bytes": source_bytes,
               "tokenizer": str(args.tokenizer) if args.tokenizer else f"generated byte-level BPE, {args.vocab_size}",
               "machine": info, "shardline": ours, "datasets_map": theirs, "baseline": baseline,
               "ratio_vs_datasets_map": ratio, "memory_limited": limited}

    v = info["versions"]
    print(f"\n{args.rows:,} conversations, {size(source_bytes)} JSONL; {results['tokenizer']}; "
          f"{info['cpu']}, {info['cores']} cores")
    print(f"torch {v['torch']}, transformers {v['transformers']}, tokenizers {v['tokenizers']}, "
          f"datasets {v['datasets']}, shardline {v['shardline']}")
    print(f"  {'contender':40} {'convs':>8} {'tokens':>12} {'seconds':>8} {'tokens/s':>10} {'peak RSS':>10} "
          f"{'tree PSS':>10}")
    rows = [("shardline prepare", ours), (baseline, theirs)]
    if limited is not None:
        rows.append((f"shardline prepare, RLIMIT_DATA {args.memory_limit_gb:g} GiB", limited))
    for name, r in rows:
        rss = f"{r['peak_rss_bytes'] / MIB:7,.0f} MiB {r['peak_tree_pss_bytes'] / MIB:6,.0f} MiB"
        if not r["completed"]:
            print(f"  {name:40} {'failed':>8} {'':>12} {r['seconds']:8.1f} {'':>10} {rss}  "
                  f"(exit {r['exit_code']}: {r['error'].splitlines()[-1][:80] if r['error'] else ''})")
            continue
        print(f"  {name:40} {r['conversations']:8,} {r['tokens']:12,} {r['seconds']:8.1f} {r['tokens_per_s']:10,.0f} "
              f"{rss}")
    if ratio is not None:
        print(f"ratio vs {baseline}: {ratio:.2f}× (shardline tokens/s ÷ datasets.map tokens/s)")
        if ours["tokens"] == theirs["tokens"]:
            print("both produced the same tokens (same count)")
        else:
            print(f"note: the token counts differ ({ours['tokens']:,} vs {theirs['tokens']:,}); shardline dropped "
                  f"{ours['dropped'] or 'nothing'}")
    if limited is not None:
        state = "completed" if limited["completed"] else f"FAILED (exit {limited['exit_code']})"
        print(f"memory limit {args.memory_limit_gb:g} GiB (RLIMIT_DATA) for a {size(source_bytes)} source: {state}, "
              f"peak RSS {size(limited['peak_rss_bytes'])}")
        if not limited["completed"]:
            print("  " + limited["error"].replace("\n", "\n  "))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))
    if not ok:
        sys.stdout.flush()
        for name, r in rows[:2]:
            if not r["completed"]:
                print(f"{name} failed:\n{r['error']}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
