"""`shardline export`: a run's DCP checkpoint becomes a Hugging Face directory with the trained model's logits."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from peft import PeftModel
from rich.console import Console
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from shardline.data.prepare import prepare
from shardline.data.tokenizer import special_ids, train_bpe
from shardline.errors import ShardlineError, SpecError
from shardline.export import EXPORT_DTYPES, export_dtype, export_run
from shardline.model.build import build_model
from shardline.rundir import create_run, read_manifest
from shardline.spec.resolve import spec_to_yaml
from shardline.tasks.text_to_sql.generate import generate_splits
from shardline.training.trainer import Trainer
from tests.conftest import REPO, small_spec


def _trained(ctx, root, run_id: str, *overrides: str) -> Trainer:
    """Two fp32 steps on one in-process rank, then a committed checkpoint at step 2."""
    spec = small_spec(root, "train.precision=fp32", "train.peak_tflops=1", "checkpoint.async_save=false",
                      f"run.id={run_id}", *overrides)
    spec, run_dir = create_run(spec)
    trainer = Trainer(spec, ctx, prepare(spec), run_dir, Console(quiet=True))
    for _ in range(2):
        trainer.train_step()
    trainer.save_checkpoint()
    assert trainer.checkpointer.store.committed() == [2]
    return trainer


@pytest.fixture(scope="module")
def full_run(ctx, session_dir) -> Trainer:
    return _trained(ctx, session_dir, "export-full")


@pytest.fixture(scope="module")
def lora_run(ctx, session_dir) -> Trainer:
    return _trained(ctx, session_dir, "export-lora", "model.lora.enabled=true", "model.lora.r=4")


@pytest.fixture(scope="module")
def full_export(full_run, tmp_path_factory):
    """Exported in a fresh process, as the CLI does: no process group exists there."""
    out = tmp_path_factory.mktemp("export") / "hf"
    out.mkdir()  # an existing empty directory is fine
    code = f"from shardline.export import export_run; export_run({str(full_run.run_dir)!r}, {str(out)!r})"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _ids(t: Trainer) -> torch.Tensor:
    return torch.tensor(t.data.rows("validation").tokens[:2, :48], dtype=torch.long)


@torch.no_grad()
def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).logits.float()


def _base(t: Trainer):
    torch.manual_seed(12345)  # build_model reseeds with model.init_seed: the base must not depend on this
    ids = special_ids(t.tokenizer, t.data.meta["pad_id"])
    return build_model(t.spec.model, t.data.meta["vocab_size"], ids).eval()


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def _stored_dtypes(file) -> set[str]:
    """The dtypes a safetensors file's header names (the header only is read)."""
    with safe_open(file, "pt") as f:
        return {f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118 (a safe_open handle is not iterable)


def _size(directory) -> int:
    return sum(p.stat().st_size for p in directory.iterdir() if p.suffix == ".safetensors")


def test_exported_model_reproduces_logits(full_run, full_export):
    t, out, ids = full_run, full_export, _ids(full_run)
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "shardline_export.json"} <= {p.name for p in out.iterdir()}
    assert not list(out.parent.glob(".hf.tmp-*"))

    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    expected, got = _logits(t.model, ids), _logits(exported, ids)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert _max_diff(got, _logits(_base(t), ids)) > 1e-3  # the trained weights, not a fresh init
    print(f"full export: max |logit diff| = {_max_diff(got, expected):.3e}")

    text = "SELECT name FROM users WHERE age > 30;"
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.encode(text) == t.tokenizer.encode(text) and tok.eos_token_id == t.tokenizer.eos_token_id
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == t.tokenizer.eos_token_id and gen["pad_token_id"] == t.data.meta["pad_id"]
    assert gen["bos_token_id"] == t.tokenizer.bos_token_id
    info = json.loads((out / "shardline_export.json").read_text())
    assert info["run_id"] == "export-full" and info["step"] == 2
    assert info["spec_hash"] == read_manifest(t.run_dir)["spec_hash"]
    assert info["dataset_version"] == t.data.version and (info["lora"], info["merged"]) == (False, False)
    # a model.arch base trained with train.precision=fp32 keeps fp32: the run's own dtype
    assert info["dtype"] == "float32" and _stored_dtypes(out / "model.safetensors") == {"F32"}
    assert info["warnings"] == []  # a dense run: nothing left out


