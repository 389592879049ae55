"""Append one GPU session's measurements to bench/results-gpu.json: one entry per measurement, machine-readable.

    python bench/record_gpu.py OUT [--date YYYY-MM-DD] [--results bench/results-gpu.json]

OUT is what `bench/gpu-session.sh OUT PHASE...` wrote, fetched from the device machine: its session.log (each step's
command), `bench/gpu.py --json` files (the bare layer stack) and `bench/protocols.py --out` folders (the trainer).
Each entry holds the protocol, the model's shapes, the device and versions, tok/s per GPU, MFU, peak memory, the
command, and the baseline run in the same call: HF Trainer when the protocol ran one, the same LoRA run on a bf16
base for a QLoRA run (with `qlora_memory`: both peaks and the planner's NF4 terms), else the bare layer stack on the
same layers, rows and compile mode when the session measured it. A protocol's entry carries its start-up by part
(`startup`: `to_first_step_s` is the command to the first step's start, the first step's warm-up apart), and a
profiled run's entry where its steps' time went (`profile_breakdown`, bench/profile_breakdown.py). The mixture of
experts' phase (bench/moe_a3b.py) gives one entry per routing (balanced, real) with its model TFLOP/s per GPU by both
formulas and its load imbalance, HF Trainer + grouped_mm as the baseline of each. Entries already recorded (same
date, device and command) are not added twice.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results-gpu.json"
SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads")


def step_commands(out: Path) -> dict[str, str]:
    """The command of each step in session.log, by the name of the file or folder it wrote under OUT."""
    commands: dict[str, str] = {}
    log = out / "session.log"
    for line in log.read_text().splitlines() if log.exists() else []:
        if not line.startswith("=== ") or ": exit " in line or ": stopped " in line:
            continue
        command = line.split(": ", 1)[1]
        words = shlex.split(command)
        for flag in ("--out", "--json"):
            if flag in words and words.index(flag) + 1 < len(words):
                commands[Path(words[words.index(flag) + 1]).name] = command
    return commands


def _bare_entries(path: Path, command: str | None) -> list[dict]:
    bench = json.loads(path.read_text())
    shape = {**{k: bench["shape"][k] for k in ("hidden", "intermediate", "heads", "kv_heads", "vocab")},
             "layers": bench["layers"], "seq": bench["seq"], "rows_per_step": bench["batch"]}
    runs = [(f"eager, {name}", result) for name, result in bench.get("train", {}).items()]
    if "compile" in bench:
        runs.append((f"compiled, {bench['compile'].get('attention', '')}", bench["compile"]))
    return [{"measurement": f"bare layer stack ({label})", "program": "bench/gpu.py", "compiled": label.startswith("c"),
             "shape": shape, "device": bench["device"], "torch": bench["torch"],
             "transformers": bench["transformers"], "tokens_per_s_per_gpu": round(result["tokens_per_s_per_gpu"], 1),
             "mfu": round(result["mfu"], 4), "peak_memory_gib": round(result["peak_memory_gib"], 2),
             "command": command} for label, result in runs if "tokens_per_s_per_gpu" in result]


def _protocol_entry(path: Path, command: str | None) -> dict:
    result = json.loads(path.read_text())
    sets = result["overrides"]
    # the run's own shape record (a config-only model's too), else its model.arch overrides (results before it)
    shape = {k: v for k, v in result.get("model_shape", {}).items() if v is not None} or {
        k: int(sets[f"model.arch.{k}"]) for k in SHAPE_KEYS if f"model.arch.{k}" in sets}
    seq = int(sets["train.seq_len"])
    shape |= {"seq": seq, "rows_per_step": result["tokens_per_step"] // seq}
    quantized = sets.get("model.lora.quantize_base", "none")
    label = ", ".join(x for x in (result["size"], result.get("shapes"),
                                  "QLoRA NF4" if quantized == "nf4" else None) if x)
    entry = {"measurement": f"protocol {result['protocol']} ({label})", "program": "bench/protocols.py",
             "compiled": str(sets.get("parallel.compile", "false")).lower() == "true", "shape": shape,
             "activation_checkpointing": sets.get("parallel.activation_checkpointing", "none"),
             "lora": str(sets.get("model.lora.enabled", "false")).lower() == "true", "quantize_base": quantized,
             "device": result["versions"]["device"], "torch": result["versions"]["torch"],
             "transformers": result["versions"]["transformers"],
             "tokens_per_s_per_gpu": result["tokens_per_s_per_device"], "mfu": result["mfu_shardline"],
             "peak_memory_gib": result["peak_memory_gib"], "planned_peak_gib": result.get("planned_peak_gib"),
             "startup_s": result["startup_s"], "startup": result.get("startup"), "command": command}
    if profiled := result.get("profile_breakdown"):  # a profiled run's: where its steps' time goes
        entry["profile_breakdown"] = profiled
    if hf := result.get("hf_trainer"):
        entry["baseline"] = {"name": "HF Trainer" + (" (gradient checkpointing)" if hf.get("gradient_checkpointing")
                                                     else ""),
                             "tokens_per_s_per_gpu": hf.get("tokens_per_s_per_device"), "failed": hf.get("failed"),
                             "peak_memory_gib": hf.get("peak_memory_gib")}
    if base := result.get("bf16_base"):  # QLoRA's: the same protocol on a bf16 base, same call
        entry["baseline"] = {"name": "the same LoRA run on a bf16 base",
                             "tokens_per_s_per_gpu": base.get("tokens_per_s_per_device"), "failed": base.get("failed"),
                             "peak_memory_gib": base.get("peak_memory_gib"),
                             "planned_peak_gib": base.get("planned_peak_gib")}
        entry["qlora_memory"] = result.get("qlora_memory")
    return entry


def _moe_entries(path: Path, command: str | None) -> list[dict]:
    """bench/moe_a3b.py's result: an entry per routing that ran, HF Trainer (real routing) the baseline of each."""
    result = json.loads(path.read_text())
    config, sets, hf = result["config"], result["overrides"], result.get("hf_trainer")
    seq = int(sets["train.seq_len"])
    shape = {"vocab_size": config["vocab_size"], "hidden_size": config["hidden_size"],
             "moe_intermediate_size": config["moe_intermediate_size"], "experts": config["num_experts"],
             "experts_per_token": config["num_experts_per_tok"], "num_layers": result["layers"],
             "num_heads": config["num_attention_heads"], "num_kv_heads": config["num_key_value_heads"],
             "head_dim": config["head_dim"], "family": "qwen3_moe", "seq": seq,
             "rows_per_step": int(sets["train.global_batch_size"])}
    entries = []
    for routing, run in result["runs"].items():
        if "failed" in run:
            continue
        entry = {"measurement": f"Qwen3-30B-A3B, {result['layers']} of {result['layers_published']} layers "
                                f"({result['size']}, {routing} routing)",
                 "program": "bench/moe_a3b.py", "compiled": False, "shape": shape, "routing": routing,
                 "activation_checkpointing": sets["parallel.activation_checkpointing"], "lora": False,
                 "device": result["versions"]["device"], "torch": result["versions"]["torch"],
                 "transformers": result["versions"]["transformers"],
                 "tokens_per_s_per_gpu": run["tokens_per_s_per_device"], "mfu": run["mfu_shardline"],
                 "model_tflops_per_gpu": run["model_tflops_per_gpu"], "flops_per_token": run["flops_per_token"],
                 "expert_imbalance": run["expert_imbalance"], "peak_memory_gib": run["peak_memory_gib"],
                 "planned_peak_gib": run["planned_peak_gib"], "startup_s": run["startup_s"],
                 "startup": run["startup"], "command": command}
        if hf:
            entry["baseline"] = {"name": "HF Trainer + grouped_mm" + (" (gradient checkpointing)" if
                                                                      hf.get("gradient_checkpointing") else ""),
                                 "routing": "real", "tokens_per_s_per_gpu": hf.get("tokens_per_s_per_device"),
                                 "failed": hf.get("failed"), "peak_memory_gib": hf.get("peak_memory_gib"),
                                 "weights_dtype": hf.get("weights_dtype")}
            if routing in result.get("ratio_vs_hf_trainer", {}):
                entry["ratio_vs_baseline"] = result["ratio_vs_hf_trainer"][routing]
        entries.append(entry)
    return entries


