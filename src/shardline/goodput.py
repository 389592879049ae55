"""Goodput: a run's wall time split into productive step time and badput buckets, across every attempt.

Computed from the run's own records only (metrics.jsonl and manifest.json), so it works for every engine and
after the fact. An *attempt* is one incarnation of the worker group: it begins when rank 0's process starts (the
`setup` event's `process_start`; the launcher's time before that, for the first worker group of a launch, counts
as startup) and ends at its last record. The run's clock starts when the `shardline train` command started
(its imports and spec validation included; a launch through the Python API or an engine starts it when the run
directory is created) and ends at the recorded end; the report written after it is not in it. The buckets, in
seconds, sum to the wall time by construction; what no record explains is `other`, so a large `other` is itself a
finding.

| bucket | what it is |
|---|---|
| productive | step time of the steps that stood, less their data wait (and GRPO's sampling and scoring) |
| generation | GRPO: sampling the completions a step trains on (the model generating with its KV cache) |
| scoring | GRPO: the reward scoring those completions (SQL execution, a user's reward function) |
| startup | process start → training loop: imports, rendezvous, model build and load, the MFU probe; the launcher |
| data_preparation | tokenising and packing (`prepare_s`), or finding the prepared data in the cache |
| data_wait | steps waiting for their batches |
| checkpoint_save | training stalled by checkpoint saves (the async part runs beside training) |
| checkpoint_restore | loading the checkpoint an attempt resumes from |
| eval | validation and generation evaluation |
| wasted | steps computed after the last commit that a failure threw away (counted once redone) |
| restart_gap | from one attempt's last record to the next attempt's start: restart, requeue, a resume later |
| other | the rest: logging, the per-step stop agreement, asynchronous-save bookkeeping, teardown |
"""

from __future__ import annotations

from pydantic import BaseModel

from shardline.clock import epoch as _epoch
from shardline.clock import format_duration

BUCKETS = ("productive", "generation", "scoring", "startup", "data_preparation", "data_wait", "checkpoint_save",
           "checkpoint_restore", "eval", "wasted", "restart_gap", "other")
BADPUT = BUCKETS[1:]
FIELDS = ("kind", "event", "time", "step", "step_time_s", "data_wait_s", "grpo", "stall_s", "restore_s", "seconds",
          "process_start", "prepare_s")
"""The record fields goodput reads: a reader that keeps records for it may drop the rest."""


def goodput_fields(record: dict) -> dict:
    return {k: record[k] for k in FIELDS if k in record}


class AttemptGoodput(BaseModel):
    """One worker-group incarnation: its window (epoch seconds), its steps and its buckets (no restart gap)."""

    attempt: int
    start: float
    end: float
    first_step: int | None = None
    last_step: int | None = None
    ended_by: str = "unknown"
    """finished, preempted, failed (an exception, kill -9, a lost node: a restart followed), or running."""
    buckets: dict[str, float]
    first_step_start: float | None = None
    """When its first step began (epoch seconds); None when it trained no step."""
    recovery_s: float | None = None
    """Attempts after the first: from the previous attempt's last record (the failure or stop, to within one
    step) to this attempt's first step: restart, startup, data, restore."""

    @property
    def wall_s(self) -> float:
        return self.end - self.start


class Goodput(BaseModel):
    """The run's goodput: productive seconds over wall seconds, and where the rest went."""

    wall_s: float
    ratio: float
    buckets: dict[str, float]
    attempts: list[AttemptGoodput]

    def line(self) -> str:
        """`goodput 81.2% of 4m10s · startup 9.1% · wasted 4.0% · …` (badput buckets above 0.5%, largest first)."""
        if self.wall_s <= 0:
            return "goodput: no time recorded yet"
        shares = sorted(((self.buckets[b] / self.wall_s, b) for b in BADPUT), reverse=True)
        rest = " · ".join(f"{b.replace('_', ' ')} {100 * f:.1f}%" for f, b in shares if f >= 0.005)
        recoveries = [a.recovery_s for a in self.attempts if a.recovery_s is not None]
        recovered = f" · recovery {', '.join(f'{r:.1f}s' for r in recoveries)}" if recoveries else ""
        return (f"goodput {100 * self.ratio:.1f}% of {format_duration(self.wall_s)} over {len(self.attempts)} "
                f"attempt(s)" + (f" · {rest}" if rest else "") + recovered)


