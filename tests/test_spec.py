import pytest
import yaml

from shardline.errors import SpecError
from shardline.spec.resolve import apply_override, load_spec, preset_names, spec_hash, spec_to_yaml
from tests.conftest import run_cli


def test_presets_resolve_and_mirror_the_reference_job():
    assert {"tiny", "llama-3.1-8b-lora", "llama-3.1-70b-fsdp"} <= set(preset_names())
    big = load_spec("llama-3.1-70b-fsdp")
    assert (big.launch.nnodes, big.parallel.nproc_per_node, big.train.micro_batch_size) == (2, 8, 8)
    assert big.world_size == 16 and big.grad_accum_steps == 8
    assert load_spec("llama-3.1-8b-lora").model.lora.enabled


def test_set_overrides_parse_yaml_scalars():
    spec = load_spec("tiny", ["train.lr=2e-5", "parallel.compile=true", "train.max_grad_norm=null"])
    assert spec.train.lr == 2e-5 and spec.parallel.compile is True and spec.train.max_grad_norm is None


def test_unknown_field_names_the_path_and_the_known_fields():
    with pytest.raises(SpecError) as e:
        load_spec("tiny", ["train.learning_rate=1e-4"])
    assert e.value.where == "train.learning_rate" and "lr" in e.value.fix


def test_wrong_type_names_field_and_value():
    with pytest.raises(SpecError) as e:
        load_spec("tiny", ["train.max_steps=many"])
    assert e.value.where == "train.max_steps" and "'many'" in e.value.problem


def test_global_batch_must_divide_by_world_times_micro_batch():
    with pytest.raises(SpecError) as e:
        load_spec("tiny", ["train.global_batch_size=24", "parallel.nproc_per_node=2", "train.micro_batch_size=8"])
    assert e.value.where == "train.global_batch_size"
    assert "2 × 8 = 16" in e.value.problem and "global_batch_size=16" in e.value.fix


@pytest.mark.parametrize(("override", "field"), [
    ("model.arch.num_kv_heads=3", "model.arch.num_kv_heads"),
    ("train.seq_len=4096", "train.seq_len"),
    ("train.warmup_steps=1000", "train.warmup_steps"),
    ("data.prompt_format=chat", "data.prompt_format"),
])
def test_impossible_combinations_are_rejected(override, field):
    with pytest.raises(SpecError) as e:
        load_spec("tiny", [override])
    assert e.value.where == field