def test_checkpoint_without_tokenizer_falls_back_to_prepared_data(full_run, full_export, tmp_path):
    run_dir = tmp_path / "old-run"
    shutil.copytree(full_run.run_dir, run_dir)
    ckpt = run_dir / "checkpoints" / "step-00000002"
    shutil.rmtree(ckpt / "tokenizer", ignore_errors=True)
    for name in ("spec.yaml", "meta.json"):
        (ckpt / name).unlink(missing_ok=True)
    for listing in ckpt.glob("*.sha256"):  # checkpoints of that age had no checksum lists either
        listing.unlink()
    out = export_run(run_dir, tmp_path / "hf")
    assert (out / "tokenizer.json").read_text() == (full_export / "tokenizer.json").read_text()
    a, b = load_file(out / "model.safetensors"), load_file(full_export / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_damaged_checkpoint_is_refused_by_name(full_run, tmp_path):
    run_dir = tmp_path / "damaged-run"
    shutil.copytree(full_run.run_dir, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step-00000002" / "tokenizer")
    with pytest.raises(ShardlineError, match="is damaged: tokenizer/.*missing") as e:
        export_run(run_dir, tmp_path / "hf")
    assert "--step" in e.value.fix


def test_lora_adapter_loads_with_peft(lora_run, tmp_path):
    t, ids = lora_run, _ids(lora_run)
    expected = _logits(t.model, ids)
    out = export_run(t.run_dir, tmp_path / "adapter")
    names = {p.name for p in out.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "shardline_base.json", "tokenizer.json"} <= names
    assert "model.safetensors" not in names
    base_info = json.loads((out / "shardline_base.json").read_text())
    assert base_info["model_path"] is None and base_info["init_seed"] == t.spec.model.init_seed

    base = _base(t)
    base_logits = _logits(base, ids)
    got = _logits(PeftModel.from_pretrained(base, out).eval(), ids)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert _max_diff(got, base_logits) > 1e-4  # the adapter changes the model
    print(f"lora adapter: max |logit diff| = {_max_diff(got, expected):.3e}")

    merged_out = export_run(t.run_dir, tmp_path / "merged", merge_lora=True)
    assert "adapter_config.json" not in {p.name for p in merged_out.iterdir()}
    got = _logits(AutoModelForCausalLM.from_pretrained(merged_out, dtype=torch.float32).eval(), ids)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    print(f"lora merged: max |logit diff| = {_max_diff(got, expected):.3e}")
    info = json.loads((merged_out / "shardline_export.json").read_text())
    assert (info["lora"], info["merged"], info["format"]) == (True, True, "full")


@pytest.fixture(scope="module")
def multimodal_gemma3(tmp_path_factory):
    """A tiny Gemma3ForConditionalGeneration checkpoint (Gemma 3 4B and larger ship so: a vision tower beside the
    language model, whose keys sit under `model.language_model.`, in bf16), random weights, a BPE tokenizer beside
    it."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    path = tmp_path_factory.mktemp("gemma3-multimodal")
    examples = generate_splits(5, 300, 10, 10)["train"]
    tok = train_bpe([t for e in examples for t in (e.question, e.context, e.answer)], 400)
    text = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=16,
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    # image tokens above the tokenizer's 400 ids: text never contains them
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=510,
                          boi_token_index=508, eoi_token_index=509)
    torch.manual_seed(0)
    Gemma3ForConditionalGeneration(config).to(torch.bfloat16).save_pretrained(path)  # as Gemma 3 ships
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def multimodal_lora_run(ctx, session_dir, multimodal_gemma3) -> Trainer:
    return _trained(ctx, session_dir, "export-lora-gemma3-mm", f"model.path={multimodal_gemma3}",
                    "model.lora.enabled=true", "model.lora.r=4")


def test_lora_adapter_of_a_multimodal_gemma3_loads_onto_the_base_it_names(multimodal_lora_run, multimodal_gemma3,
                                                                          tmp_path):
    """shardline trains the language model of a multimodal checkpoint alone; its adapter must still load onto that
    checkpoint (as `from_pretrained` builds it: Gemma3ForConditionalGeneration) and change its logits as in
    training — it matched no module and left the base's logits (the gemma-3-12b-lora preset's case)."""
    t = multimodal_lora_run
    ids = _ids(t)
    expected = _logits(t.model, ids)
    out = export_run(t.run_dir, tmp_path / "adapter")
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(multimodal_gemma3)
    assert not [m for m in config["target_modules"] if "vision" in m]  # its q/k/v projections did not train

    base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"], dtype=torch.float32).eval()
    assert type(base).__name__ == json.loads((out / "shardline_base.json").read_text())["class"]
    assert type(base).__name__ == "Gemma3ForConditionalGeneration"
    base_logits = _logits(base, ids)
    got = _logits(PeftModel.from_pretrained(base, out).eval(), ids)
    print(f"multimodal gemma3 lora: max |logit diff| to shardline {_max_diff(got, expected):.3e}, "
          f"to the base {_max_diff(got, base_logits):.3e}")
    assert _max_diff(got, base_logits) > 1e-4  # the adapter changes the model
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # the base is bf16, the adapter trained in fp32 and is written so (auto), unless --dtype says otherwise
    assert _stored_dtypes(out / "adapter_model.safetensors") == {"F32"}


def test_an_adapter_peft_would_load_as_nothing_is_refused_by_name(multimodal_lora_run, monkeypatch, tmp_path):
    """peft only warns when an adapter's weights match no module of the base; export checks the load itself."""
    import shardline.export

    monkeypatch.setattr(shardline.export, "_module_renamer", lambda trained, base: None)  # the text model's paths
    with pytest.raises(ShardlineError, match="does not load onto Gemma3ForConditionalGeneration.*16 weights match "
                       "no module.*22 LoRA weights would stay untrained") as e:  # 16 + the vision tower's q/k/v
        export_run(multimodal_lora_run.run_dir, tmp_path / "adapter")
    assert e.value.where == str(tmp_path / "adapter") and "--merge-lora" in e.value.fix
    assert not (tmp_path / "adapter").exists() and not list(tmp_path.glob(".adapter.tmp-*"))


def test_default_export_of_a_bf16_base_is_bf16_and_reloads_with_the_fp32_exports_logits(multimodal_lora_run,
                                                                                       tmp_path):
    """A merged export of a run whose base checkpoint is bf16 defaults to bf16 (half the fp32 export's size);
    `--dtype fp32` keeps the training's fp32 weights."""
    from shardline.cli import main

    t, ids = multimodal_lora_run, _ids(multimodal_lora_run)
    bf16 = export_run(t.run_dir, tmp_path / "bf16", merge_lora=True)
    assert main(["export", str(t.run_dir), "--out", str(tmp_path / "fp32"), "--merge-lora", "--dtype", "fp32"]) == 0
    fp32 = tmp_path / "fp32"
    for out, stored, name in ((bf16, "BF16", "bfloat16"), (fp32, "F32", "float32")):
        assert _stored_dtypes(out / "model.safetensors") == {stored}
        assert json.loads((out / "config.json").read_text())["dtype"] == name  # as save_pretrained writes it
        assert json.loads((out / "shardline_export.json").read_text())["dtype"] == name
    a, b = load_file(bf16 / "model.safetensors"), load_file(fp32 / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k].to(torch.bfloat16)) for k in a)  # a cast, no more
    ratio = _size(bf16) / _size(fp32)
    print(f"merged export: bf16 {_size(bf16)} B / fp32 {_size(fp32)} B = {ratio:.3f}")
    assert 0.49 < ratio < 0.51

    assert AutoModelForCausalLM.from_pretrained(bf16).dtype == torch.bfloat16  # transformers' dtype="auto" reads it
    # Both computed in fp32, so the weights' rounding alone differs: each bf16 weight is within 2^-9 (relative) of its
    # fp32 value, and a logit passes about 2 + 7 * layers rounded matrices (embedding, q/k/v/o, gate/up/down per
    # layer, the tied head), so to first order |diff| <= (2 + 7 * layers) * 2^-9 * max|logit|.
    got = _logits(AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.float32).eval(), ids)
    expected = _logits(AutoModelForCausalLM.from_pretrained(fp32, dtype=torch.float32).eval(), ids)
    layers = json.loads((fp32 / "config.json").read_text())["num_hidden_layers"]
    bound = (2 + 7 * layers) * 2**-9 * expected.abs().max().item()
    print(f"bf16 vs fp32 export: max |logit diff| {_max_diff(got, expected):.3e}, bound {bound:.3e}")
    assert 0 < _max_diff(got, expected) <= bound
    torch.testing.assert_close(expected, _logits(t.model, ids), atol=1e-4, rtol=1e-4)  # fp32 is the trained model


