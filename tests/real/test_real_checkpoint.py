"""shardline on a real pretrained checkpoint (SmolLM2-135M-Instruct: tied embeddings, GQA 9/3, ChatML, pad = eos)
with a user's JSONL text-to-SQL file, checked against plain transformers and peft — code nobody here wrote.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from peft import PeftModel
from rich.console import Console
from transformers import AutoModelForCausalLM, AutoTokenizer

from shardline.data.prepare import prepare
from shardline.rundir import create_run
from shardline.spec import ModelSpec
from shardline.spec.resolve import load_spec
from shardline.tasks.text_to_sql.prompt import CHAT_USER
from shardline.training.trainer import Trainer
from tests.conftest import REPO, read_metrics
from tests.oracle import documents_of_rows, unpacked_loss
from tests.real.checkpoint import smollm2_dir
from tests.real.runs import cli, export, prepared_of, run_sets, train_run, user_sql_file

pytestmark = pytest.mark.slow
IGNORE = -100


@pytest.fixture(scope="module")
def real() -> Path:
    return smollm2_dir()


@pytest.fixture(scope="module")
def tok(real):
    return AutoTokenizer.from_pretrained(real)


@pytest.fixture(scope="module")
def user_file(tmp_path_factory) -> Path:
    return user_sql_file(tmp_path_factory.mktemp("user-data"))


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """The module's runs: one data.cache_dir, so the user's file is prepared once for all of them."""
    return tmp_path_factory.mktemp("smollm2")


def _sets(real: Path, data: Path, root: Path, nproc: int, *extra: str) -> list[str]:
    return run_sets(real, data, root, nproc, "data.prompt_format=chat", *extra)


LORA_RUN = ["train.precision=fp32", "train.eval_examples=4", "train.eval_max_new_tokens=24", "model.lora.enabled=true",
            "model.lora.r=8"]


@pytest.fixture(scope="module")
def lora_run(real, user_file, root) -> Path:
    """2 ranks, fp32, LoRA: one step (LoRA B starts at zero: step 1's loss is the pretrained model's) and its
    checkpoint, then a resume to step 2 with validation and the SQL generation eval."""
    run_dir = train_run(real, user_file, root, 2, "data.prompt_format=chat", "train.max_steps=1", *LORA_RUN,
                        "train.eval_examples=0")
    cli("train", str(run_dir), *_sets(real, user_file, root, 2, "train.max_steps=2",
                                      "checkpoint.allow_spec_change=true", *LORA_RUN))
    return run_dir


# ---- the expected encoding, from the tokenizer's own chat template ------------------------------------------

def _reference_documents(tok, data: Path) -> dict[tuple[int, ...], int]:
    """token ids of each example as the chat template renders the whole conversation -> number of prompt tokens.

    The answer's loss span is everything the template puts after the generation prompt up to and including the
    assistant's end-of-turn token; the line break after it is not part of the answer.
    """
    docs = {}
    for line in data.read_text().splitlines():
        ex = json.loads(line)
        user = {"role": "user", "content": CHAT_USER.format(context=ex["context"], question=ex["question"])}
        prompt = tok.apply_chat_template([user], add_generation_prompt=True, tokenize=True, return_dict=False)
        full = tok.apply_chat_template([user, {"role": "assistant", "content": ex["answer"]}], tokenize=True,
                                       return_dict=False)
        end = full.index(tok.convert_tokens_to_ids("<|im_end|>"), len(prompt))
        docs[tuple(full[: end + 1])] = len(prompt)
    return docs


@torch.no_grad()
def _oracle_loss(model, docs: list[tuple[int, ...]], reference: dict[tuple[int, ...], int]) -> float:
    """Token-weighted mean of transformers' own causal-LM loss, each example alone and unpacked."""
    total, count = 0.0, 0
    for doc in docs:
        n_prompt = reference[doc]
        ids = torch.tensor([doc])
        labels = ids.clone()
        labels[0, :n_prompt] = IGNORE
        n = len(doc) - n_prompt
        total += float(model(input_ids=ids, labels=labels).loss) * n
        count += n
    return total / count


# ---- tests -------------------------------------------------------------------------------------------------