def test_spec_file_and_missing_file(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("train:\n  max_steps: 70\n")
    assert load_spec(str(path)).train.max_steps == 70
    with pytest.raises(SpecError, match="not found"):
        load_spec(str(tmp_path / "nope.yaml"))
    with pytest.raises(SpecError, match="neither a spec file nor a preset"):
        load_spec("no-such-preset")


def test_override_into_a_value_is_an_error():
    with pytest.raises(SpecError):
        apply_override({"train": 3}, "train.lr=1")


def test_spec_hash_ignores_run_id_but_not_settings():
    a = load_spec("tiny")
    b = load_spec("tiny", ["run.id=tiny-x"])
    c = load_spec("tiny", ["train.lr=1e-4"])
    assert spec_hash(a) == spec_hash(b) != spec_hash(c)
    assert type(a).model_validate(yaml.safe_load(spec_to_yaml(a))) == a


def test_cli_bad_spec_exits_2_with_field_and_fix():
    out = run_cli("config", "show", "--set", "train.global_batch_size=17", "--nproc", "2")
    assert out.returncode == 2
    assert "train.global_batch_size" in out.stderr and "fix:" in out.stderr and "Traceback" not in out.stderr
    assert out.stdout == ""  # `config show ... > spec.yaml` never writes the error into the file


def test_cli_config_show_prints_resolved_spec():
    out = run_cli("config", "show", "llama-3.1-8b-lora", "--set", "train.lr=1e-5")
    assert out.returncode == 0, out.stderr
    assert "lr: 1.0e-05" in out.stdout and "nproc_per_node: 8" in out.stdout


def test_local_train_refuses_multi_node_spec_before_starting(tmp_path):
    out = run_cli("train", "llama-3.1-70b-fsdp", "--set", f"run.dir={tmp_path}")
    assert out.returncode == 2 and "launch.nnodes" in out.stderr
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(("max_steps", "warmup"), [(1, 0), (2, 0), (20, 1), (300, 15), (2000, 100)])
def test_default_warmup_scales_with_max_steps_so_short_runs_are_valid(max_steps, warmup):
    spec = load_spec("tiny", [f"train.max_steps={max_steps}"])
    assert spec.train.warmup_steps == warmup
    assert yaml.safe_load(spec_to_yaml(spec))["train"]["warmup_steps"] == warmup  # resumes keep it fixed


def test_explicit_warmup_longer_than_the_run_is_refused_with_the_default_named():
    with pytest.raises(SpecError) as e:
        load_spec("tiny", ["train.max_steps=2", "train.warmup_steps=5"])
    assert e.value.where == "train.warmup_steps" and "5% of max_steps" in e.value.fix


def test_an_unknown_field_suggests_the_closest_one_also_inside_a_list_of_sections():
    with pytest.raises(SpecError) as e:
        load_spec("tiny", ["trian.lr=1e-4"])
    assert e.value.where == "trian" and e.value.fix.startswith("did you mean train?")
    with pytest.raises(SpecError) as e:
        load_spec("tiny", ["data.sources=[{path: a.jsonl, wieght: 2}]"])
    assert e.value.where == "data.sources.0.wieght" and "did you mean data.sources.0.weight?" in e.value.fix
    assert "path, weight, format, columns, name" in e.value.fix


@pytest.mark.parametrize(("overrides", "field", "words"), [
    (["model.lora.enabled=true", "model.lora.target_modules=[q_proj, lm_head]", "parallel.tp=2"],
     "model.lora.target_modules", "split over the vocabulary"),
    (["data.sources=[{path: a.jsonl}]", "data.path=b.jsonl"], "data.sources", "describe one source"),
    (["model.lora.quantize_base=nf4"], "model.lora.quantize_base", "model.lora.enabled is false"),
    (["model.lora.enabled=true", "model.lora.quantize_base=nf4", "parallel.tp=2"], "model.lora.quantize_base",
     "held whole"),
    (["model.lora.enabled=true", "model.lora.quantize_base=nf4", "parallel.offload=true"],
     "model.lora.quantize_base", "outside FSDP, on the device"),
    (["data.sources=[{path: a.jsonl, name: x}, {path: b.jsonl, name: x}]"], "data.sources", "twice"),
    (["train.objective=grpo", "parallel.tp=2"], "train.objective", "tensor and context parallel split"),
    (["train.objective=grpo", "data.path=a.jsonl", "data.format=text"], "data.format", "asks nothing"),
    (["train.objective=grpo", "data.path=a.jsonl", "data.task=none"], "train.grpo.reward", "no built-in reward"),
    (["train.objective=grpo", "train.grpo.num_generations=12"], "train.global_batch_size",
     "num_generations × ranks = 12 × 2"),
    (["train.objective=grpo", "train.grpo.max_new_tokens=256"], "train.grpo.max_new_tokens", "not below"),
    (["train.objective=grpo", "train.grpo.reward=os.system"], "train.grpo.reward", "neither auto nor"),
    (["train.objective=grpo", "train.grpo.num_iterations=4", "train.max_steps=6"], "train.max_steps",
     "not a multiple of train.grpo.num_iterations=4"),
    (["train.objective=grpo", "train.grpo.num_iterations=2", "checkpoint.every_steps=3"], "checkpoint.every_steps",
     "could not be resumed exactly"),
])
def test_combinations_that_cannot_run_are_named_errors(overrides, field, words):
    with pytest.raises(SpecError) as e:
        load_spec("tiny", overrides)
    assert e.value.where == field and words in e.value.problem


def test_cli_says_its_version():
    from shardline import __version__

    out = run_cli("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"shardline {__version__}"
