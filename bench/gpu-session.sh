#!/usr/bin/env bash
# The GPU checks recorded in bench/RESULTS-gpu.md, exactly as run on a lent GPU machine: an image with CUDA
# torch and transformers but no network, so shardline runs from src/ and pydantic travels as wheels in .whl/
# (bench/RESULTS-gpu.md says how to fetch them). Each step has its own time limit and log; one failing step
# does not stop the others.
# Usage: bench/gpu-session.sh OUT PHASE...; then, here, `python bench/record_gpu.py OUT` (bench/results-gpu.json).
#
# Plan for the next window (15 minutes of device time, machine start included, ~2-3 min; at most 8 min a call, a
# timeout that leaves time to rerun; minutes expected on an H100, an H200 is faster), in this order:
#   call 1  moe-a3b             ~4 min (timeout 480 s)  issue 55's first GPU check, never run: Qwen3-30B-A3B's layer
#                               shapes at the layers that fit (10 on an H200), balanced and real routing, HF Trainer +
#                               grouped_mm on the same rows; goals ≥ 277 model TFLOP/s per GPU (NeMo's formula), ≥ 2× HF
#   call 2  protocol-b varlen   ~3 min (timeout 420 s)  never run on a GPU: protocol B with selective checkpointing
#                               (the transformers-5.17 fallback) and the whole-step synchronisation test after its fix
#   give the machine back (~10 min used with the start; the slack reruns call 1 once if it failed fast)
# The window after: protocol-a-qwen (~6.5 min, timeout 480 s: Qwen2.5-7B's shapes against NeMo's 14,110 tok/s/GPU and
# HF Trainer + peft on the same rows), qlora-8b (~6 min: QLoRA NF4 beside the bf16 base, whose eager run reads off the
# 8B LoRA start-up against the 15 s goal), then fp8 (~7 min; first check `python3 -c "import torchao.float8"` in the
# image), then profile-a (~5 min: where protocol A's compiled step goes, for 15,000 tok/s/GPU).
#
# Phases not yet run on a GPU:
#   moe-a3b     NeMo AutoModel's Qwen3-30B-A3B benchmark scaled to one GPU (bench/moe_a3b.py): its layer shapes with
#               the most layers whose planned peak is within 90 % of the GPU (printed first: 10 of 48 on an H200, 4 on
#               an H100), random init, seq 4096, micro-batch 4 × 2, whole-block checkpointing, full-parameter AdamW;
#               shardline with balanced routing forced, then real routing, then HF Trainer + grouped_mm experts (bf16
#               weights) on the real run's rows (its own limit 210 s); model TFLOP/s per GPU from active parameters
#               (NeMo's qwen3_flops and shardline's formula), tok/s, peak memory, imbalance, shardline / HF (~4 min:
#               ~65 s a shardline run, 40 s of it start-up; step limit 420 s)
#   protocol-a-qwen  protocol A at Qwen2.5-7B's shapes (transformers' Qwen2 from a config.json, random weights:
#               `bench/protocols.py A --shapes qwen2.5-7b`), per-block compile (protocol A's best), and HF Trainer +
#               peft with gradient checkpointing on the same rows (~6.5 min)
#   qlora-8b    protocol A with the base as NF4 (`model.lora.quantize_base=nf4`, eager) beside the same run on a bf16
#               base in one call: tok/s and peak of each, the planner's NF4 saving and dequantization transient
#               against the measured peak difference (~6 min)
#   protocol-b  torchtitan's protocol B scaled to one GPU: Llama-3.1-8B's layer shapes, 16 layers, seq 8192 × 2, FSDP,
#               selective activation checkpointing, per-block compile (~2 min)
#   varlen      the GPU tests of packed attention and of a whole step's synchronisations; bench/packed_attention.py
#               (buckets, varlen, dense mask; ~1 min)
#   fp8         FP8 full fine-tuning (train.float8) against bf16 in the same call: protocol B at 16 layers of
#               Llama-3.1-8B's shapes in bf16, then tensorwise float8 (float8 all-gather), then rowwise; the ratios
#               printed last (~7 min; needs torchao, carried as a wheel in .whl/: bench/RESULTS-gpu.md)
#   profile-a   protocol A compiled with torch.profiler on steps 4-6 (ops table + gzipped trace kept in OUT; the trace
#               is likely over the 16 MiB a file that comes back): where the step's device time goes, read from the
#               trace on the machine into protocol-A.json's `profile_breakdown` (bench/profile_breakdown.py) and
#               printed: attention, matmuls, LoRA's small matmuls, optimizer, communication, other, host gaps, in ms a
#               step and %; its tok/s is not protocol A's number (the profiler's overhead and export; ~5 min)
# Every protocol run also records its start-up by part (`startup` in its JSON: launcher, the worker's laps, setup to
# the first step's start; the first step's warm-up apart).
#
# Phases already measured (bench/RESULTS-gpu.md; rerun only to check a change):
#   protocol-a  NeMo AutoModel's 8B LoRA protocol through the real trainer (bench/protocols.py A) and HF Trainer +
#               peft with checkpointing (it needs it on 80 GB) on the same rows (~8 min)
#   protocol-a-compiled  the same with per-block compile, shardline alone (~4 min; its own call after protocol-a)
#   layers      the trainer's MFU against the bare HF layer stack on one workload (Llama-3.1-8B's layer shapes, 13
#               layers, seq 8192 × 1, full fine-tune, no checkpointing): bench/gpu.py train + compile, then protocol B
#               at that size eager and compiled (~7 min)
#   checks      versions, gpucheck, the embedded default on CUDA, netcheck (1 rank; 2 ranks sharing the GPU)
#   bench       bench/gpu.py attention, train, compile (Llama-3.1-8B layer shapes)
#   memory      bench/gpu-8b-lora.yaml trained with async and with sync checkpoints (peak memory, stall)
#   profile     the 8B LoRA spec with observe.profile_steps=3 (torch.profiler's table of the slow steps)
#   netcheck    netcheck alone (1 rank; 2 ranks sharing the GPU)
#   checkpoint  bench/gpu.py checkpoint (8 layers: 16.8 GB of model + AdamW state)
#   attention-fix  the GPU tests of packed attention; shardline alone on contenders' model (30 steps)
#   contenders  HF Trainer on shardline's rows (bench/throughput.py, a 0.8B model)
#   gap         why shardline trails HF Trainer on the 0.8B model: shardline vs HF same rows, a profiled shardline
#               run (ops table + gzipped Chrome trace), then one change at a time (metrics of each in gap.tar.gz)
#   gap-check   after the fixes: the GPU tests of packed attention, shardline vs HF same rows again
set -uo pipefail
out=$1
shift
mkdir -p "$out"
if [ -d .whl ] && ! python3 -c "import pydantic, torchao" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
runs=$(mktemp -d)
log="$out/session.log"