def compute_goodput(records: list[dict], manifest: dict, now: float | None = None) -> Goodput | None:
    """The goodput of a run from its metrics records (in file order) and its manifest; None before the first
    attempt recorded its setup. `now` closes a live run's last attempt (default: its last record)."""
    attempts = _split_attempts(records)
    if not attempts:
        return None
    end = _run_end(manifest, records, now)
    redone = _redone_occurrences(attempts)
    launches = {t: float(a.get("prepare_s") or 0.0) for a in manifest.get("attempts") or []
                if (t := _epoch(a.get("start_time"))) is not None}  # launch start → the launcher's data preparation
    run_start = _epoch(manifest.get("start_time"))
    results: list[AttemptGoodput] = []
    gaps = 0.0
    previous_end: float | None = None
    run_opened: float | None = None  # the run's first launch, when it came before the first worker group's
    for index, (setup, rows) in enumerate(attempts):
        last = index == len(attempts) - 1
        rows = [r for r in rows if r.get("time", 0.0) <= end]
        result = _attempt(index, setup, rows, redone, end if last else None, manifest if last else {})
        # The launcher's lead before this worker group: from the launch that started it (the latest one since the
        # previous attempt). An earlier launch that ended without a worker group (it failed in setup) and the idle
        # time until the next launch are restart_gap, never startup: a relaunch a day later is not a day of startup.
        lead_from = [t for t in launches if t <= result.start and (previous_end is None or t > previous_end)]
        if index == 0 and run_start is not None and run_start <= result.start:
            lead_from.append(run_start)
        if lead_from:
            launched = max(lead_from)
            lead = result.start - launched
            prepared = min(lead, launches.get(launched, 0.0))
            result.buckets["data_preparation"] += prepared
            result.buckets["startup"] += lead - prepared
            result.start = launched
            if index == 0 and (first := min(lead_from)) < launched:
                gaps += launched - first
                run_opened = first
        if previous_end is not None and result.start < previous_end:  # a pooled process (Ray) started earlier
            result.buckets["startup"] = max(0.0, result.buckets["startup"] - (previous_end - result.start))
            result.start = previous_end
        if previous_end is not None:
            gaps += max(0.0, result.start - previous_end)
            if result.first_step_start is not None:
                result.recovery_s = round(result.first_step_start - previous_end, 3)
        previous_end = result.end
        results.append(result)
    wall = results[-1].end - (results[0].start if run_opened is None else run_opened)
    totals = {b: sum(a.buckets.get(b, 0.0) for a in results) for b in BUCKETS}
    totals["restart_gap"] = gaps
    totals["other"] = 0.0
    totals["other"] = max(0.0, wall - sum(totals.values()))
    rounded = {b: round(v, 3) for b, v in totals.items()}
    return Goodput(wall_s=round(wall, 3), ratio=round(totals["productive"] / wall, 4) if wall > 0 else 0.0,
                   buckets=rounded, attempts=results)


# ---- pieces ------------------------------------------------------------------------------------------------
def _split_attempts(records: list[dict]) -> list[tuple[dict, list[dict]]]:
    """[(setup event, the records that follow it until the next setup)] for training attempts."""
    attempts: list[tuple[dict, list[dict]]] = []
    for r in records:
        if r.get("kind") == "event" and r.get("event") == "setup" and "time" in r:
            attempts.append((r, []))
        elif attempts:
            attempts[-1][1].append(r)
    return attempts


def _redone_occurrences(attempts: list[tuple[dict, list[dict]]]) -> set[tuple[int, int]]:
    """(attempt index, step) of step records that a later attempt computed again: the wasted ones."""
    redone: set[tuple[int, int]] = set()
    later: set[int] = set()
    for index in range(len(attempts) - 1, -1, -1):
        steps = {r["step"] for r in attempts[index][1] if r.get("kind") == "train"}
        redone |= {(index, s) for s in steps & later}
        later |= steps
    return redone


def _attempt(index: int, setup: dict, rows: list[dict], redone: set[tuple[int, int]], close: float | None,
             manifest: dict) -> AttemptGoodput:
    setup_time = float(setup["time"])
    start = float(setup.get("process_start") or setup_time)
    buckets = dict.fromkeys(BUCKETS, 0.0)
    prepare = float(setup.get("prepare_s") or 0.0)
    buckets["data_preparation"] = prepare
    buckets["startup"] = max(0.0, setup_time - start - prepare)
    steps = [r for r in rows if r.get("kind") == "train"]
    for r in steps:
        if (index, r["step"]) in redone:
            buckets["wasted"] += r["step_time_s"]
        else:
            wait = min(r.get("data_wait_s", 0.0), r["step_time_s"])
            rollout = r.get("grpo") or {}
            sampled = min(rollout.get("generation_s", 0.0), r["step_time_s"] - wait)
            scored = min(rollout.get("reward_s", 0.0), r["step_time_s"] - wait - sampled)
            buckets["productive"] += r["step_time_s"] - wait - sampled - scored
            buckets["data_wait"] += wait
            buckets["generation"] += sampled
            buckets["scoring"] += scored
    events = [r for r in rows if r.get("kind") == "event"]
    buckets["checkpoint_save"] = sum(r.get("stall_s", 0.0) for r in events
                                     if r.get("event") in ("checkpoint", "checkpoint_wait"))
    buckets["checkpoint_restore"] = sum(r.get("restore_s", 0.0) for r in events if r.get("event") == "resume")
    buckets["eval"] = sum(r.get("seconds", 0.0) for r in rows if r.get("kind") == "eval")
    end = max([setup_time, *(r.get("time", setup_time) for r in rows)])
    if close is not None:
        end = max(end, close)
    buckets["other"] = max(0.0, end - start - sum(buckets.values()))
    return AttemptGoodput(attempt=index + 1, start=start, end=end,
                          first_step_start=steps[0]["time"] - steps[0]["step_time_s"]
                          if steps and "time" in steps[0] else None,
                          first_step=steps[0]["step"] if steps else None,
                          last_step=steps[-1]["step"] if steps else None,
                          ended_by=_ended_by(events, close, manifest), buckets=buckets)


def _ended_by(events: list[dict], close: float | None, manifest: dict) -> str:
    if any(e.get("event") == "preempted" for e in events):
        return "preempted"
    if close is None:
        return "failed"  # a later attempt followed without a preemption: a crash, a kill or a lost node
    status = manifest.get("status")
    return {"finished": "finished", "failed": "failed", "preempted": "preempted"}.get(status, "running")


def _run_end(manifest: dict, records: list[dict], now: float | None) -> float:
    """The end of the run's wall time: its recorded end when it ended, else `now` or its last record."""
    last = max((r.get("time", 0.0) for r in records), default=0.0)
    ended = _epoch(manifest.get("end_time"))
    if manifest.get("status") in ("finished", "failed", "preempted") and ended is not None:
        return ended  # records after it (a later `shardline eval`) are not training time
    return max(now, last) if now is not None else last