def test_chat_examples_carry_loss_on_the_answer_and_the_final_end_of_turn_only(real, tok, user_file, root):
    args = _sets(real, user_file, root, 1)
    data = prepare(load_spec("tiny", args[1::2]))
    assert tok.pad_token_id == tok.eos_token_id  # the tokenizer pads with EOS; padding must not hide EOS's loss
    assert data.meta["pad_id"] != tok.eos_token_id
    reference = _reference_documents(tok, user_file)
    packed = data.rows("train")
    n_docs = 0
    for r in range(len(packed.n_real)):
        at = 0
        for doc in documents_of_rows(data, [r]):
            # The template's own rendering, token for token (no BOS added to a template that has none);
            # a KeyError means the prepared example differs from it.
            n_prompt = reference[doc]
            mask = np.asarray(packed.loss_mask[r, at: at + len(doc)])
            assert mask.tolist() == [0] * n_prompt + [1] * (len(doc) - n_prompt)
            assert tok.decode(doc[n_prompt:]).endswith("<|im_end|>")
            at += len(doc)
            n_docs += 1
        assert not np.asarray(packed.loss_mask[r, at:]).any()  # padding carries no loss
    assert n_docs == data.stats["splits"]["train"]["kept"] == len(reference) - 16


def _step_one_documents(tok, user_file: Path, data, rows: list[int]):
    docs = documents_of_rows(data, rows)
    reference = _reference_documents(tok, user_file)
    assert docs and all(d in reference for d in docs), "a packed document differs from the template's rendering"
    return docs, reference, sum(len(d) - reference[d] for d in docs)


def test_first_logged_loss_on_two_ranks_equals_transformers_on_the_same_examples_one_at_a_time(
        real, tok, user_file, lora_run):
    """Packing, masking, position ids, the block-diagonal mask and the loss normalisation over 2 fp32 ranks, against
    transformers (the round trip's run: its step 1 is the pretrained model's)."""
    logged = read_metrics(lora_run, "train")[0]
    assert logged["step"] == 1
    rows = [r for rank in range(2)
            for rec in map(json.loads, (lora_run / "logs" / f"samples-rank-{rank}.jsonl").read_text().splitlines())
            if rec["step"] == 1 for r in rec["rows"]]
    assert len(rows) == 2
    docs, reference, n_loss = _step_one_documents(tok, user_file, prepared_of(lora_run), rows)
    exact = _oracle_loss(AutoModelForCausalLM.from_pretrained(real, dtype=torch.float32).eval(), docs, reference)
    assert logged["tokens"] == n_loss
    print(f"2 ranks fp32: shardline {logged['loss']:.6f} vs transformers {exact:.6f} "
          f"over {len(docs)} examples, {n_loss} loss tokens")
    assert logged["loss"] == pytest.approx(exact, rel=2e-4)


def test_first_bf16_loss_is_as_close_to_the_exact_loss_as_transformers_own_bf16(ctx, real, tok, user_file, root):
    """The Trainer on one in-process rank, bf16, one row (CPUs without bf16 matrix units emulate it at ~2 GFLOP/s;
    the two-rank bf16 reduction is covered by the tiny model's FSDP tests)."""
    args = _sets(real, user_file, root / "bf16", 1, f"data.cache_dir={root / 'prepared'}", "train.max_steps=1",
                 "train.precision=bf16", "train.global_batch_size=1", "model.lora.enabled=true")
    spec, run_dir = create_run(load_spec("tiny", args[1::2]))
    trainer = Trainer(spec, ctx, prepare(spec), run_dir, Console(quiet=True))
    logged = trainer.train_step()  # LoRA B starts at zero: step 1 is the pretrained model itself
    rows = [r for rec in map(json.loads, trainer.sample_trace.read_text().splitlines()) for r in rec["rows"]]
    assert len(rows) == 1
    docs, reference, n_loss = _step_one_documents(tok, user_file, trainer.data, rows)
    assert logged.tokens == n_loss
    # Both shardline and transformers' own bf16 model round every activation to bf16 (eps 7.8e-3) in kernels whose
    # blocking differs by CPU class; the scale of that noise is measured here, as transformers' bf16 loss's distance
    # from the exact (fp32) loss, and shardline's bf16 loss must be as close to exact, within 3× of it (and of a
    # 5e-3 floor: a masking or normalisation error moves the loss by tens of percent)
    exact = _oracle_loss(AutoModelForCausalLM.from_pretrained(real, dtype=torch.float32).eval(), docs, reference)
    theirs = _oracle_loss(AutoModelForCausalLM.from_pretrained(real, dtype=torch.bfloat16).eval(), docs, reference)
    print(f"1 rank bf16: shardline {logged.loss:.6f}, transformers bf16 {theirs:.6f}, exact (fp32) {exact:.6f} "
          f"over {len(docs)} examples, {n_loss} loss tokens")
    assert abs(logged.loss - exact) <= max(3 * abs(theirs - exact), 5e-3 * exact)