def _same_workload(bare: dict, entry: dict) -> bool:
    a, b = bare["shape"], entry["shape"]
    return (a["layers"], a["seq"], a["rows_per_step"], a["hidden"]) == (
        b.get("num_layers"), b["seq"], b["rows_per_step"], b.get("hidden_size")) and entry["lora"] is False


def session_entries(out: Path, date: str) -> list[dict]:
    """Every measurement under OUT, each with its same-call baseline where the session has one."""
    commands = step_commands(out)
    bare = [e for path in sorted(out.glob("gpu*.json")) for e in _bare_entries(path, commands.get(path.name))]
    trainer = [_protocol_entry(path, commands.get(path.parent.name)) for path in sorted(out.glob("*/protocol-*.json"))]
    for entry in trainer:
        same = [b for b in bare if _same_workload(b, entry) and b["compiled"] == entry["compiled"]]
        if "baseline" not in entry and same:
            best = max(same, key=lambda b: b["tokens_per_s_per_gpu"])  # the faster attention kernel of the stack
            entry["baseline"] = {"name": best["measurement"], "tokens_per_s_per_gpu": best["tokens_per_s_per_gpu"]}
        if (base := entry.get("baseline")) and base.get("tokens_per_s_per_gpu"):
            entry["ratio_vs_baseline"] = round(entry["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"], 3)
    moe = [e for path in sorted(out.glob("*/moe-a3b.json")) for e in _moe_entries(path, commands.get(path.parent.name))]
    return [{"date": date, **e} for e in bare + trainer + moe]


def record(out: Path, date: str, results: Path) -> list[dict]:
    """Append OUT's entries not yet in `results` (written whole, then renamed); the entries added."""
    known = json.loads(results.read_text()) if results.exists() else []
    def key(e: dict) -> tuple:
        return e["date"], e["device"], e["measurement"], e["command"]

    seen = {key(e) for e in known}
    added = [e for e in session_entries(out, date) if key(e) not in seen]
    partial = results.with_suffix(".json.partial")
    partial.write_text(json.dumps(known + added, indent=1) + "\n")
    partial.replace(results)
    return added


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the session's fetched OUT folder")
    parser.add_argument("--date", default=datetime.date.today().isoformat())
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if not args.out.is_dir():
        parser.error(f"{args.out}: not a folder (the OUT that bench/gpu-session.sh wrote)")
    for entry in record(args.out, args.date, args.results):
        base = entry.get("baseline")
        print(f"{entry['measurement']}: {entry['tokens_per_s_per_gpu']:,.0f} tok/s/GPU, MFU {entry['mfu']:.1%}"
              + (f", {entry['ratio_vs_baseline']:.2f}× {base['name']}" if "ratio_vs_baseline" in entry else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