step() {  # step NAME SECONDS COMMAND...: run it under a limit, its output into the log
  local name=$1 limit=$2 start rc
  shift 2
  echo "=== $name: $*" | tee -a "$log"
  start=$SECONDS
  timeout -k 10 "$limit" "$@" >>"$log" 2>&1
  rc=$?
  echo "=== $name: exit $rc after $((SECONDS - start)) s" | tee -a "$log"
}

for phase in "$@"; do
case "$phase" in
protocol-a)
  step versions 30 bash -c 'nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.limit --format=csv'
  step protocol-a 540 python3 bench/protocols.py A --baseline hf-checkpointed --out "$out"
  ;;
protocol-a-compiled)
  step protocol-a-compiled 330 python3 bench/protocols.py A --set parallel.compile=true --out "$out/compiled"
  ;;
protocol-a-qwen)
  step versions 30 bash -c 'nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.limit --format=csv'
  step protocol-a-qwen 440 python3 bench/protocols.py A --shapes qwen2.5-7b --set parallel.compile=true \
    --baseline hf-checkpointed --out "$out/protocol-a-qwen"
  ;;
qlora-8b)
  step qlora-8b 420 python3 bench/protocols.py A --set model.lora.quantize_base=nf4 --baseline bf16-base \
    --out "$out/qlora-8b"
  ;;
