#!/usr/bin/env bash
# The GPU checks recorded in bench/RESULTS-gpu.md, exactly as run on a lent GPU machine: an image with CUDA
# torch and transformers but no network, so shardline runs from src/ and pydantic travels as wheels in .whl/
# (bench/RESULTS-gpu.md says how to fetch them). Each step has its own time limit and log; one failing step
# does not stop the others.
# Usage: bench/gpu-session.sh OUT PHASE... with PHASE one of
#   checks      versions, gpucheck, the embedded default on CUDA, netcheck (1 rank; 2 ranks sharing the GPU)
#   bench       bench/gpu.py attention, train, compile (Llama-3.1-8B layer shapes)
#   memory      bench/gpu-8b-lora.yaml trained with async and with sync checkpoints (peak memory, stall)
#   profile     the 8B LoRA spec with observe.profile_steps=3 (torch.profiler's table of the slow steps)
#   netcheck    netcheck alone (1 rank; 2 ranks sharing the GPU)
#   checkpoint  bench/gpu.py checkpoint (8 layers: 16.8 GB of model + AdamW state)
#   attention-fix  the GPU tests of packed attention; shardline alone on contenders' model (30 steps)
#   contenders  HF Trainer on shardline's rows (bench/throughput.py, a 0.8B model)
set -uo pipefail
out=$1
shift
mkdir -p "$out"
if [ -d .whl ] && ! python3 -c "import pydantic" 2>/dev/null; then
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
*) echo "usage: bench/gpu-session.sh OUT checks|bench|memory|contenders..." >&2; exit 2 ;;
esac
done
