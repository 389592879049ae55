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
from transformers import AutoModelForCausalLM, AutoTokenizer

from shardline.spec import ModelSpec
from shardline.tasks.text_to_sql.prompt import CHAT_USER
from tests.conftest import REPO, read_metrics
from tests.oracle import documents_of_rows, unpacked_loss
from tests.real.checkpoint import smollm2_dir
from tests.real.runs import cli, prepared_of, run_sets, train_run, user_sql_file

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


def _train(real, data, root, nproc, *extra) -> Path:
    return train_run(real, data, root, nproc, "data.prompt_format=chat", *extra)


def _sets(real: Path, data: Path, root: Path, nproc: int, *extra: str) -> list[str]:
    return run_sets(real, data, root, nproc, "data.prompt_format=chat", *extra)


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

def test_chat_examples_carry_loss_on_the_answer_and_the_final_end_of_turn_only(real, tok, user_file, tmp_path):
    from shardline.data.prepare import prepare
    from shardline.spec.resolve import load_spec

    args = _sets(real, user_file, tmp_path, 1)
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


# bf16 with one row: CPUs without bf16 matrix units (AVX2 only) emulate it at ~2 GFLOP/s, and two ranks' worth of
# rows would take minutes there; the two-rank bf16 reduction is covered by the tiny model's FSDP tests.
@pytest.mark.parametrize(("nproc", "precision", "tol", "n_rows"),
                         [(2, "fp32", 2e-4, 2), (1, "bf16", 5e-3, 1)])
def test_first_logged_loss_equals_transformers_on_the_same_examples_one_at_a_time(
        real, tok, user_file, tmp_path, nproc, precision, tol, n_rows):
    """Packing, masking, position ids, the block-diagonal mask and the loss normalisation, against transformers."""
    run_dir = _train(real, user_file, tmp_path, nproc, "train.max_steps=1", f"train.precision={precision}",
                     f"train.global_batch_size={n_rows}",
                     "model.lora.enabled=true")  # LoRA B starts at zero: step 0 is the pretrained model itself
    logged = read_metrics(run_dir, "train")[0]
    assert logged["step"] == 1
    rows = [r for rank in range(nproc)
            for rec in map(json.loads, (run_dir / "logs" / f"samples-rank-{rank}.jsonl").read_text().splitlines())
            if rec["step"] == 1 for r in rec["rows"]]
    assert len(rows) == n_rows
    docs = documents_of_rows(prepared_of(run_dir), rows)
    reference = _reference_documents(tok, user_file)
    assert docs and all(d in reference for d in docs), "a packed document differs from the template's rendering"
    exact = _oracle_loss(AutoModelForCausalLM.from_pretrained(real, dtype=torch.float32).eval(), docs, reference)
    n_loss = sum(len(d) - reference[d] for d in docs)
    assert logged["tokens"] == n_loss
    if precision == "fp32":
        print(f"{nproc} rank(s) fp32: shardline {logged['loss']:.6f} vs transformers {exact:.6f} "
              f"over {len(docs)} examples, {n_loss} loss tokens")
        assert logged["loss"] == pytest.approx(exact, rel=tol)
        return
    # bf16: both shardline and transformers' own bf16 model round every activation to bf16 (eps 7.8e-3) in kernels
    # whose blocking differs by CPU class; the scale of that noise is measured here, as transformers' bf16 loss's
    # distance from the exact (fp32) loss, and shardline's bf16 loss must be as close to exact, within 3× of it
    # (and of the `tol` floor: a masking or normalisation error moves the loss by tens of percent)
    theirs = _oracle_loss(AutoModelForCausalLM.from_pretrained(real, dtype=torch.bfloat16).eval(), docs, reference)
    print(f"1 rank bf16: shardline {logged['loss']:.6f}, transformers bf16 {theirs:.6f}, exact (fp32) {exact:.6f} "
          f"over {len(docs)} examples, {n_loss} loss tokens")
    assert abs(logged["loss"] - exact) <= max(3 * abs(theirs - exact), tol * exact)


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


def test_lora_train_eval_resume_export_round_trip_reproduces_shardline_in_plain_transformers(real, user_file, tmp_path):
    """2 ranks: train → validation → SQL generation eval → checkpoint → resume → export (adapter and merged) →
    peft/transformers. The full fine-tune's round trip, tied export included, runs on Gemma 3 (test_real_gemma3)."""
    extra = ["train.precision=fp32", "train.eval_examples=4", "train.eval_max_new_tokens=24",
             "model.lora.enabled=true", "model.lora.r=8"]
    run_dir = _train(real, user_file, tmp_path, 2, "train.max_steps=1", *extra, "train.eval_examples=0")
    cli("train", str(run_dir), *_sets(real, user_file, tmp_path, 2, "train.max_steps=2",
                                      "checkpoint.allow_spec_change=true", *extra))
    assert json.loads((run_dir / "eval.json").read_text())["n"] == 4  # the generation eval ran, and exited 0
    evals = [r for r in read_metrics(run_dir, "eval") if "val_loss" in r]
    assert [r["step"] for r in read_metrics(run_dir, "train")] == [1, 2]
    assert any(r["event"] == "resume" for r in read_metrics(run_dir, "event") if r.get("step") == 1)
    shardline_val = evals[-1]["val_loss"]
    data = prepared_of(run_dir)
    exported = tmp_path / "export"
    cli("export", str(run_dir), "--out", str(exported))
    base = AutoModelForCausalLM.from_pretrained(real, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, exported).eval()
    merged_dir = tmp_path / "merged"
    cli("export", str(run_dir), "--out", str(merged_dir), "--merge-lora", "--dtype", "fp32")  # auto: bf16, as SmolLM2
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
