"""The run report: `runs/<id>/report/index.html` plus one PNG per plot, from the run directory alone.

The page is self-contained (the plots are embedded as data URIs, no script, no external asset), so it
can be mailed or opened from a bucket; the PNGs sit beside it for slides and tickets. It reads only the
run directory contract (docs/architecture.md §4): metrics.jsonl, manifest.json, summary.json, eval.json, spec.yaml.
"""

from __future__ import annotations

import base64
import html
import io
import json
import logging
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from shardline.errors import ShardlineError
from shardline.goodput import BUCKETS, Goodput, compute_goodput
from shardline.jsonl import read_jsonl
from shardline.rundir import remove_run_file, write_run_file

log = logging.getLogger("shardline")
GiB = 2**30


@dataclass
class RunRecords:
    """metrics.jsonl split by kind; `segments` are the train records of each attempt (a resume starts one)."""

    segments: list[list[dict]] = field(default_factory=lambda: [[]])
    evals: list[dict] = field(default_factory=list)
    checkpoints: list[dict] = field(default_factory=list)  # stall records, with save_s merged from commits
    resumes: list[dict] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    setup: dict = field(default_factory=dict)

    @property
    def train(self) -> list[dict]:
        return [r for seg in self.segments for r in seg]


def read_records(metrics_file: Path) -> RunRecords:
    out = RunRecords()
    saves: dict[int, float] = {}
    for r in read_jsonl(metrics_file):
        kind, event = r.get("kind"), r.get("event")
        if kind == "train":
            seg = out.segments[-1]
            if seg and r["step"] <= seg[-1]["step"]:
                out.segments.append([])  # a restart that resumed from an earlier step
            out.segments[-1].append(r)
        elif kind == "eval":
            out.evals.append(r)
        elif event == "checkpoint" or (kind == "checkpoint" and "stall_s" in r):
            out.checkpoints.append(dict(r))
        elif event == "checkpoint_committed":
            saves[r["step"]] = r["save_s"]
        elif event == "resume":
            out.resumes.append(r)
            if out.segments[-1]:
                out.segments.append([])
        elif event == "setup":
            out.setup = r
        if kind == "event" and event not in ("checkpoint", "checkpoint_committed", "setup", "goodput"):
            out.events.append(r)
    for c in out.checkpoints:
        c["save_s"] = saves.get(c["step"])
    out.segments = [s for s in out.segments if s] or [[]]
    return out


# ---- plots ---------------------------------------------------------------------------------------------
def _figure(title: str):
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(8, 3.4), dpi=110)
    fig.subplots_adjust(left=0.11, right=0.9, top=0.9, bottom=0.14)  # fixed: constrained layout doubles the time
    ax = fig.add_subplot()
    ax.set_title(title, fontsize=11, loc="left")
    ax.grid(alpha=0.3)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    return fig, ax


def _mark_resumes(ax, recs: RunRecords) -> None:
    for i, r in enumerate(recs.resumes):
        ax.axvline(r["step"], color="tab:red", ls="--", lw=1, label="resume" if i == 0 else None)