checks)
  step versions 30 bash -c 'nvidia-smi; python3 -c "
import torch, transformers, peft, importlib.util as u
print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"cudnn\", torch.backends.cudnn.version(),
      \"nccl\", torch.cuda.nccl.version(), \"device\", torch.cuda.get_device_name(),
      \"transformers\", transformers.__version__, \"peft\", peft.__version__,
      \"flash_attn\", u.find_spec(\"flash_attn\") is not None)"'
  step gpucheck 75 python3 -m shardline.cli gpucheck --nproc 1 --json "$out/gpucheck.json"
  step train-default 150 python3 -m shardline.cli train --nproc 1 --set "run.dir=$runs"
  find "$runs" -name metrics.jsonl -exec cp {} "$out/default-metrics.jsonl" \; -quit
  step netcheck-1 60 python3 -m shardline.cli netcheck --nproc 1 --json "$out/netcheck-1.json"
  step netcheck-2-shared 45 python3 -m shardline.cli netcheck --nproc 2 --json "$out/netcheck-2.json"
  ;;
bench)
  step gpu-bench 210 python3 bench/gpu.py --sections attention,train,compile --steps 5 --warmup 2 \
    --json "$out/gpu.json"
  ;;
memory)
  step train-8b-lora-async 150 python3 -m shardline.cli train bench/gpu-8b-lora.yaml --set "run.dir=$runs/async"
  step train-8b-lora-sync 120 python3 -m shardline.cli train bench/gpu-8b-lora.yaml --set "run.dir=$runs/sync" \
    --set checkpoint.async_save=false
  for mode in async sync; do
    find "$runs/$mode" -name metrics.jsonl -exec cp {} "$out/8b-lora-$mode-metrics.jsonl" \; -quit
  done
  ;;
profile)
  step 8b-lora-profile 180 python3 -m shardline.cli train bench/gpu-8b-lora.yaml --set "run.dir=$runs/profile" \
    --set observe.profile_steps=3 --set train.max_steps=8 --set checkpoint.every_steps=100
  find "$runs/profile" -name ops-rank-0.txt -exec cp {} "$out/8b-lora-profile-ops.txt" \; -quit
  ;;
netcheck)
  step netcheck-1 60 python3 -m shardline.cli netcheck --nproc 1 --json "$out/netcheck-1.json"
  step netcheck-2-shared 45 python3 -m shardline.cli netcheck --nproc 2 --json "$out/netcheck-2.json"
  ;;
checkpoint)
  step gpu-checkpoint 150 python3 bench/gpu.py --sections checkpoint --layers 8 --json "$out/gpu-checkpoint.json"
  ;;
attention-fix)
  step gpu-tests 90 python3 -m pytest -q -p no:cacheprovider tests/model/test_document_attention.py
  step shardline-bench-model 150 python3 -m shardline.cli train bench/throughput.yaml --nproc 1 \
    --set "run.dir=$runs/tp" --set train.max_steps=30 --set model.arch.hidden_size=2048 \
    --set model.arch.intermediate_size=5504 --set model.arch.num_layers=16 --set model.arch.num_heads=16 \
    --set model.arch.num_kv_heads=16 --set train.micro_batch_size=16 --set train.global_batch_size=16
  find "$runs/tp" -name metrics.jsonl -exec cp {} "$out/bench-model-metrics.jsonl" \; -quit
  ;;
contenders)
  step hf-same-rows 240 python3 bench/throughput.py --nproc 1 --steps 30 --json "$out/throughput.json" \
    --set model.arch.hidden_size=2048 --set model.arch.intermediate_size=5504 --set model.arch.num_layers=16 \
    --set model.arch.num_heads=16 --set model.arch.num_kv_heads=16 --set train.micro_batch_size=16 \
    --set train.global_batch_size=16
  ;;
