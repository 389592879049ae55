"""Meta-device build + `materialize`: checkpoints and random init land in each rank's shards, exactly."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from shardline.errors import SpecError
from shardline.export import build_plain
from shardline.model import sharded_load
from shardline.model.build import build_model
from shardline.model.lora import apply_lora
from shardline.model.sharded_load import materialize
from shardline.parallel.fsdp import device_mesh, parallelize
from shardline.spec import ModelSpec, ParallelSpec
from tests.conftest import REPO, small_spec
from tests.model.sharded_load_worker import fixed_input, write_checkpoint

WORKER = Path(__file__).with_name("sharded_load_worker.py")
IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}
READ_BUFFERS_BYTES = 64 << 20
"""What a rank loading its shards may add above its half of the fp32 weights: the pieces it reads at a time
(`sharded_load.READ_CHUNK_BYTES` of fp32 and their bf16 source, mapped) and the allocator's and gloo's slack."""


def _hf_checkpoint(path: Path, tie: bool = False, sharded: bool = False) -> Path:
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=tie, rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    torch.manual_seed(3)
    LlamaForCausalLM(cfg).save_pretrained(path, max_shard_size="100KB" if sharded else "1GB")
    return path


def _sharded(spec: ModelSpec) -> torch.nn.Module:
    """As the Trainer builds it: meta → LoRA → FSDP (this process's world-1 mesh) → materialize."""
    model = build_model(spec, 0, IDS, device="meta")
    if spec.lora.enabled:
        model = apply_lora(model, spec.lora)
    parallel = ParallelSpec()
    parallelize(model, device_mesh(parallel, 1, "cpu"), parallel, "fp32")
    materialize(model, spec, torch.device("cpu"))
    return model


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


@torch.no_grad()
def _logits(model: torch.nn.Module) -> torch.Tensor:
    return model(input_ids=fixed_input(400).repeat(2, 1)).logits


@pytest.mark.parametrize("layout", ["single-file", "sharded-index", "tied-embeddings"])
def test_checkpoint_loads_with_the_logits_of_from_pretrained(ctx, tmp_path, monkeypatch, layout):
    monkeypatch.setattr(sharded_load, "READ_CHUNK_BYTES", 1000)  # several pieces per tensor
    path = _hf_checkpoint(tmp_path / "ck", tie=layout == "tied-embeddings", sharded=layout == "sharded-index")
    assert (path / "model.safetensors.index.json").exists() == (layout == "sharded-index")
    ours = _sharded(ModelSpec(path=str(path)))
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert all(isinstance(p, DTensor) for p in ours.parameters())
    torch.testing.assert_close(_logits(ours), _logits(ref), atol=1e-5, rtol=1e-5)
    for name, buffer in ref.named_buffers():  # non-persistent rotary buffers, recomputed after meta init
        assert torch.equal(ours.get_buffer(name), buffer), name
    tied = ours.lm_head.weight is ours.model.embed_tokens.weight
    assert tied == (layout == "tied-embeddings") == ref.config.tie_word_embeddings


@pytest.mark.parametrize("overrides", [[], ["model.arch.tie_embeddings=true", "model.lora.enabled=true",
                                            "model.lora.r=4"]], ids=["full", "tied-lora"])
def test_random_init_equals_the_plain_export_build_bit_for_bit(ctx, tmp_path, overrides):
    spec = small_spec(tmp_path, *overrides)
    torch.manual_seed(123)  # the init does not read the global RNG
    sharded = _sharded(spec.model)
    torch.manual_seed(456)
    plain = build_plain(spec, 500, IDS)
    assert [n for n, _ in sharded.named_parameters()] == [n for n, _ in plain.named_parameters()]
    for (name, a), b in zip(plain.named_parameters(), sharded.parameters(), strict=True):
        assert torch.equal(a, _full(b)), name
    for (name, a), b in zip(plain.named_buffers(), sharded.buffers(), strict=True):
        assert torch.equal(a, b), name
    torch.testing.assert_close(_logits(sharded), _logits(plain), atol=1e-5, rtol=1e-5)


def test_random_init_is_the_same_on_one_thread_and_on_many(tmp_path):
    # the parameters are filled on torch's intra-op thread count (the cores of a 1-process run: an 8B init is ~8e9
    # draws): each block has its own generator, so the values never depend on how many threads drew them
    spec = small_spec(tmp_path, "model.lora.enabled=true", "model.lora.r=4")
    threads = torch.get_num_threads()
    models = []
    try:
        for n in (1, 4):
            torch.set_num_threads(n)
            models.append(build_plain(spec, 500, IDS))
    finally:
        torch.set_num_threads(threads)
    one, many = (dict(m.named_parameters()) for m in models)
    assert one.keys() == many.keys() and len(one) > 10
    for name, value in one.items():
        assert torch.equal(value, many[name]), name


def test_random_init_follows_hf_and_peft_and_depends_on_init_seed(tmp_path):
    spec = small_spec(tmp_path, "model.lora.enabled=true", "model.lora.r=4")
    model = build_plain(spec, 500, IDS)
    base, std = model.get_base_model(), model.get_base_model().config.initializer_range
    embed = base.model.embed_tokens.weight
    assert torch.equal(embed[IDS["pad_token_id"]], torch.zeros(embed.shape[1]))  # HF zeroes the padding row
    assert embed.std().item() == pytest.approx(std, rel=0.05) and abs(embed.mean().item()) < 1e-3
    q = base.model.layers[0].self_attn.q_proj
    assert q.lora_B["default"].weight.abs().sum() == 0
    bound = 1 / math.sqrt(q.lora_A["default"].weight.shape[1])  # kaiming_uniform(a=√5)
    assert 0.9 * bound < q.lora_A["default"].weight.abs().max() <= bound
    assert torch.equal(base.model.norm.weight, torch.ones_like(base.model.norm.weight))
    other = build_plain(small_spec(tmp_path, "model.lora.enabled=true", "model.lora.r=4", "model.init_seed=1"),
                        500, IDS)
    assert not torch.equal(other.get_base_model().model.embed_tokens.weight, embed)
    assert not torch.equal(other.get_base_model().model.layers[0].self_attn.q_proj.lora_A["default"].weight,
                           q.lora_A["default"].weight)


def test_a_checkpoint_that_does_not_fit_is_a_spec_error_naming_the_keys(tmp_path):
    path = _hf_checkpoint(tmp_path / "ck")
    tensors = load_file(path / "model.safetensors")
    norm = tensors.pop("model.norm.weight")
    stale = {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}  # older checkpoints; ignored as HF does
    save_file(tensors | stale | {"extra.weight": torch.zeros(2)}, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(SpecError) as e:
        build_model(ModelSpec(path=str(path)), 0, {})
    assert e.value.where == "model.path" and "missing keys ['model.norm.weight']" in e.value.problem
    assert "unexpected keys ['extra.weight']" in e.value.problem

    save_file(tensors | {"model.norm.weight": norm[:7]}, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(SpecError, match=r"model.norm.weight has shape \(7,\), the model expects \(64,\)"):
        build_model(ModelSpec(path=str(path)), 0, {})

    (path / "model.safetensors").unlink()
    with pytest.raises(SpecError, match="neither model.safetensors nor model.safetensors.index.json"):
        build_model(ModelSpec(path=str(path)), 0, {})


def _torchrun(nproc: int, *args: str, timeout: int = 300) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(WORKER), *args]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.slow
def test_two_ranks_random_init_matches_the_plain_build_on_fsdp_and_hsdp_meshes(tmp_path, monkeypatch):
    """Uneven row shards (vocab 501, intermediate 171) and init blocks of 1000 elements that straddle them."""
    spec = small_spec(tmp_path, "model.arch.vocab_size=501", "model.arch.intermediate_size=171",
                      "model.lora.enabled=true", "model.lora.r=4")
    out = tmp_path / "out"
    out.mkdir()
    meshes = [ParallelSpec(), ParallelSpec(dp_replicate=2)]
    _torchrun(2, "load", str(out), "--spec", spec.model.model_dump_json(), "--dump-state", "--block-elements", "1000",
              *[a for p in meshes for a in ("--parallel", p.model_dump_json())])
    monkeypatch.setattr(sharded_load, "INIT_BLOCK_ELEMENTS", 1000)
    model = build_model(spec.model, 0, {}, device="meta")
    plain = apply_lora(model, spec.model.lora)
    materialize(plain, spec.model, torch.device("cpu"))
    for i in range(len(meshes)):
        state = torch.load(out / f"state-{i}.pt")
        assert state.keys() == dict(plain.named_parameters()).keys()
        for name, param in plain.named_parameters():
            assert torch.equal(state[name], param), (i, name)
        torch.testing.assert_close(torch.load(out / f"logits-{i}.pt"), plain(input_ids=fixed_input(501)).logits,
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_two_ranks_load_a_checkpoint_reading_only_their_shards(tmp_path):
    """Each rank adds its half of one fp32 copy and a few read buffers to its peak RSS, never a whole tensor (the
    embedding alone, 131 MB in bf16, is above the buffers' allowance), and gets the logits of a plain
    from_pretrained load."""
    path = tmp_path / "llama"
    path.mkdir()
    n_params = write_checkpoint(path, layers=4, layers_per_file=2)  # 337M parameters, bf16, 3 safetensors + index
    assert len(list(path.glob("*.safetensors"))) == 3
    fp32_bytes = 4 * n_params
    ours = tmp_path / "ours"
    ours.mkdir()
    _torchrun(2, "load", str(ours), "--spec", ModelSpec(path=str(path)).model_dump_json())
    for rank in range(2):
        r = json.loads((ours / f"rank-{rank}-0.json").read_text())
        peak, added = r["peak_rss_bytes"], r["peak_rss_bytes"] - r["rss_before_bytes"]
        print(f"rank {rank}: peak RSS {peak / 1e9:.2f} GB, loading added {added / 1e9:.3f} GB = "
              f"{added / fp32_bytes:.1%} of fp32 {fp32_bytes / 1e9:.2f} GB, load {r['load_s']:.1f}s")
        assert added < fp32_bytes / 2 + READ_BUFFERS_BYTES
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        expected = ref(input_ids=fixed_input(ref.config.vocab_size)).logits
    torch.testing.assert_close(torch.load(ours / "logits-0.pt"), expected, atol=1e-5, rtol=1e-5)


def test_local_cache_stages_the_checkpoint_once_and_loads_from_the_copy(ctx, tmp_path):
    from shardline.model.local_cache import COMPLETE, staged_model_spec

    path = _hf_checkpoint(tmp_path / "mounted")
    spec = ModelSpec(path=str(path), local_cache=str(tmp_path / "ssd"))
    local = staged_model_spec(spec, local_rank=0)
    staged = Path(local.path)
    assert staged.parent == tmp_path / "ssd" and (staged / COMPLETE).exists()
    stamp = (staged / "model.safetensors").stat().st_mtime_ns
    assert staged_model_spec(spec, local_rank=0).path == local.path  # second call: no new copy
    assert (staged / "model.safetensors").stat().st_mtime_ns == stamp
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.testing.assert_close(_logits(_sharded(local)), _logits(ref), atol=1e-5, rtol=1e-5)
    with pytest.raises(SpecError, match="model.local_cache"):
        staged_model_spec(ModelSpec(path=str(tmp_path / "nope"), local_cache=str(tmp_path / "ssd")), 0)


def test_a_gemma3_checkpoint_loads_with_the_logits_of_from_pretrained(ctx, tmp_path):
    # was: "model.embed_tokens: no initialisation after meta init for buffers ['embed_scale']", then Gemma 3's
    # per-layer-type rotary buffers (sliding_attention_inv_freq, full_attention_inv_freq)
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                              sliding_window=8)
    torch.manual_seed(0)
    Gemma3ForCausalLM(config).float().save_pretrained(tmp_path)
    ours = _sharded(ModelSpec(path=str(tmp_path)))
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.randint(3, 512, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(ours(input_ids=ids).logits, theirs(input_ids=ids).logits)


def test_a_multimodal_gemma3_checkpoint_trains_its_language_model_with_the_logits_of_transformers(ctx, tmp_path):
    """Gemma 3 4B and larger ship as Gemma3ForConditionalGeneration: the language model loads alone (its keys under
    `language_model.`), the vision tower and projector are not read; text logits as transformers' full model."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=128, sliding_window=8)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=5,
                          boi_token_index=6, eoi_token_index=7)
    torch.manual_seed(0)
    Gemma3ForConditionalGeneration(config).float().save_pretrained(tmp_path)
    ours = _sharded(ModelSpec(path=str(tmp_path)))
    assert type(ours).__name__ == "FSDPGemma3ForCausalLM"
    theirs = Gemma3ForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.randint(8, 512, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(ours(input_ids=ids).logits, theirs(input_ids=ids).logits)


def test_mixture_of_experts_checkpoints_of_untested_families_are_refused_by_name(tmp_path):
    from transformers import PhimoeConfig  # the families that train: tests/model/test_moe.py

    PhimoeConfig(vocab_size=512, hidden_size=64, num_hidden_layers=1, num_attention_heads=4).save_pretrained(tmp_path)
    with pytest.raises(SpecError, match="mixture-of-experts.*Qwen3 \\(qwen3\\)") as e:
        build_model(ModelSpec(path=str(tmp_path)), 0, {}, device="meta")
    assert e.value.where == "model.path"
