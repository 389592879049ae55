"""Straggler view: every rank's own step time, gathered in the step's last all-reduce (no extra collective).

A rank's step time here is the time from the start of its step to its arrival at the end-of-step all-reduce,
less the time it waited for the others at the start-of-step all-reduce of token counts: a rank that is slow
to load or to compute arrives late, and the others' wait for it is not counted as their own time. FSDP's
collectives inside the step still make fast ranks wait for the slow one, so the spread understates a slow
rank's excess; which rank is slowest is what it tells reliably. On GPU the device is synchronised before the
time is taken (the step's result is awaited right after anyway), so the time is the device's, not the launch's.

Each rank writes its time into its own slot of a world-sized vector appended to the loss sum; the sum over
ranks is then every rank's time: W + 1 doubles per step in the all-reduce the step already makes.
"""

from __future__ import annotations

import statistics
import time

import torch


def own_step_seconds(start: float, waited_s: float, device: torch.device) -> float:
    """This rank's time in the step so far (perf_counter `start`), less `waited_s` spent waiting for peers."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start - waited_s


def with_rank_slot(total: torch.Tensor, own_s: float, rank: int, world: int) -> torch.Tensor:
    """[total, 0, …, own_s at 1 + rank, …, 0]: summed over ranks, slot 1 + r holds rank r's time."""
    packed = torch.zeros(world + 1, dtype=torch.float64, device=total.device)
    packed[0] = total
    packed[1 + rank].fill_(own_s)  # a kernel argument: `packed[i] = x` copies x from the host, a sync on a GPU
    return packed


def straggler_fields(rank_seconds: list[float]) -> dict[str, float | int]:
    """The TrainRecord fields: slowest rank's time, the median rank's time, and which rank was slowest;
    none for a single rank (nothing to compare)."""
    if len(rank_seconds) < 2:
        return {}
    slowest = max(range(len(rank_seconds)), key=rank_seconds.__getitem__)
    return {"step_time_max_s": rank_seconds[slowest], "step_time_median_s": statistics.median(rank_seconds),
            "slowest_rank": slowest}