layers)
  step bare-stack 240 python3 bench/gpu.py --sections train,compile --layers 13 --steps 5 --warmup 2 \
    --json "$out/gpu-13-layers.json"
  same=(--set model.arch.num_layers=13 --set train.micro_batch_size=1 --set train.global_batch_size=1
        --set parallel.activation_checkpointing=none)
  step trainer-13-layers 150 python3 bench/protocols.py B "${same[@]}" --set parallel.compile=false \
    --out "$out/trainer-13-layers"
  step trainer-13-layers-compiled 180 python3 bench/protocols.py B "${same[@]}" --out "$out/trainer-13-layers-compiled"
  ;;
profile-a)
  # 400 s: the run (~4 min) plus exporting, gzipping and reading a trace of 3 steps × 16 micro-batches (~1 min)
  step profile-a 400 python3 bench/protocols.py A --set parallel.compile=true --set observe.profile_steps=3 \
    --out "$out/profile-a"
  # where the compiled step's time went (protocol-A.json's profile_breakdown), on the call's own output
  grep -h "^profile, \|^profile breakdown failed" "$log" | tail -n 1
  ;;
moe-a3b)
  step versions 30 bash -c 'nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.limit --format=csv'
  # MOE_LAYERS=N: train N layers, not the planner's count (the rerun if that count ran out of memory)
  step moe-a3b 420 python3 bench/moe_a3b.py ${MOE_LAYERS:+--layers "$MOE_LAYERS"} --out "$out/moe-a3b"
  grep -h "^layers: \|^shardline, \|^HF Trainer + grouped_mm\|^goals" "$log" | tail -n 5
  ;;
protocol-b)
  step protocol-b-16-layers 200 python3 bench/protocols.py B --set model.arch.num_layers=16 --out "$out/protocol-b-16"
  ;;
fp8)
  b16=(--set model.arch.num_layers=16)
  step fp8-versions 60 python3 -c "import torch, torchao; print(torch.__version__, torch.version.cuda, \
torchao.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
  step protocol-b-16-bf16 200 python3 bench/protocols.py B "${b16[@]}" --out "$out/fp8/bf16"
  step protocol-b-16-fp8-tensorwise 200 python3 bench/protocols.py B "${b16[@]}" --set train.float8=tensorwise \
    --out "$out/fp8/tensorwise"
  step protocol-b-16-fp8-rowwise 200 python3 bench/protocols.py B "${b16[@]}" --set train.float8=rowwise \
    --out "$out/fp8/rowwise"
  step fp8-ratio 20 python3 -c "
import json, pathlib
tok = {r: json.loads(pathlib.Path('$out/fp8', r, 'protocol-B.json').read_text())['tokens_per_s_per_device']
       for r in ('bf16', 'tensorwise', 'rowwise') if pathlib.Path('$out/fp8', r, 'protocol-B.json').exists()}
print({r: round(t) for r, t in tok.items()}, {r: round(t / tok['bf16'], 3) for r, t in tok.items() if 'bf16' in tok})"
  ;;
varlen)
  step gpu-tests 90 python3 -m pytest -q -p no:cacheprovider tests/model/test_document_attention.py \
    tests/train/test_host_reads.py -k "gpu or varlen"
  step packed-attention 90 python3 bench/packed_attention.py
  ;;
gap-check)
  step gpu-tests 60 python3 -m pytest -q -p no:cacheprovider tests/model/test_document_attention.py
  step hf-same-rows-only 200 python3 bench/throughput.py --nproc 1 --steps 30 --hf same-rows \
    --json "$out/throughput-same-fixed.json" --set model.arch.hidden_size=2048 --set model.arch.intermediate_size=5504 \
    --set model.arch.num_layers=16 --set model.arch.num_heads=16 --set model.arch.num_kv_heads=16 \
    --set train.micro_batch_size=16 --set train.global_batch_size=16
  ;;
