"""A real pretrained non-Llama checkpoint, Gemma 3 270M (local/global attention, QK-norm, head_dim 256 ≠
hidden/heads, scaled tied embeddings, a 262,144-token vocabulary), fully fine-tuned on a user's text-to-SQL file:
its first loss is transformers' own on the same documents one at a time and a pretrained model's (a random one
reads ln V ≈ 12.5), training lowers the validation loss, and the export loads in transformers with shardline's
validation loss, its embeddings still tied."""

from __future__ import annotations

import gc
import json
import math
from pathlib import Path

import pytest
import torch
from rich.console import Console
from transformers import AutoModelForCausalLM

from shardline.data.prepare import prepare
from shardline.rundir import create_run
from shardline.spec.resolve import load_spec
from shardline.training.trainer import Trainer
from tests.model.families import one_document_at_a_time
from tests.oracle import unpacked_loss
from tests.real.checkpoint import gemma3_dir
from tests.real.runs import export, run_sets, user_sql_file

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def real() -> Path:
    return gemma3_dir()


@pytest.fixture(scope="module")
def user_file(tmp_path_factory) -> Path:
    return user_sql_file(tmp_path_factory.mktemp("user-data"))


def _pretrained(real: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(real, dtype=torch.float32).eval()


def test_gemma3_fine_tunes_fully_from_its_pretrained_loss_and_exports_tied(ctx, real, user_file, tmp_path):
    """A full fine-tune through the Trainer on one in-process rank (FSDP2 on its world-1 mesh): two ranks of a Gemma 3
    full fine-tune, tied embeddings included, give one rank's loss and step in tests/model/test_families.py; the
    launch path on real weights, two ranks, is tests/real/test_real_checkpoint.py's SmolLM2 round trip (LoRA on the
    Gemma 3 family is checked by tests/test_export.py's multimodal Gemma 3 adapter)."""
    # One row a step and 4 validation rows (2 and 8 in the other real runs): a row of a 268M model with a 262k
    # vocabulary costs ~15 s to train and seconds in each of the three validations below. At one row a step a full
    # fine-tune wants a small rate: 2e-5 takes the validation loss 1.86 → 0.96 in 2 steps, 1e-4 overshoots to 3.75.
    args = run_sets(real, user_file, tmp_path, 1, "train.precision=fp32", "train.max_steps=2", "train.warmup_steps=0",
                    "train.lr=2e-5", "train.seq_len=256", "model.lora.enabled=false", "data.validation_size=4",
                    "train.global_batch_size=1")
    spec, run_dir = create_run(load_spec("tiny", args[1::2]))
    trainer = Trainer(spec, ctx, prepare(spec), run_dir, Console(quiet=True))
    train = [trainer.train_step() for _ in range(2)]
    shardline_val = trainer.validate()
    # The export reads the model entry only: the checkpoint leaves out AdamW's two moments (2.1 GB of its 3.2 GB to
    # write and checksum); a real checkpoint with its optimizer state resumes in test_real_checkpoint.py (LoRA).
    trainer.optimizer = None
    trainer.save_checkpoint(blocking=True)
    data = trainer.data
    rows = [r for rec in map(json.loads, trainer.sample_trace.read_text().splitlines()) if rec["step"] == 1
            for r in rec["rows"]]
    del trainer
    gc.collect()
    assert [r.step for r in train] == [1, 2] and len(rows) == 1
    base = _pretrained(real)
    with torch.no_grad():
        total, count = one_document_at_a_time(base, data, rows)
        before = unpacked_loss(base, data)
    print(f"first loss shardline {train[0].loss:.5f} vs transformers {float(total) / count:.5f}; validation "
          f"{before:.4f} before")
    assert train[0].tokens == count
    assert train[0].loss == pytest.approx(float(total) / count, rel=2e-4)
    assert train[0].loss < 0.5 * math.log(base.config.vocab_size)  # pretrained, not random
    assert shardline_val < before - 0.05, (shardline_val, before)  # it learned the user's data
    exported = export(run_dir, tmp_path / "export", "--dtype", "fp32")  # the trained weights unrounded (auto: bf16)
    model = _pretrained(exported)
    from safetensors import safe_open

    with safe_open(exported / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in list(f.keys())  # still tied after FSDP2 training and export
    assert not torch.equal(model.model.embed_tokens.weight, base.model.embed_tokens.weight)  # it trained
    exported_val = unpacked_loss(model, data)
    print(f"validation {shardline_val:.4f} after 2 steps, exported {exported_val:.4f}")
    assert exported_val == pytest.approx(shardline_val, rel=1e-4)


def test_conversations_on_gemma3s_base_checkpoint_without_a_chat_template_are_a_named_error(real, tmp_path):
    """The pretrained Gemma 3 base ships no chat template: chat rows are refused before a run exists, by name;
    its own text trains as raw documents with its BOS."""
    from shardline.data.preflight import preflight
    from shardline.data.render import render
    from shardline.data.sources import head_examples
    from shardline.errors import DataError
    from shardline.tasks import get_task
    from tests.conftest import small_spec

    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "hello"}]}) + "\n")
    with pytest.raises(DataError, match="no chat template") as e:
        preflight(small_spec(tmp_path, f"data.path={chat}", f"model.path={real}"))
    assert e.value.where == "model.path"
    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"text": "A plain document."}) + "\n")
    spec = small_spec(tmp_path, f"data.path={text}", f"model.path={real}")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(real)
    r = render(tok, head_examples(spec.data, 1)[0], get_task("none").prompt, "plain")
    assert r.ids == [tok.bos_token_id, *tok.encode("A plain document.", add_special_tokens=False), tok.eos_token_id]
    assert r.loss == [0] + [1] * (len(r.ids) - 1)
