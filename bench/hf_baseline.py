"""The same-machine baseline of bench/protocols.py and bench/moe_a3b.py: HF `Trainer` (+ peft's LoRA for protocol A)
on a protocol run's model, initial weights and rows, in the run's step order, one process; prints one JSON line
(tok/s over the steps after the warm-up, the first loss, the peak memory).

    python bench/hf_baseline.py RUN_DIR A|B|M [--warmup-steps 5] [--checkpointing]

RUN_DIR is the shardline run's directory (its spec.yaml and manifest name the model and the prepared rows).
`--checkpointing`: whole-block gradient checkpointing (HF has no selective checkpointing); protocol B also compiles
the whole model (`torch_compile`). M is a mixture of experts' full training (bench/moe_a3b.py): transformers'
`grouped_mm` experts (`set_experts_implementation`), and in bf16 the weights in bf16 (AdamW's moments with them),
as transformers 5 loads a hub checkpoint (`dtype="auto"`): its grouped_mm casts the tokens to the weights' dtype and
torch's grouped kernel on CUDA takes bf16 only, so fp32 weights under autocast would not run it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


def train_hf(run: Path, protocol: str, checkpointing: bool, warmup_steps: int) -> dict:
    """HF Trainer (+ peft for A) on the run's model, initial weights and rows in its step order; its rate over the
    steps after `warmup_steps`."""
    import numpy as np
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from shardline.data.loader import IGNORE_INDEX, StepSampler
    from shardline.data.prepare import PreparedData, default_cache_dir
    from shardline.data.tokenizer import special_ids
    from shardline.model.build import build_model
    from shardline.spec.resolve import load_spec

    spec = load_spec(str(run / "spec.yaml"))
    t = spec.train
    data = PreparedData(default_cache_dir(spec) / json.loads((run / "manifest.json").read_text())["dataset_version"])
    rows = data.rows("train")
    sampler = StepSampler(len(rows.n_real), t.seed, t.global_batch_size, t.global_batch_size, world=1)
    index = np.concatenate([sampler.micro_indices(step, 0, 0) for step in range(t.max_steps)])
    tokens = torch.from_numpy(np.asarray(rows.tokens[index], dtype=np.int64))
    labels = torch.where(torch.from_numpy(np.asarray(rows.loss_mask[index], dtype=bool)), tokens, IGNORE_INDEX)
    positions = torch.from_numpy(np.asarray(rows.position_ids[index], dtype=np.int64))
    model = build_model(spec.model, data.meta["vocab_size"], special_ids(data.tokenizer(), data.meta["pad_id"]))
    if protocol == "M":
        model.set_experts_implementation("grouped_mm")
        if t.precision == "bf16":
            model.to(torch.bfloat16)
    if protocol == "A":
        lora = spec.model.lora
        model = get_peft_model(model, LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                                 target_modules=lora.target_modules, task_type="CAUSAL_LM"))

    class Rows(torch.utils.data.IterableDataset):
        def __iter__(self):
            for i in range(len(tokens)):
                yield {"input_ids": tokens[i], "labels": labels[i], "position_ids": positions[i]}

    stamps: list[float] = []
    losses: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, max_steps=t.max_steps, per_device_train_batch_size=t.micro_batch_size,
            gradient_accumulation_steps=t.global_batch_size // t.micro_batch_size, learning_rate=t.lr,
            lr_scheduler_type="constant", weight_decay=t.weight_decay, max_grad_norm=t.max_grad_norm or 0.0,
            bf16=t.precision == "bf16", use_cpu=not torch.cuda.is_available(), logging_steps=1, save_strategy="no",
            report_to=[], dataloader_num_workers=0, remove_unused_columns=False, seed=0, disable_tqdm=True,
            gradient_checkpointing=checkpointing, gradient_checkpointing_kwargs={"use_reentrant": False},
            torch_compile=protocol == "B")
        Trainer(model=model, args=args, train_dataset=Rows(), callbacks=[Clock()]).train()
    wall = stamps[-1] - stamps[warmup_steps - 1]
    timed = int(tokens[warmup_steps * t.global_batch_size:].numel())
    return {"tokens_per_s_per_device": round(timed / wall, 1), "first_loss": losses[0],
            "gradient_checkpointing": checkpointing, "weights_dtype": str(next(model.parameters()).dtype),
            "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3) if torch.cuda.is_available()
            else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="the protocol run's directory")
    parser.add_argument("protocol", choices=["A", "B", "M"])
    parser.add_argument("--warmup-steps", type=int, default=5)
    parser.add_argument("--checkpointing", action="store_true")
    args = parser.parse_args(argv)
    print(json.dumps(train_hf(args.run, args.protocol, args.checkpointing, args.warmup_steps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
