"""`observe.profile_steps`: torch.profiler over a few training steps, per rank.

Steps 4 … 3+n are recorded (the first three warm up). Each rank writes `<run>/profile/trace-rank-<r>.json`
(Chrome trace: open in Perfetto or chrome://tracing) and `ops-rank-<r>.txt`: the ops by self time, then the
step's phases (`shardline.data`, `.forward`, `.backward`, `.clip`, `.optimizer`, `.sync`) as the trainer
labels them with `record_function`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

FIRST_STEP = 4


class StepProfiler:
    def __init__(self, steps: int, run_dir: Path, rank: int, device: torch.device) -> None:
        self.steps, self.rank = steps, rank
        self.out = run_dir / "profile"
        self.activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.session: profile | None = None

    def before_step(self, step: int) -> None:
        """`step` is the one about to run (1-based)."""
        if self.steps and step == FIRST_STEP:
            self.session = profile(activities=self.activities, record_shapes=True)
            self.session.start()

    def after_step(self, step: int) -> Path | None:
        """Stop after the last profiled step; returns the ops table written, if any."""
        if self.session is None or step < FIRST_STEP + self.steps - 1:
            return None
        session, self.session = self.session, None
        session.stop()
        self.out.mkdir(parents=True, exist_ok=True)
        session.export_chrome_trace(str(self.out / f"trace-rank-{self.rank}.json"))
        events = session.key_averages()
        sort = "self_cuda_time_total" if ProfilerActivity.CUDA in self.activities else "self_cpu_time_total"
        phases = [e for e in events if e.key.startswith("shardline.")]
        table = self.out / f"ops-rank-{self.rank}.txt"
        table.write_text(
            f"steps {FIRST_STEP}-{FIRST_STEP + self.steps - 1}, rank {self.rank}\n\n"
            + events.table(sort_by=sort, row_limit=40) + "\n\nphases (wall time inside each label, all steps)\n"
            + "\n".join(f"{e.key:24} {e.cpu_time_total / 1e6:9.3f} s  ({e.count} calls)" for e in
                        sorted(phases, key=lambda e: -e.cpu_time_total)) + "\n")
        return table
