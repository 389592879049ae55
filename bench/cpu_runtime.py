"""Re-measure the planner's `CPU_RUNTIME_BYTES`: the resident memory of a worker before any model tensor.

Python + torch + transformers + peft + the worker's own imports, the gloo process group, and one tiny Llama
forward/backward; the peak RSS of a fresh process (peak RSS is a process-lifetime maximum, so run it alone):

    .venv/bin/python bench/cpu_runtime.py
"""

from __future__ import annotations

import os
import resource

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import shardline.worker  # noqa: F401 - the worker's imports (trainer, data, peft)
from shardline.planning.devices import CPU_RUNTIME_BYTES, MiB


def measure_cpu_runtime_bytes() -> int:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                         num_attention_heads=1, num_key_value_heads=1))
    model(input_ids=torch.randint(0, 256, (1, 16))).logits.sum().backward()
    dist.destroy_process_group()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


if __name__ == "__main__":
    measured = measure_cpu_runtime_bytes()
    print(f"peak RSS {measured / MiB:.1f} MiB; the planner assumes CPU_RUNTIME_BYTES = "
          f"{CPU_RUNTIME_BYTES / MiB:.0f} MiB")