def test_sharded_load_of_the_real_checkpoint_matches_from_pretrained_and_stays_tied(real, tmp_path):
    from tests.model.sharded_load_worker import fixed_input

    out = tmp_path / "out"
    out.mkdir()
    worker = REPO / "tests" / "model" / "sharded_load_worker.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(worker),
           "load", str(out), "--spec", ModelSpec(path=str(real)).model_dump_json(), "--dump-state"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref = AutoModelForCausalLM.from_pretrained(real, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = ref(input_ids=fixed_input(ref.config.vocab_size)).logits
    torch.testing.assert_close(torch.load(out / "logits-0.pt"), expected, atol=1e-4, rtol=1e-4)
    state = torch.load(out / "state-0.pt")
    assert "lm_head.weight" not in state  # one parameter under FSDP2: the output projection is the embedding
    assert ref.config.num_attention_heads == 9 and ref.config.num_key_value_heads == 3


def test_lora_train_eval_resume_export_round_trip_reproduces_shardline_in_plain_transformers(real, lora_run, tmp_path):
    """2 ranks: train → checkpoint → resume → validation → SQL generation eval → export (adapter and merged) →
    peft/transformers. The full fine-tune's round trip, tied export included, runs on Gemma 3 (test_real_gemma3)."""
    assert json.loads((lora_run / "eval.json").read_text())["n"] == 4  # the generation eval ran, and exited 0
    evals = [r for r in read_metrics(lora_run, "eval") if "val_loss" in r]
    assert [r["step"] for r in read_metrics(lora_run, "train")] == [1, 2]
    assert any(r["event"] == "resume" for r in read_metrics(lora_run, "event") if r.get("step") == 1)
    shardline_val = evals[-1]["val_loss"]
    data = prepared_of(lora_run)
    base = AutoModelForCausalLM.from_pretrained(real, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, export(lora_run, tmp_path / "export")).eval()
    merged_dir = export(lora_run, tmp_path / "merged", "--merge-lora", "--dtype", "fp32")  # auto: bf16, as SmolLM2
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    assert merged.config.tie_word_embeddings and model.get_base_model().config.tie_word_embeddings
    assert unpacked_loss(merged, data) == pytest.approx(shardline_val, rel=1e-4)
    exported_val = unpacked_loss(model, data)
    print(f"LoRA: shardline val loss {shardline_val:.6f}, exported {exported_val:.6f}")
    assert exported_val == pytest.approx(shardline_val, rel=1e-4)


def test_a_multi_turn_conversation_renders_with_smollm2s_own_template_and_trains_on_its_assistant_turns(tok):
    """SmolLM2's ChatML template (shipped with the checkpoint, no generation markers): the ids are exactly
    `apply_chat_template`'s, and the loss-bearing tokens decode to each assistant turn and its `<|im_end|>`."""
    from shardline.data.render import render_chat

    messages = [{"role": "system", "content": "You are a SQL assistant."},
                {"role": "user", "content": "How many users are there?"},
                {"role": "assistant", "content": "SELECT COUNT(*) FROM users;"},
                {"role": "user", "content": "And how many are older than 30?"},
                {"role": "assistant", "content": "SELECT COUNT(*) FROM users WHERE age > 30;"}]
    r = render_chat(tok, messages)
    assert r.ids == list(tok.apply_chat_template(messages, tokenize=True, return_dict=False))
    runs, run = [], []
    for t, m in zip(r.ids, r.loss, strict=True):
        if m:
            run.append(t)
        elif run:
            runs.append(tok.decode(run))
            run = []
    assert runs == ["SELECT COUNT(*) FROM users;<|im_end|>", "SELECT COUNT(*) FROM users WHERE age > 30;<|im_end|>"]
    last = render_chat(tok, messages, assistant_turns="last")
    assert tok.decode([t for t, m in zip(last.ids, last.loss, strict=True) if m]) == runs[1]