def _series(seg: list[dict], key: str, scale: float = 1.0) -> tuple[list, list]:
    pts = [(r["step"], r[key] * scale) for r in seg if r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def _lines(ax, recs: RunRecords, key: str, label: str, color: str, scale: float = 1.0) -> None:
    for i, seg in enumerate(recs.segments):
        x, y = _series(seg, key, scale)
        ax.plot(x, y, color=color, lw=1.4, label=label if i == 0 else None)


def plot_loss(recs: RunRecords):
    fig, ax = _figure("loss")
    _lines(ax, recs, "loss", "train loss", "tab:blue")
    val = [(r["step"], r["val_loss"]) for r in recs.evals if r.get("val_loss") is not None]
    if val:
        ax.plot(*zip(*val, strict=True), "o-", color="tab:orange", label="validation loss")
    names = sorted({n for r in recs.evals for n in r.get("val_loss_by_source") or {}})
    for name in names:  # a mixture: each source's validation loss
        points = [(r["step"], r["val_loss_by_source"][name]) for r in recs.evals
                  if name in (r.get("val_loss_by_source") or {})]
        ax.plot(*zip(*points, strict=True), ".--", lw=1, label=f"validation: {name}")
    _mark_resumes(ax, recs)
    ax.set_ylabel("loss")
    ax.legend(loc="upper right")
    return fig


def plot_preference(recs: RunRecords):
    """DPO (`train.objective: dpo`): reward accuracy and margin per step, and on the held-out pairs."""
    fig, ax = _figure("preference: reward accuracy (left) and reward margin (right)")
    margin_ax = ax.twinx()
    for i, seg in enumerate(recs.segments):
        points = [(r["step"], r["preference"]) for r in seg if r.get("preference")]
        if points:
            steps = [p[0] for p in points]
            ax.plot(steps, [p[1]["accuracy"] for p in points], color="tab:blue", lw=1.2,
                    label="reward accuracy (train)" if i == 0 else None)
            margin_ax.plot(steps, [p[1]["margin"] for p in points], color="tab:purple", lw=1, alpha=0.7,
                           label="margin (train)" if i == 0 else None)
    held = [(r["step"], r["val_preference"]) for r in recs.evals if r.get("val_preference")]
    if held:
        steps = [p[0] for p in held]
        ax.plot(steps, [p[1]["accuracy"] for p in held], "o-", color="tab:orange", label="reward accuracy (held out)")
        ax.plot(steps, [p[1]["prefers_chosen"] for p in held], "s--", color="tab:green",
                label="chosen more likely (held out)")
        margin_ax.plot(steps, [p[1]["margin"] for p in held], "o:", color="tab:red", label="margin (held out)")
    _mark_resumes(ax, recs)
    ax.set_ylim(-0.02, 1.02)
    ax.set_ylabel("share of pairs")
    margin_ax.set_ylabel("β·log-ratio margin")
    _twin_legend(ax, margin_ax)
    return fig


def _twin_legend(ax, twin) -> None:
    """One legend for a plot and its twin axis."""
    lines, labels = ax.get_legend_handles_labels()
    more, more_labels = twin.get_legend_handles_labels()
    ax.legend(lines + more, labels + more_labels, loc="lower right", fontsize=8)


def plot_grpo(recs: RunRecords):
    """GRPO (`train.objective: grpo`): reward, solved share and KL per step (left), completion length (right)."""
    fig, ax = _figure("GRPO: reward, solved share and KL (left), completion length (right)")
    length_ax = ax.twinx()
    for i, seg in enumerate(recs.segments):
        points = [(r["step"], r["grpo"]) for r in seg if r.get("grpo")]
        if not points:
            continue
        steps, found = [p[0] for p in points], [p[1] for p in points]
        first = i == 0
        ax.plot(steps, [f["reward"] for f in found], color="tab:blue", lw=1.2, label="mean reward" if first else None)
        if all("solved" in f for f in found):
            ax.plot(steps, [f["solved"] for f in found], color="tab:green", lw=1,
                    label="completions solved" if first else None)
        if any(f["kl"] for f in found):
            ax.plot(steps, [f["kl"] for f in found], color="tab:red", lw=1, label="KL to reference" if first else None)
        length_ax.plot(steps, [f["completion_length"] for f in found], color="tab:gray", lw=1, alpha=0.7,
                       label="completion tokens" if first else None)
    _mark_resumes(ax, recs)
    ax.set_ylabel("reward · share · KL")
    length_ax.set_ylabel("tokens per completion")
    _twin_legend(ax, length_ax)
    return fig


def plot_throughput(recs: RunRecords):
    fig, ax = _figure("throughput and MFU")
    _lines(ax, recs, "tokens_per_s_per_device", "tokens/s per device", "tab:green")
    ax.set_ylabel("tokens/s per device")
    right = ax.twinx()
    for i, seg in enumerate(recs.segments):  # dashed: MFU is tokens/s × a constant, the lines coincide
        x, y = _series(seg, "mfu", 100)
        right.plot(x, y, color="tab:purple", lw=1.2, ls="--", label="MFU" if i == 0 else None)
    right.set_ylabel("MFU %")
    _mark_resumes(ax, recs)
    handles = ax.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    ax.legend(handles=handles, loc="lower right")
    return fig


def plot_step_time(recs: RunRecords):
    fig, ax = _figure("step time breakdown")
    steps = [r["step"] for r in recs.train]
    wait = [r["data_wait_s"] for r in recs.train]
    compute = [max(0.0, r["step_time_s"] - r["data_wait_s"]) for r in recs.train]
    ax.bar(steps, compute, width=1.0, color="tab:blue", label="compute + communication")
    ax.bar(steps, wait, width=1.0, bottom=compute, color="tab:orange", label="data wait")
    top = {s: c + w for s, c, w in zip(steps, compute, wait, strict=True)}
    stalls = [(c["step"], c["stall_s"]) for c in recs.checkpoints]
    if stalls:
        ax.bar([s for s, _ in stalls], [v for _, v in stalls], bottom=[top.get(s, 0.0) for s, _ in stalls],
               width=1.0, color="tab:red", label="checkpoint stall (after the step)")
    _mark_resumes(ax, recs)
    ax.set_ylabel("seconds")
    ax.legend(loc="upper right")
    return fig


def plot_stragglers(recs: RunRecords):
    """Per-rank step time (resilience/stragglers.py): the slowest and the median rank per step, and which rank
    was the slowest (right axis); the title names the rank slowest most often and its mean excess."""
    fig, ax = _figure("per-rank step time")
    _lines(ax, recs, "step_time_max_s", "slowest rank", "tab:red")
    _lines(ax, recs, "step_time_median_s", "median rank", "tab:blue")
    ax.set_ylabel("seconds")
    ax.set_ylim(bottom=0)
    right = ax.twinx()
    timed = [r for r in recs.train if r.get("slowest_rank") is not None]
    right.scatter([r["step"] for r in timed], [r["slowest_rank"] for r in timed], s=6, color="tab:gray",
                  label="slowest rank (right axis)")
    from matplotlib.ticker import MaxNLocator

    right.set_ylabel("rank")
    right.yaxis.set_major_locator(MaxNLocator(integer=True))
    world = recs.setup.get("world") or 1 + max((r["slowest_rank"] for r in timed), default=0)
    right.set_ylim(-0.5, world - 0.5)
    if timed:
        counts = Counter(r["slowest_rank"] for r in timed)
        rank, n = counts.most_common(1)[0]
        excess = statistics.fmean(r["step_time_max_s"] - r["step_time_median_s"] for r in timed
                                  if r["slowest_rank"] == rank)
        ax.set_title(f"per-rank step time · slowest most often: rank {rank} ({100 * n / len(timed):.0f}% of steps, "
                     f"+{excess:.3g}s over the median)", fontsize=11, loc="left")
    _mark_resumes(ax, recs)
    handles = ax.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    ax.legend(handles=handles, loc="upper right")
    return fig


def plot_experts(recs: RunRecords):
    """A mixture of experts' routing (model/moe.py): each expert's share of the step's routed tokens, summed over
    the MoE layers (a heat map: 1/E everywhere is balanced), the title with the largest expert's load over the mean
    (`expert_imbalance`, the worst layer) at the first and last step, and with a capacity factor the routed copies
    dropped over the run (`expert_dropped`)."""
    last = {r["step"]: r for r in recs.train if r.get("expert_tokens")}  # a redone step: its last record
    steps = sorted(last)
    shares = [[n / max(1, sum(last[s]["expert_tokens"])) for n in last[s]["expert_tokens"]] for s in steps]
    experts = len(shares[0])
    fig, ax = _figure("")
    image = ax.imshow([list(col) for col in zip(*shares, strict=True)], aspect="auto", origin="lower",
                      cmap="viridis", interpolation="nearest",
                      extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, experts - 0.5))
    from matplotlib.ticker import MaxNLocator

    ax.grid(False)
    ax.set_ylabel("expert")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    colorbar = fig.colorbar(image, ax=ax, pad=0.02)
    colorbar.set_label(f"share of routed tokens (balanced: 1/{experts})")
    first, final = last[steps[0]].get("expert_imbalance"), last[steps[-1]].get("expert_imbalance")
    dropped = [last[s]["expert_dropped"] for s in steps if last[s].get("expert_dropped") is not None]
    routed = sum(sum(last[s]["expert_tokens"]) for s in steps)
    capacity = (f"\ndropped over capacity: {sum(dropped):,} of {routed:,} routed copies "
                f"({100 * sum(dropped) / max(1, routed):.2f} %)") if dropped else ""
    ax.set_title(f"tokens per expert · busiest expert over the mean: {first:.2f} at step {steps[0]}, {final:.2f} at "
                 f"step {steps[-1]}{capacity}", fontsize=11, loc="left")
    _mark_resumes(ax, recs)
    return fig


