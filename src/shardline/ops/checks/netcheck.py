"""Collective bandwidth sweep over torch.distributed, measured and reported the way nccl-tests does.

For each op, size and buffer placement: the mean time of `iters` calls on the slowest rank, the
algorithm bandwidth `algbw = bytes / time` and the bus bandwidth `busbw = algbw × factor(n)`, where the
factor turns algbw into the traffic each link carries, so busbw is comparable across ops and world
sizes and with the hardware's link speed (nccl-tests doc/PERFORMANCE.md):

    all_reduce        2(n−1)/n     bytes = the buffer each rank reduces
    all_gather        (n−1)/n      bytes = the gathered output (n × each rank's input)
    reduce_scatter    (n−1)/n      bytes = the input each rank reduces (n × its output)
    all_to_all        (n−1)/n      bytes = each rank's send buffer
    broadcast         1            bytes = the buffer

After timing, buffers are refilled with a known pattern, the op runs once more and every element is
compared with the value it must have (`#wrong`, summed over ranks). Data are float32 small integers, so
sums are exact. torch.distributed's all_reduce and broadcast work in place only; their out-of-place
variant copies the send buffer into the receive buffer inside the timed call (one extra local copy).
all_to_all is measured out of place only. GB/s are 10⁹ bytes per second, as in nccl-tests.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from shardline.errors import SpecError
from shardline.spec import JobSpec

DTYPE = torch.float32
PASS_FRACTION = 0.9
"""netcheck passes when the measured busbw reaches this fraction of the expected one (network_profiles.py)."""
CPU_MAX_BYTES = 64 << 20
GPU_MAX_BYTES = 8 << 30
# torch 2.13 names the tensor collectives *_single (the *_tensor names are deprecated there); older torch, such
# as a GPU image's, has only the *_tensor names
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_CHUNK = 1 << 26  # elements per fill/check pass: patterns never need a second full-size buffer


def bus_factor(op: str, world: int) -> float:
    """nccl-tests' factor from algorithm bandwidth to bus bandwidth; 0 for one rank, whose collectives are local
    copies that cross no link (broadcast's factor 1 would otherwise report HBM copy speed as bus bandwidth)."""
    if world == 1:
        return 0.0
    n = world
    factors = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
               "all_to_all": (n - 1) / n, "broadcast": 1.0}
    return factors[op]


