import torch
from rich.console import Console
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from shardline.data.loader import make_batch
from shardline.data.prepare import prepare
from shardline.data.tokenizer import train_bpe
from shardline.model.build import build_model
from shardline.rundir import create_run
from shardline.tasks.text_to_sql.generate import generate_splits
from shardline.training.trainer import Trainer
from tests.conftest import read_metrics, small_spec

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _local_checkpoint(tmp_path):
    """A real HF checkpoint directory: config + safetensors + tokenizer with a chat template."""
    path = tmp_path / "local-model"
    examples = generate_splits(5, 300, 10, 10)["train"]
    tok = train_bpe([t for e in examples for t in (e.question, e.context, e.answer)], 400)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(3)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def test_local_checkpoint_loads_with_the_same_logits(tmp_path):
    path = _local_checkpoint(tmp_path)
    spec = small_spec(tmp_path, f"model.path={path}")
    ours = build_model(spec.model, 400, {}).eval()
    ref = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = torch.randint(0, 400, (2, 32))
    assert torch.equal(ours(input_ids=ids).logits, ref(input_ids=ids).logits)


def test_local_checkpoint_with_chat_template_trains(ctx, tmp_path):
    """The Trainer's whole run in this process on one rank (the launch path is every CLI test's; on a real local
    checkpoint, tests/real/test_real_checkpoint.py's)."""
    path = _local_checkpoint(tmp_path)
    spec, run = create_run(small_spec(tmp_path, f"model.path={path}", "data.prompt_format=chat", "train.max_steps=3"))
    Trainer(spec, ctx, prepare(spec), run, Console(quiet=True)).fit()
    train = read_metrics(run, "train")
    assert len(train) == 3 and train[-1]["loss"] < train[0]["loss"]


def test_chat_prompt_has_exactly_one_bos(tmp_path):
    path = _local_checkpoint(tmp_path)
    data = prepare(small_spec(tmp_path, f"model.path={path}", "data.prompt_format=chat"))
    tok = data.tokenizer()
    rows = data.rows("train")
    pos = rows.position_ids[0][: rows.n_real[0]]
    starts = [int(i) for i in (pos == 0).nonzero()[0]] + [int(rows.n_real[0])]
    first = rows.tokens[0][starts[0] : starts[1]]
    assert list(first).count(tok.bos_token_id) == 1 and first[0] == tok.bos_token_id


def test_packed_documents_do_not_attend_to_each_other_with_sdpa(prepared):
    """HF builds a block-diagonal causal mask from restarting position ids: packing does not leak."""
    rows = prepared.rows("train")
    r = next(i for i in range(len(rows.n_real)) if (rows.position_ids[i][: rows.n_real[i]] == 0).sum() >= 2)
    starts = (rows.position_ids[r][: rows.n_real[r]] == 0).nonzero()[0]
    a, b = int(starts[1]), int(starts[2]) if len(starts) > 2 else int(rows.n_real[r])
    spec = small_spec(prepared.root.parent.parent)
    model = build_model(spec.model, prepared.meta["vocab_size"], {}).eval()
    batch = make_batch(rows, __import__("numpy").array([r]))
    packed = model(input_ids=batch.input_ids, position_ids=batch.position_ids).logits[0, a:b]
    alone = model(input_ids=batch.input_ids[:, a:b]).logits[0]
    torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-4)
