"""bench/profile_breakdown.py on hand-made traces whose numbers are worked out below (the real CPU trace of protocol B
is read in tests/bench/test_protocols.py)."""

from __future__ import annotations

import gzip
import json

import pytest

from tests.conftest import bench_module

MAIN, BACKWARD, STEP = 1, 2, 700.0  # the trainer's thread, the autograd engine's (CUDA backward), µs a step


def _x(name, cat, ts, dur, tid=MAIN, **args):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 10, "tid": tid, "args": args}


def _launch(ts, corr, tid=MAIN, call="cudaLaunchKernel"):
    return _x(call, "cuda_runtime", ts, 5, tid, correlation=corr)


def _kernel(name, ts, dur, corr=None, stream=7, cat="kernel"):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 0, "tid": stream,
            "args": {"correlation": corr} if corr is not None else {}}


def gpu_step(t: float, c: int) -> list[dict]:
    """One step at time t (µs), correlation ids from c. On the device (µs): a LoRA A matmul 20; attention 50 whose
    last 10 overlap a 40 µs GEMM on a second stream (split 5/5); an inductor kernel 10; the backward's GEMM 60 with an
    NCCL reduce-scatter beside its last 10 (hidden) that runs on alone for 60 (exposed); the optimizer's kernel 40;
    a device-to-host copy 10; a GEMM without a launch record 20 (classified by its name). Busy 300 of 700."""
    return [
        _x("shardline.data", "user_annotation", t, 100),
        _x("shardline.forward", "user_annotation", t + 100, 200),
        _x("aten::linear", "cpu_op", t + 110, 40, **{"Input Dims": [[2, 8, 64], [16, 64], []]}),  # lora_A: r = 16
        _launch(t + 120, c + 1),
        _x("aten::scaled_dot_product_attention", "cpu_op", t + 160, 40),
        _launch(t + 170, c + 2),
        _x("aten::mm", "cpu_op", t + 205, 35, **{"Input Dims": [[32, 64], [64, 128]]}),
        _launch(t + 210, c + 3),
        _x("## Call CompiledFxGraph fabc ##", "user_annotation", t + 250, 40),
        _launch(t + 260, c + 4, call="cuLaunchKernel"),
        _x("shardline.backward", "user_annotation", t + 300, 200),
        _x("autograd::engine::evaluate_function: MmBackward0", "cpu_op", t + 310, 50, BACKWARD),
        _x("aten::mm", "cpu_op", t + 315, 40, BACKWARD, **{"Input Dims": [[32, 128], [128, 64]]}),
        _launch(t + 320, c + 5, BACKWARD),
        _x("record_param_comms", "cpu_op", t + 400, 20),
        _launch(t + 405, c + 6),
        _x("shardline.optimizer", "user_annotation", t + 500, 100),
        _x("Optimizer.step#AdamW.step", "user_annotation", t + 510, 80),
        _launch(t + 520, c + 7),
        _x("shardline.sync", "user_annotation", t + 600, 100),
        _launch(t + 610, c + 8, call="cudaMemcpyAsync"),
        _kernel("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", t + 130, 20, c + 1),
        _kernel("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>", t + 180, 50, c + 2),
        _kernel("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", t + 220, 40, c + 3, stream=8),
        _kernel("triton_poi_fused__scaled_dot_product_flash_attention_add_0", t + 265, 10, c + 4),
        _kernel("cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_32x6_tn_align8", t + 330, 60, c + 5),
        _kernel("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", t + 380, 70, c + 6,
                stream=20),
        _kernel("void at::native::multi_tensor_apply_kernel<TensorListMetadata<4>, FusedAdamMathFunctor>", t + 530, 40,
                c + 7),
        _kernel("Memcpy DtoH (Device -> Pinned)", t + 620, 10, c + 8, cat="gpu_memcpy"),
        _kernel("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn", t + 640, 20),
        # the profiler mirrors the host's labels on the stream's timeline: not a step, not device time
        _kernel("shardline.optimizer", t + 525, 400, cat="gpu_user_annotation"),
    ]


def gpu_trace() -> dict:
    return {"traceEvents": [*gpu_step(0.0, 0), *gpu_step(STEP, 100)]}


def test_a_gpu_trace_splits_each_steps_device_time_by_the_launching_op_and_the_kernel_name(tmp_path):
    breakdown = bench_module("profile_breakdown")
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(gpu_trace(), f)
    result = breakdown.breakdown_file(path, lora_rank=16)
    assert (result["device"], result["steps"], result["step_ms"]) == ("gpu", 2, 0.7)
    ms = {c: v["ms_per_step"] for c, v in result["categories"].items()}
    # µs a step: attention 40 alone + 5 shared; matmuls: 35 (5 shared) + the backward's 60 (NCCL beside it hidden) +
    # the unlaunched GEMM 20; the inductor kernel (named after the attention it feeds) and the copy are other; NCCL's
    # 60 alone is exposed; 700 - 300 busy is host gaps
    assert ms == pytest.approx({"attention": 0.045, "matmul": 0.115, "lora_matmul": 0.020, "optimizer": 0.040,
                                "communication": 0.060, "other": 0.020, "host_gaps": 0.400}, abs=1e-6)
    assert result["categories"]["host_gaps"]["percent"] == pytest.approx(100 * 400 / 700, abs=0.01)
    assert sum(v["percent"] for v in result["categories"].values()) == pytest.approx(100, abs=0.05)
    # without the rank, LoRA's matmuls are matmuls
    plain = breakdown.breakdown(gpu_trace())["categories"]
    assert plain["lora_matmul"]["ms_per_step"] == 0 and plain["matmul"]["ms_per_step"] == pytest.approx(0.135)
    line = breakdown.describe(result)
    assert line.startswith("profile, 2 step(s) by device kernels: 0.7 ms a step")
    assert "host gaps 0.4 ms (57.1 %)" in line


def test_a_cpu_trace_gives_the_main_threads_time_to_the_op_that_claims_it():
    breakdown = bench_module("profile_breakdown")
    trace = {"traceEvents": [
        _x("shardline.forward", "user_annotation", 0, 100),
        _x("aten::linear", "cpu_op", 10, 30, **{"Input Dims": [[4, 8], [8, 8], [8]]}),
        _x("aten::addmm", "cpu_op", 12, 25),
        _x("aten::empty", "cpu_op", 13, 2),  # the matmul's own allocation: the matmul's
        _x("aten::mul", "cpu_op", 50, 10),
        _x("shardline.optimizer", "user_annotation", 100, 50),
        _x("Optimizer.step#SGD.step", "user_annotation", 105, 40),
        _x("aten::add_", "cpu_op", 110, 20),
        _x("gloo:all_reduce", "cpu_op", 0, 30, tid=3),  # another thread's: not the step's timeline
    ]}
    result = breakdown.breakdown(trace)
    ms = {c: v["ms_per_step"] for c, v in result["categories"].items()}
    assert (result["device"], result["steps"], result["step_ms"]) == ("cpu", 1, 0.15)
    assert ms == pytest.approx({"attention": 0, "matmul": 0.030, "lora_matmul": 0, "optimizer": 0.040,
                                "communication": 0, "other": 0.010, "host_gaps": 0.070}, abs=1e-6)


def test_a_trace_without_profiled_steps_is_named(tmp_path, capsys):
    path = tmp_path / "empty.json"
    path.write_text(json.dumps({"traceEvents": [_x("aten::mm", "cpu_op", 0, 5)]}))
    assert bench_module("profile_breakdown").main([str(path)]) == 1
    assert f"{path}: no profiled step in it" in capsys.readouterr().err