def bandwidths(op: str, nbytes: int, seconds: float, world: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s for one call of `op` moving `nbytes` in `seconds`."""
    algbw = nbytes / seconds / 1e9
    return algbw, algbw * bus_factor(op, world)


def placements(op: str) -> tuple[str, ...]:
    return ("out-of-place",) if op == "all_to_all" else ("out-of-place", "in-place")


def message_sizes(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    if min_bytes > max_bytes:
        raise SpecError("launch.netcheck.min_bytes", f"{min_bytes} is larger than max_bytes {max_bytes}",
                        "lower --min-bytes or raise --max-bytes")
    sizes = [min_bytes]
    while sizes[-1] * factor <= max_bytes:
        sizes.append(sizes[-1] * factor)
    return sizes


def element_count(op: str, nbytes: int, world: int) -> int:
    """Elements of the buffer nccl-tests sizes by; split across ranks, it is a multiple of the world size."""
    count = max(1, nbytes // DTYPE.itemsize)
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        count = max(world, count // world * world)
    return count


@dataclass(frozen=True)
class Record:
    op: str
    placement: str
    bytes: int
    count: int
    time_us: float
    algbw_gbps: float
    busbw_gbps: float
    wrong: int


@dataclass(frozen=True)
class Verdict:
    passed: bool
    expected_busbw_gbps: float | None
    measured_busbw_gbps: float | None
    """busbw the threshold was checked against: all_gather out of place at the largest size."""
    wrong: int
    avg_busbw_gbps: float
    reasons: list[str]


def _fill(t: torch.Tensor, values: Callable[[torch.Tensor], torch.Tensor], offset: int = 0) -> None:
    for s in range(0, t.numel(), _CHUNK):
        e = min(t.numel(), s + _CHUNK)
        t[s:e] = values(torch.arange(offset + s, offset + e, device=t.device)).to(t.dtype)


def _wrong(t: torch.Tensor, values: Callable[[torch.Tensor], torch.Tensor]) -> int:
    bad = 0
    for s in range(0, t.numel(), _CHUNK):
        e = min(t.numel(), s + _CHUNK)
        bad += int((t[s:e] != values(torch.arange(s, e, device=t.device)).to(t.dtype)).sum())
    return bad


Collective = tuple[Callable[[], None], Callable[[], None], Callable[[], int]]
"""(fill the inputs with the check pattern, run the op once, count wrong elements of the output)."""


def collective(op: str, placement: str, count: int, rank: int, world: int, device: torch.device) -> Collective:
    n, r, inplace = world, rank, placement == "in-place"
    rank_sum = n * (n + 1) // 2  # every rank contributes (rank + 1) + pattern; pattern sums to n × pattern

    def empty(k: int) -> torch.Tensor:
        return torch.empty(k, dtype=DTYPE, device=device)

    if op in ("all_reduce", "broadcast"):
        send = empty(count)
        recv = send if inplace else empty(count)
        if op == "all_reduce":
            def fill():
                _fill(send, lambda i: (r + 1) + i % 13)

            def call():
                dist.all_reduce(recv)

            def expected(i):
                return rank_sum + n * (i % 13)
        else:
            def fill():
                if r == 0:
                    _fill(send, lambda i: 1 + i % 13)
                else:
                    send.fill_(-1)

            def call():
                dist.broadcast(recv, src=0)

            def expected(i):
                return 1 + i % 13

        def run():
            if recv is not send:
                recv.copy_(send)
            call()

        return fill, run, lambda: _wrong(recv, expected)

    c = count // n  # each rank's share
    if op == "all_gather":
        recv = empty(c * n)
        send = recv[r * c:(r + 1) * c] if inplace else empty(c)

        def fill():
            recv.fill_(-1)
            _fill(send, lambda j: (r + 1) + j % 13)

        return (fill, lambda: ALL_GATHER(recv, send),
                lambda: _wrong(recv, lambda i: (i // c + 1) + (i % c) % 13))
    if op == "reduce_scatter":
        send = empty(c * n)
        recv = send[r * c:(r + 1) * c] if inplace else empty(c)
        return (lambda: _fill(send, lambda i: (r + 1) + i % 13), lambda: REDUCE_SCATTER(recv, send),
                lambda: _wrong(recv, lambda j: rank_sum + n * ((r * c + j) % 13)))
    if op == "all_to_all":
        send, recv = empty(c * n), empty(c * n)

        def fill():
            recv.fill_(-1)
            _fill(send, lambda i: (r * n + i // c) * 13 + (i % c) % 13)

        return (fill, lambda: dist.all_to_all_single(recv, send),
                lambda: _wrong(recv, lambda i: ((i // c) * n + r) * 13 + (i % c) % 13))
    raise SpecError("launch.netcheck.ops", f"unknown op {op!r}", "use all_reduce, all_gather, reduce_scatter, "
                    "all_to_all or broadcast")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(op: str, placement: str, nbytes: int, warmup: int, iters: int, device: torch.device) -> Record:
    """Time one op × size × placement on every rank; all ranks return the same record."""
    rank, world = dist.get_rank(), dist.get_world_size()
    count = element_count(op, nbytes, world)
    fill, run, wrong = collective(op, placement, count, rank, world, device)
    fill()
    for _ in range(warmup):
        run()
    _sync(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        run()
    _sync(device)
    seconds = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64)
    fill()
    run()
    _sync(device)
    bad = torch.tensor([wrong()], dtype=torch.int64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # a collective is done when its slowest rank is
    dist.all_reduce(bad)
    real_bytes = count * DTYPE.itemsize
    algbw, busbw = bandwidths(op, real_bytes, seconds.item(), world)
    return Record(op, placement, real_bytes, count, seconds.item() * 1e6, algbw, busbw, int(bad.item()))


def sweep_sizes(spec: JobSpec, device: torch.device) -> list[int]:
    cfg = spec.launch.netcheck
    default_max = GPU_MAX_BYTES if device.type == "cuda" else CPU_MAX_BYTES
    return message_sizes(cfg.min_bytes, cfg.max_bytes or max(default_max, cfg.min_bytes), cfg.factor)


def sweep(spec: JobSpec, device: torch.device, on_record: Callable[[Record], None] | None = None) -> list[Record]:
    cfg = spec.launch.netcheck
    records = []
    for op in cfg.ops:
        for nbytes in sweep_sizes(spec, device):
            for placement in placements(op):
                rec = measure(op, placement, nbytes, cfg.warmup, cfg.iters, device)
                records.append(rec)
                if on_record is not None:
                    on_record(rec)
    return records


def expected_busbw(spec: JobSpec) -> float | None:
    from shardline.network_profiles import get_profile

    return spec.launch.netcheck.expect_busbw_gbps or get_profile(spec.launch.profile).expected_busbw_gbps


def evaluate(records: list[Record], expected_gbps: float | None) -> Verdict:
    """Fail on any wrong element, and when the all_gather busbw at the largest size misses 90 % of the
    expectation (the profiles quote nccl-tests all_gather at 8 GB); without all_gather, every op's
    largest out-of-place size is checked."""
    reasons: list[str] = []
    wrong = sum(r.wrong for r in records)
    if wrong:
        bad = sorted({f"{r.op} {r.placement}" for r in records if r.wrong})
        reasons.append(f"{wrong} wrong elements ({', '.join(bad)}): the collective returned wrong data")
    oop = [r for r in records if r.placement == "out-of-place"]
    checked = [r for r in oop if r.op == "all_gather"] or oop
    largest = {}
    for r in checked:
        if r.op not in largest or r.bytes > largest[r.op].bytes:
            largest[r.op] = r
    measured = min((r.busbw_gbps for r in largest.values()), default=None)
    if expected_gbps is not None and measured is not None and measured < PASS_FRACTION * expected_gbps:
        slow = ", ".join(f"{r.op} {r.bytes:,} B: {r.busbw_gbps:.2f}" for r in largest.values())
        reasons.append(f"busbw {slow} GB/s is below {PASS_FRACTION:.0%} of the expected {expected_gbps:g} GB/s")
    avg = sum(r.busbw_gbps for r in records) / len(records) if records else 0.0
    return Verdict(not reasons, expected_gbps, measured, wrong, avg, reasons)


def result_document(records: list[Record], verdict: Verdict, world: int, backend: str, device: str) -> dict:
    return {"kind": "netcheck", "world_size": world, "backend": backend, "device": device,
            "dtype": str(DTYPE).removeprefix("torch."), "passed": verdict.passed,
            "expected_busbw_gbps": verdict.expected_busbw_gbps, "measured_busbw_gbps": verdict.measured_busbw_gbps,
            "pass_fraction": PASS_FRACTION, "avg_busbw_gbps": verdict.avg_busbw_gbps, "wrong": verdict.wrong,
            "reasons": verdict.reasons, "records": [asdict(r) for r in records]}