gap)
  model=(--set model.arch.hidden_size=2048 --set model.arch.intermediate_size=5504 --set model.arch.num_layers=16
         --set model.arch.num_heads=16 --set model.arch.num_kv_heads=16 --set train.micro_batch_size=16
         --set train.global_batch_size=16)
  mkdir -p "$runs/gap"
  step hf-same-rows-only 200 python3 bench/throughput.py --nproc 1 --steps 30 --hf same-rows \
    --json "$out/throughput-same.json" "${model[@]}"
  # The 0.8B model's final checkpoint (9.8 GB with AdamW) takes ~33 s on these disks: each run below is
  # killed (SIGKILL, its own process group) once its final validation is recorded, and its directory removed.
  until_validated() {  # until_validated NAME SECONDS DIR COMMAND...
    local name=$1 limit=$2 dir=$3 start pid
    shift 3
    echo "=== $name: $*" | tee -a "$log"
    start=$SECONDS
    setsid "$@" >>"$log" 2>&1 &
    pid=$!
    while kill -0 "$pid" 2>/dev/null && [ $((SECONDS - start)) -lt "$limit" ]; do
      if grep -qs '"kind": "eval"' "$dir"/*/metrics.jsonl "$dir"/metrics.jsonl; then sleep 1; break; fi
      sleep 1
    done
    kill -9 -- "-$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
    echo "=== $name: stopped after $((SECONDS - start)) s" | tee -a "$log"
  }
  until_validated profiled 100 "$runs/gap/profiled" python3 -m shardline.cli train bench/throughput.yaml --nproc 1 \
    "${model[@]}" --set "run.dir=$runs/gap/profiled" --set train.max_steps=10 --set observe.profile_steps=5
  find "$runs/gap/profiled" -name ops-rank-0.txt -exec cp {} "$out/gap-ops.txt" \; -quit
  find "$runs/gap/profiled" -name trace-rank-0.json -exec sh -c 'gzip -c "$1" > "$2"' _ {} "$out/gap-trace.json.gz" \; -quit
  rm -rf "$runs/gap/profiled"
  variant() {  # variant NAME SECONDS [ENV=V...] -- [--set ...]: the 0.8B model, 30 steps, one change
    local name=$1 limit=$2
    shift 2
    local envs=()
    while [ "$1" != "--" ]; do envs+=("$1"); shift; done
    shift
    until_validated "gap-$name" "$limit" "$runs/gap/$name" env "${envs[@]}" python3 -m shardline.cli train \
      bench/throughput.yaml --nproc 1 "${model[@]}" --set "run.dir=$runs/gap/$name" --set train.max_steps=30 "$@"
    python3 - "$runs/gap/$name" "$name" >>"$log" 2>&1 <<'PY'
import json, pathlib, statistics, sys
found = sorted(pathlib.Path(sys.argv[1]).rglob("metrics.jsonl"))
rows = [json.loads(l) for l in found[0].read_text().splitlines()] if found else []
train = [r for r in rows if r.get("kind") == "train"][3:]
if train:
    t = sorted(r["step_time_s"] for r in train)
    print(f"SUMMARY {sys.argv[2]}: steps {len(t)} step_s min {t[0]:.3f} median {statistics.median(t):.3f} "
          f"max {t[-1]:.3f} data_ms median {1e3 * statistics.median(r['data_wait_s'] for r in train):.1f} "
          f"tok/s {sum(r['tokens_total'] for r in train) / sum(t):,.0f} mfu {statistics.fmean(r['mfu'] for r in train):.3f}")
else:
    print(f"SUMMARY {sys.argv[2]}: no train records")
PY
    mkdir -p "$runs/gap-metrics"
    find "$runs/gap/$name" -name metrics.jsonl -exec cp {} "$runs/gap-metrics/$name.jsonl" \; -quit
    rm -rf "$runs/gap/$name"
    tar czf "$out/gap-metrics.tar.gz" -C "$runs" gap-metrics
  }
  variant baseline 90 --
  variant no-reshard 90 -- --set parallel.reshard_after_forward=false
  variant expandable 90 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True --
  variant eager-attention 90 -- --set model.attn_implementation=eager
  variant compile 120 -- --set parallel.compile=true
  step gpu-tests 60 python3 -m pytest -q -p no:cacheprovider tests/model/test_document_attention.py
  step gpucheck 60 python3 -m shardline.cli gpucheck --nproc 1 --json "$out/gpucheck.json"
  ;;
*) echo "usage: bench/gpu-session.sh OUT checks|bench|memory|contenders..." >&2; exit 2 ;;
esac
done