def plot_memory(recs: RunRecords):
    fig, ax = _figure("peak memory (rank 0)")
    _lines(ax, recs, "mem_peak_bytes", "measured peak", "tab:blue", scale=1 / GiB)
    planned = recs.setup.get("planned_peak_bytes")
    if planned:
        ax.axhline(planned / GiB, color="tab:gray", ls=":", label="planned (shardline plan)")
    _mark_resumes(ax, recs)
    ax.set_ylabel("GiB")
    ax.set_ylim(bottom=0)
    ax.legend(loc="lower right")
    return fig


def plot_checkpoints(recs: RunRecords):
    fig, ax = _figure("checkpoints: training stall and time to commit")
    if recs.checkpoints:  # one pair of bars per checkpoint, in the order they were taken
        n = len(recs.checkpoints)
        ax.bar([i - 0.2 for i in range(n)], [c["stall_s"] for c in recs.checkpoints], width=0.4,
               color="tab:red", label="training stalled")
        ax.bar([i + 0.2 for i in range(n)], [c.get("save_s") or 0 for c in recs.checkpoints], width=0.4,
               color="tab:gray", label="save → COMMITTED")
        every = max(1, n // 20)
        ax.set_xticks(range(0, n, every), [str(c["step"]) for c in recs.checkpoints][::every])
        ax.set_xlabel("checkpoint at step")
        tallest = max(max(c["stall_s"], c.get("save_s") or 0) for c in recs.checkpoints)
        ax.set_ylim(0, 1.3 * tallest or 1)  # room for the legend above the bars
        ax.legend(loc="upper left", ncols=2)
    else:
        ax.text(0.5, 0.5, "no checkpoints recorded", ha="center", va="center", transform=ax.transAxes)
    ax.set_ylabel("seconds")
    return fig


def plot_cost(recs: RunRecords):
    fig, ax = _figure("cost")
    _lines(ax, recs, "cost_usd", "run cost so far ($)", "tab:brown")
    ax.set_ylabel("US dollars")
    right = ax.twinx()
    _lines(right, recs, "cost_usd_per_1m_tokens", "$ per 1M tokens", "tab:olive")
    right.set_ylabel("$ per 1M tokens")
    _mark_resumes(ax, recs)
    handles = ax.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    ax.legend(handles=handles, loc="upper left")
    return fig


BUCKET_COLORS = {"productive": "tab:green", "generation": "tab:cyan", "scoring": "tab:purple", "startup": "tab:orange",
                 "data_preparation": "gold",
                 "data_wait": "tab:olive", "checkpoint_save": "tab:red", "checkpoint_restore": "tab:pink",
                 "eval": "tab:blue", "wasted": "black", "restart_gap": "tab:gray", "other": "lightgray"}


def plot_goodput(goodput: Goodput):
    """Top: each attempt's wall time by bucket (the gap before it included); bottom: the run's timeline."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.2), dpi=110)
    fig.subplots_adjust(left=0.11, right=0.97, top=0.9, bottom=0.12, hspace=0.75)
    bars, line = fig.subplots(2, 1, height_ratios=[max(1, len(goodput.attempts)), 1])
    bars.set_title(f"goodput {100 * goodput.ratio:.1f}% of {goodput.wall_s:.0f} s", fontsize=11, loc="left")
    run_start = goodput.attempts[0].start
    previous_end = None
    labelled: set[str] = set()
    for i, attempt in enumerate(goodput.attempts):
        widths = dict(attempt.buckets)
        widths["restart_gap"] = attempt.start - previous_end if previous_end is not None else 0.0
        left = 0.0
        for bucket in ("restart_gap", *(b for b in BUCKETS if b != "restart_gap")):  # the gap came first
            if widths.get(bucket, 0.0) > 0:
                bars.barh(i, widths[bucket], left=left, color=BUCKET_COLORS[bucket],
                          label=bucket.replace("_", " ") if bucket not in labelled else None)
                labelled.add(bucket)
                left += widths[bucket]
        if previous_end is not None:
            line.axvspan(previous_end - run_start, attempt.start - run_start, color=BUCKET_COLORS["restart_gap"])
        setup_end = attempt.start + attempt.buckets["startup"] + attempt.buckets["data_preparation"]
        line.axvspan(attempt.start - run_start, setup_end - run_start, color=BUCKET_COLORS["startup"])
        line.axvspan(setup_end - run_start, attempt.end - run_start, color=BUCKET_COLORS["productive"], alpha=0.8)
        line.text((attempt.start + attempt.end) / 2 - run_start, 0.5, f"{attempt.attempt}: {attempt.ended_by}",
                  ha="center", va="center", fontsize=8)
        previous_end = attempt.end
    bars.set_yticks(range(len(goodput.attempts)),
                    [f"attempt {a.attempt}\nsteps {a.first_step}–{a.last_step}" for a in goodput.attempts],
                    fontsize=8)
    bars.invert_yaxis()
    bars.set_xlabel("seconds")
    bars.legend(loc="upper left", bbox_to_anchor=(0, -0.35), ncols=5, fontsize=7, frameon=False)
    line.set_yticks([])
    line.set_xlim(0, goodput.wall_s)
    line.set_xlabel("seconds since the run started (orange: startup, green: training, gray: between attempts)")
    return fig


PLOTS: dict[str, tuple[str, Callable]] = {
    "loss.png": ("Loss and validation loss", plot_loss),
    "throughput.png": ("Tokens/s per device and MFU", plot_throughput),
    "step_time.png": ("Step-time breakdown", plot_step_time),
    "memory.png": ("Memory", plot_memory),
    "checkpoints.png": ("Checkpoints", plot_checkpoints),
    "cost.png": ("Cost", plot_cost),
}


# ---- the page ------------------------------------------------------------------------------------------
def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except ValueError:
        return {}


def _fmt(value) -> str:
    if isinstance(value, float) and value > 1e9:  # a Unix time
        from datetime import UTC, datetime

        return datetime.fromtimestamp(value, UTC).isoformat(timespec="seconds")
    if isinstance(value, float):
        return f"{value:,.6g}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def _table(rows: list[tuple[str, object]]) -> str:
    body = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(_fmt(v))}</td></tr>" for k, v in rows
                   if v is not None)
    return f"<table>{body}</table>"


def _grid(header: list[str], rows: list[list[object]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(v))}</td>" for v in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


CSS = """body{font-family:system-ui,sans-serif;margin:24px auto;max-width:1100px;color:#222}
h1{font-size:22px}h2{font-size:17px;border-bottom:1px solid #ddd;padding-bottom:4px;margin-top:28px}
table{border-collapse:collapse;font-size:13px;margin:6px 0}th,td{border:1px solid #ddd;padding:3px 8px;
text-align:left;vertical-align:top}th{background:#f4f4f4}.plots{display:grid;grid-template-columns:1fr 1fr;gap:12px}
figure{margin:0}figure img{width:100%;border:1px solid #eee}figcaption{font-size:13px;color:#555}
pre{background:#f7f7f7;padding:8px;font-size:12px;overflow:auto;max-height:400px}.ok{color:#080}.bad{color:#b00}
.warn{color:#a60}.failure{border:2px solid #b00;padding:4px 12px;margin:12px 0;background:#fff6f6}
.failure pre{white-space:pre-wrap;background:#fff}"""


def write_report(run_dir: Path) -> Path:
    """Write `<run_dir>/report/index.html` and the PNGs; returns the page's path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    metrics_file = run_dir / "metrics.jsonl"
    if not metrics_file.is_file():
        raise ShardlineError(str(run_dir), "has no metrics.jsonl", "pass a run directory that has trained")
    recs = read_records(metrics_file)
    goodput = compute_goodput(read_jsonl(metrics_file), _read_json(run_dir / "manifest.json"), now=time.time())
    figures = []
    plots = dict(PLOTS)
    if goodput is not None:
        plots["goodput.png"] = ("Goodput: wall time by bucket, per attempt and over time",
                                lambda _: plot_goodput(goodput))
    if any(r.get("preference") for r in recs.train):
        plots["preference.png"] = ("DPO: reward accuracy and margin per step and on the held-out pairs",
                                   plot_preference)
    if any(r.get("grpo") for r in recs.train):
        plots["grpo.png"] = ("GRPO: reward, solved share, KL and completion length per step", plot_grpo)
    if any(r.get("slowest_rank") is not None for r in recs.train):  # a world of more than one rank
        plots["stragglers.png"] = ("Per-rank step time: slowest vs median rank, and which rank", plot_stragglers)
    if any(r.get("expert_tokens") for r in recs.train):  # a mixture of experts
        plots["experts.png"] = ("Mixture of experts: each expert's share of the routed tokens per step", plot_experts)
    priced = any(r.get("cost_usd") is not None for r in recs.train)
    for name, (caption, plot) in plots.items():
        if name == "cost.png" and not priced:  # no price, no panel (the summary says how to set one)
            remove_run_file(run_dir, f"report/{name}")
            continue
        fig = plot(recs)
        FigureCanvasAgg(fig)
        png = io.BytesIO()
        fig.savefig(png, format="png")
        write_run_file(run_dir, f"report/{name}", png.getvalue())  # never through a link planted in report/
        data = base64.b64encode(png.getvalue()).decode()
        figures.append(f'<figure><img alt="{html.escape(caption)}" src="data:image/png;base64,{data}">'
                       f"<figcaption>{html.escape(caption)} ({name})</figcaption></figure>")
    return write_run_file(run_dir, "report/index.html", _page(run_dir, recs, figures, goodput))


def _page(run_dir: Path, recs: RunRecords, figures: list[str], goodput: Goodput | None) -> str:
    manifest = _read_json(run_dir / "manifest.json")
    summary = _read_json(run_dir / "summary.json")
    evaluation = _read_json(run_dir / "eval.json")
    train = recs.train
    last = train[-1] if train else {}
    status = manifest.get("status", "unknown")
    cls = {"finished": "ok", "preempted": "warn"}.get(status, "bad")
    sql = [r for r in recs.evals if r.get("sql_execution_accuracy") is not None]
    headline = _table([
        ("status", f"{status} (exit code {manifest.get('exit_code')})"),
        ("steps", last.get("step")), ("final loss", last.get("loss")),
        ("validation loss", summary.get("val_loss") or next((r["val_loss"] for r in reversed(recs.evals)
                                                              if "val_loss" in r), None)),
        ("SQL execution accuracy", f"{100 * sql[-1]['sql_execution_accuracy']:.1f}% of {sql[-1].get('n')}"
         if sql else None),
        ("SQL exact match", f"{100 * sql[-1]['sql_exact_match']:.1f}%" if sql and "sql_exact_match" in sql[-1]
         else None),
        ("SQL metric", evaluation.get("metric")),
        ("mean tokens/s per device", summary.get("mean_tokens_per_s_per_device")),
        ("mean MFU", f"{100 * summary['mean_mfu']:.2f}% of {summary.get('peak_tflops', 0):.4g} TFLOP/s "
         f"({summary.get('peak_source')})" if "mean_mfu" in summary else None),
        ("peak memory", f"{summary['mem_peak_bytes'] / GiB:.2f} GiB" if summary.get("mem_peak_bytes") else None),
        ("wall time (training loop)", f"{summary['wall_time_s']:.1f} s" if "wall_time_s" in summary else None),
        ("checkpoint stall total", summary.get("checkpoint_stall_s_total")),
        ("resumes", len(recs.resumes)),
        ("goodput", goodput.line() if goodput is not None else None),
        ("cost", _cost_text(summary, last)),
    ])
    versions = manifest.get("versions") or {}
    manifest_rows = [(k, manifest.get(k)) for k in ("run_id", "start_time", "end_time", "host", "world_size",
                                                     "git_commit", "spec_hash", "dataset_version", "image",
                                                     "image_digest", "checkpoint_location", "metrics_url")]
    manifest_rows += [(f"version: {k}", v) for k, v in versions.items()]
    ckpt_rows = [[c["step"], c["stall_s"], c.get("save_s"), c.get("blocking"), c.get("location")]
                 for c in recs.checkpoints]
    resume_rows = [[r["step"], r.get("world"), r.get("rng_restored"), r.get("location")] for r in recs.resumes]
    samples = evaluation.get("samples") or []
    sample_rows = [[{True: "✓", False: "✗"}.get(s.get("match"), ""), s.get("question"), s.get("gold"), s.get("pred")]
                   for s in samples[:10]]  # a user's own data has no verdict: its answers beside the references
    by_source = next((r["val_loss_by_source"] for r in reversed(recs.evals) if "val_loss_by_source" in r), {})
    source_rows = [[s["name"], s["format"], s["weight"], s["train_examples"], s["tokens"].get("train", 0),
                    f"{100 * s['share_of_train_tokens']:.1f}%", by_source.get(s["name"], "–")]
                   for s in recs.setup.get("data_sources") or []]
    spec_text = (run_dir / "spec.yaml").read_text() if (run_dir / "spec.yaml").is_file() else ""
    title = html.escape(manifest.get("run_id") or run_dir.name)
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>{title} · shardline report</title>",
        f"<style>{CSS}</style></head><body>",
        f"<h1>{title} <span class='{cls}'>{html.escape(status)}</span></h1>",
        _failure_box(run_dir, manifest),
        "<h2>Summary</h2>", headline,
        "<h2>Plots</h2>", f"<div class='plots'>{''.join(figures)}</div>",
        *(["<h2>Data sources</h2>", _grid(["source", "format", "weight", "training examples", "training tokens",
                                           "share of training tokens", "validation loss"], source_rows)]
          if len(source_rows) > 1 else []),
        "<h2>Final evaluation</h2>",
        _grid(["", "question", "gold", "prediction"], sample_rows) if sample_rows
        else f"<p>{html.escape(_evaluation_absent(manifest, status))}</p>",
        "<h2>Goodput</h2>", _goodput_table(goodput),
        "<h2>Checkpoints</h2>",
        _grid(["step", "stall s", "save s", "blocking", "location"], ckpt_rows) if ckpt_rows else "<p>none</p>",
        "<h2>Resumes</h2>",
        _grid(["step", "world", "RNG restored", "from"], resume_rows) if resume_rows else "<p>none</p>",
        "<h2>Manifest</h2>", _table(manifest_rows),
        f"<h2>Spec</h2><details><summary>spec.yaml</summary><pre>{html.escape(spec_text)}</pre></details>",
        "</body></html>",
    ]
    return "\n".join(parts)


def _goodput_table(goodput: Goodput | None) -> str:
    """Each bucket's seconds and share of the wall time, per attempt and for the run (shardline.goodput)."""
    if goodput is None or goodput.wall_s <= 0:
        return "<p>no attempt recorded its setup yet</p>"
    header = ["bucket", "run s", "% of wall"] + [f"attempt {a.attempt} s" for a in goodput.attempts]
    rows = [[b.replace("_", " "), goodput.buckets[b], f"{100 * goodput.buckets[b] / goodput.wall_s:.1f}%"]
            + [round(a.buckets.get(b, 0.0), 2) if b != "restart_gap" else "–" for a in goodput.attempts]
            for b in BUCKETS]
    rows.append(["wall", goodput.wall_s, "100%"] + [round(a.wall_s, 2) for a in goodput.attempts])
    rows.append(["ended by", "", ""] + [a.ended_by for a in goodput.attempts])
    rows.append(["recovery s (previous end → first step)", "", ""]
                + [a.recovery_s if a.recovery_s is not None else "–" for a in goodput.attempts])
    return _grid(header, rows)


def _failure_box(run_dir: Path, manifest: dict) -> str:
    """What failed, where and what is safe: the first thing on the page of a failed run."""
    failure = manifest.get("failure") if manifest.get("status") == "failed" else None
    if not failure:
        return ""
    rank = failure.get("rank")
    log = run_dir / "logs" / f"rank-{rank}.log" if rank is not None else run_dir / "logs"
    committed = failure.get("committed_step")
    rows = [("failed rank", rank if rank is not None else "not known (no worker recorded the failure)"),
            ("phase", failure.get("phase")), ("error", failure.get("error_type")),
            ("exit code", manifest.get("exit_code")),
            ("last committed checkpoint", f"step {committed}" if committed is not None else "none"),
            ("log", str(log))]
    return (f"<div class='failure'><h2>Failure</h2><pre>{html.escape(failure.get('message') or '')}</pre>"
            f"{_table(rows)}</div>")


def _evaluation_absent(manifest: dict, status: str) -> str:
    """Why the page has no evaluation samples: it failed, was not asked for, or the run never got there."""
    failure = manifest.get("failure") or {}
    if status == "failed" and failure.get("phase") in ("sql_evaluation", "evaluation"):
        return f"failed: {failure.get('message')}"
    asked = ((manifest.get("spec") or {}).get("train") or {}).get("eval_examples")
    if asked == 0:
        return "not requested (train.eval_examples = 0)"
    if status in ("starting", "running"):
        return "not yet: the final evaluation runs when training ends"
    if status != "finished":
        requested = f" ({asked} examples requested)" if asked else ""
        return f"not run: the run {status} before its final evaluation{requested}"
    return "no evaluation samples were recorded"


def _cost_text(summary: dict, last: dict) -> str:
    if summary.get("cost_usd_total") is not None:
        per_m = summary.get("cost_usd_per_1m_tokens")
        per_m = f", ${per_m:.4g} per 1M tokens" if per_m is not None else ""
        return (f"${summary['cost_usd_total']:.4g}{per_m} at ${summary['usd_per_device_hour']:.4g}/device-hour × "
                f"{summary.get('cost_devices')} devices ({summary.get('price_source')})")
    if last.get("cost_usd") is not None:
        return f"${last['cost_usd']:.4g} up to step {last['step']}"
    return "not tracked (no price: set cost.usd_per_device_hour or cost.gpu)"


def write_report_safely(run_dir: Path, say: Callable[[str], None]) -> Path | None:
    """`write_report`, but a failure is one printed line (the traceback goes to the log), never raised: the
    report never fails a run. A run that never logged a step (it failed during setup) gets no report, quietly:
    the failure's own message is the one the user needs."""
    if not any(r.get("kind") == "train" for r in read_jsonl(run_dir / "metrics.jsonl")):
        log.info("no run report: %s logged no training step", run_dir)
        return None
    try:
        page = write_report(run_dir)
    except Exception as e:
        log.debug("run report not written", exc_info=True)
        say(f"warning: run report not written: {e}")
        return None
    say(f"report: {page}")
    return page


def report_is_current(run_dir: Path) -> bool:
    """The report exists and is newer than everything it shows."""
    page = run_dir / "report" / "index.html"
    if not page.is_file():
        return False
    sources = [run_dir / n for n in ("metrics.jsonl", "manifest.json", "summary.json", "eval.json")]
    return all(page.stat().st_mtime >= s.stat().st_mtime for s in sources if s.is_file())