def test_export_dtype_auto_is_the_checkpoints_own(tmp_path):
    """auto: model.path's stored weights (above), a model.arch run's train.precision, fp32 for a LoRA adapter."""
    for precision, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        spec = small_spec(tmp_path, f"train.precision={precision}")
        assert spec.model.path is None and export_dtype(spec, "auto", full=True) == dtype
        assert export_dtype(spec, "auto", full=False) == torch.float32  # an adapter trains in fp32
        assert export_dtype(spec, "fp16", full=False) == torch.float16  # unless asked
    with pytest.raises(ShardlineError, match="unknown dtype 'fp8'"):
        export_dtype(spec, "fp8", full=True)


def test_a_bad_dtype_is_an_argparse_error_naming_the_choices(capsys):
    from shardline.cli import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["export", "runs/x", "--out", "hf", "--dtype", "fp8"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "argument --dtype: invalid choice: 'fp8' (choose from" in err
    for name in ("auto", *EXPORT_DTYPES):  # the CLI offers what export_run takes, and names it
        assert name in err.rsplit("choose from", 1)[1]
        assert build_parser().parse_args(["export", "runs/x", "--out", "hf", "--dtype", name]).dtype == name


def test_export_refuses_uncommitted_step(full_run, tmp_path):
    torn = full_run.checkpointer.store.path(5)
    os.makedirs(torn, exist_ok=True)  # no COMMITTED: a save that did not finish
    for step, state in ((5, "not committed"), (7, "does not exist")):
        with pytest.raises(ShardlineError, match=state) as e:
            export_run(full_run.run_dir, tmp_path / "out", step=step)
        assert f"step-0000000{step}" in e.value.where and "(2)" in e.value.fix
    os.rmdir(torn)
    assert not (tmp_path / "out").exists()
    empty = tmp_path / "empty-run"
    empty.mkdir()
    with pytest.raises(ShardlineError, match="not a run directory"):
        export_run(empty, tmp_path / "out")
    shutil.copy(full_run.run_dir / "spec.yaml", empty / "spec.yaml")
    with pytest.raises(ShardlineError, match="has no committed checkpoint"):
        export_run(empty, tmp_path / "out")
    with pytest.raises(ShardlineError, match="without LoRA"):
        export_run(full_run.run_dir, tmp_path / "out", merge_lora=True)


def test_export_refuses_nonempty_out(full_run, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ShardlineError, match="not empty") as e:
        export_run(full_run.run_dir, out)
    assert "--out" in e.value.fix
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and not list(tmp_path.glob(".out.tmp-*"))


@pytest.mark.parametrize(("url", "package"), [("s3://bucket/ckpt", "s3fs"), ("gs://bucket/ckpt", "gcsfs")])
def test_export_without_the_filesystem_package_names_checkpoint_dir(tmp_path, monkeypatch, url, package):
    monkeypatch.setitem(sys.modules, "s3fs", None)  # as where s3fs is not installed (gcsfs is not, here)
    assert importlib.util.find_spec(package) is None
    run_dir = tmp_path / "runs" / "remote"
    run_dir.mkdir(parents=True)
    (run_dir / "spec.yaml").write_text(spec_to_yaml(small_spec(tmp_path, "run.id=remote", f"checkpoint.dir={url}")))
    with pytest.raises(SpecError) as err:
        export_run(run_dir, tmp_path / "hf")
    assert err.value.where == "checkpoint.dir" and f"pip install {package}" in err.value.fix
