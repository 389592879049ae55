"""DPO on the real SmolLM2-135M-Instruct against TRL's DPOTrainer, with nothing shared but the rows and the weights:
TRL tokenizes the conversational pairs with the chat template, pads them and computes its loss and rewards with its
own forward; shardline reads the same rows as `preference` data, renders them, packs each pair into one row with
per-document attention and computes its own (LoRA, the reference the adapters off, fp32)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardline.data.formats import FORMATS
from shardline.data.loader import make_batch
from shardline.data.packing import Document, pack
from shardline.data.render import render
from shardline.data.tokenizer import load_tokenizer
from shardline.model.build import build_model
from shardline.model.lora import apply_lora
from shardline.spec import ColumnsSpec, DpoSpec, LoraSpec, ModelSpec
from shardline.tasks import get_task
from shardline.training.preference import adapters_off, dpo_losses, pair_logps
from tests.real.checkpoint import smollm2_dir

pytestmark = pytest.mark.slow
BETA = 0.1
LORA = LoraSpec(enabled=True, r=8, alpha=16)
ROWS = [
    {"prompt": [{"role": "user", "content": "Which table holds the orders?"}],
     "chosen": [{"role": "assistant", "content": "SELECT * FROM orders"}],
     "rejected": [{"role": "assistant", "content": "SELECT * FROM customers"}]},
    {"prompt": [{"role": "system", "content": "Answer with SQL."},
                {"role": "user", "content": "How many users are older than 30?"}],
     "chosen": [{"role": "assistant", "content": "SELECT COUNT(*) FROM users WHERE age > 30"}],
     "rejected": [{"role": "assistant", "content": "SELECT COUNT(*) FROM users WHERE age < 30"}]},
    {"prompt": [{"role": "user", "content": "Capital of France?"}],
     "chosen": [{"role": "assistant", "content": "Paris."}],
     "rejected": [{"role": "assistant", "content": "Lyon, I think."}]},
]


def test_lora_dpo_on_smollm2_equals_trls_dpo_trainer(tmp_path):
    from datasets import Dataset
    from peft import LoraConfig
    from trl import DPOConfig, DPOTrainer
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    path = smollm2_dir()
    tok = load_tokenizer(str(path))
    spec = ModelSpec(path=str(path))
    ours = apply_lora(build_model(spec, len(tok), {}), LORA)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if "lora_B" in name:
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))

    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    targets = sorted({n.split(".")[-4] for n, _ in ours.named_parameters() if "lora_A" in n})
    args = DPOConfig(output_dir=str(tmp_path / "trl"), beta=BETA, loss_type=["sigmoid"], report_to="none",
                     use_cpu=True, bf16=False, per_device_train_batch_size=len(ROWS))
    trainer = DPOTrainer(model=plain, args=args, processing_class=tok, train_dataset=Dataset.from_list(ROWS),
                         peft_config=LoraConfig(r=LORA.r, lora_alpha=LORA.alpha, lora_dropout=0.0,
                                                target_modules=targets, task_type="CAUSAL_LM"))
    assert not trainer.model.load_state_dict(ours.state_dict(), strict=False).unexpected_keys
    trainer.model.train()
    inputs = DataCollatorForPreference(pad_token_id=tok.pad_token_id)(list(trainer.train_dataset))
    expected = float(trainer.compute_loss(trainer.model, inputs).detach())
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    units = []
    for row in ROWS:
        ex = FORMATS["preference"].read(row, ColumnsSpec())
        docs = [render(tok, doc, get_task("none").prompt, "plain") for doc in ex.chosen_and_rejected()]
        units.append(Document(ids=np.asarray(docs[0].ids + docs[1].ids, dtype=np.int32),
                              loss=np.asarray(docs[0].loss + [0] + docs[1].loss[1:], dtype=np.uint8),
                              positions=np.concatenate([np.arange(len(d.ids)) for d in docs])))
    rows = pack(units, seq_len=192, pad_id=tok.pad_token_id)
    assert len(rows.n_real) < len(ROWS)  # pairs share a row
    batch = make_batch(rows, np.arange(len(rows.n_real)))
    ours.train()
    with torch.no_grad(), adapters_off(ours):
        ref = pair_logps(ours, batch, 4096)
    policy = pair_logps(ours, batch, 4096)
    losses, chosen, rejected = dpo_losses(policy, ref.chosen, ref.rejected, DpoSpec(beta=BETA))
    assert abs(float(losses.mean()) - np.log(2)) > 1e-4  # the adapters moved the policy
    assert float(losses.mean()) == pytest.approx(expected, abs=1e-4)
    assert float(chosen.mean()) == pytest.approx(metrics["rewards/chosen"], abs=1e-4)
    assert float(rejected.mean()) == pytest.approx(metrics["rewards/rejected"], abs=1e-4)
    assert float(policy.chosen.mean()) == pytest.approx(metrics["logps/chosen"], rel=2e-4)  # 20 tokens summed
