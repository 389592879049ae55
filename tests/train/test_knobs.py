"""Every spec knob changes something observable (no dead knobs), on one in-process gloo rank."""

import ast
import re
import typing
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from pydantic import BaseModel
from rich.console import Console
from torch.distributed.tensor import DTensor

from shardline.data.loader import StepSampler
from shardline.spec import JobSpec
from shardline.training.optim import lr_factor
from shardline.training.trainer import Trainer
from tests.conftest import free_port, small_spec

SRC = Path(__file__).resolve().parents[2] / "src" / "shardline"


def _trainer(ctx, session_dir, prepared, *overrides) -> Trainer:
    spec = small_spec(session_dir, "train.precision=fp32", "train.peak_tflops=1", *overrides)
    return Trainer(spec, ctx, prepared, session_dir / "runs" / "knobs", Console(quiet=True))


def _flat(model) -> torch.Tensor:
    return torch.cat([p.full_tensor().flatten() if isinstance(p, DTensor) else p.flatten()
                      for p in model.parameters()]).detach().clone()


# Reading a field where it is declared (sections.py's properties) or checked against others (rules.py) is no use of it
FIELD_READS_EXCLUDED = ("spec/sections.py", "spec/rules.py")
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


def _sections_in(annotation) -> list[type[BaseModel]]:
    """The sections a field holds: itself (`train`), or the elements of a list or dict of them (`data.sources`)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [s for arg in typing.get_args(annotation) for s in _sections_in(arg)]


def _leaf_fields(model: type[BaseModel], prefix: str = "", key: str = ""):
    """(dotted path, field name, section class, the section's own key) for every leaf field of the spec."""
    for name, field in model.model_fields.items():
        subs = _sections_in(field.annotation)
        whole = isinstance(field.annotation, type) and bool(subs)
        for sub in subs:
            yield from _leaf_fields(sub, f"{prefix}{name}{'' if whole else '[]'}.", name)
        if not whole:
            yield f"{prefix}{name}", name, model, key


def _names(target: ast.expr) -> list[ast.expr]:
    return [n for e in target.elts for n in _names(e)] if isinstance(target, ast.Tuple | ast.List) else [target]


class _SectionReads:
    """Which section each `.field` access in the source is made on, as far as the text says.

    An access `X.field` is on section `key` when X ends in `.key` (`spec.train.lr`, `self.spec.checkpoint.dir`), or
    X is a name bound to such an expression in the same or an enclosing function (`t = spec.train`, `k, r =
    spec.launch.kubernetes, spec.launch.ray`, `for s in d.sources`), or a parameter annotated with the section's
    class (`def f(t: TrainSpec)`), or `self.<attr>` assigned one of those anywhere in the module."""

    def __init__(self, keys_of_class: dict[str, set[str]]) -> None:
        self.keys_of_class = keys_of_class
        self.members: dict[str, set[str]] = {}  # `self.<attr>` -> section keys, for every method of the module
        self.reads: dict[str, set[str]] = defaultdict(set)  # field name -> section keys it is read on

    def keys(self, expr: ast.expr, aliases: dict[str, set[str]]) -> set[str]:
        text = ast.unparse(expr)
        if text in aliases:
            return aliases[text]
        if isinstance(expr, ast.Attribute):
            return {expr.attr}
        if isinstance(expr, ast.BoolOp):  # `spec.sources or [...]`
            return set().union(*(self.keys(v, aliases) for v in expr.values))
        if isinstance(expr, ast.Subscript):  # an entry of a list of sections
            return self.keys(expr.value, aliases)
        if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and expr.func.attr in (
                "model_copy", "values", "items"):
            return self.keys(expr.func.value, aliases)
        if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id in (
                "sorted", "reversed", "list", "enumerate") and expr.args:
            return self.keys(expr.args[0], aliases)
        return set()

    def _bind(self, target: ast.expr, value: ast.expr, aliases: dict[str, set[str]]) -> None:
        if isinstance(target, ast.Tuple | ast.List) and isinstance(value, ast.Tuple | ast.List):
            for t, v in zip(target.elts, value.elts, strict=False):
                self._bind(t, v, aliases)
        elif keys := self.keys(value, aliases):
            for name in _names(target):
                aliases[ast.unparse(name)] = keys
                if ast.unparse(name).startswith("self."):
                    self.members[ast.unparse(name)] = keys

    def _own(self, scope: ast.AST) -> list[ast.AST]:
        out, stack = [], list(ast.iter_child_nodes(scope))
        while stack:
            node = stack.pop()
            out.append(node)
            if not isinstance(node, _SCOPES):
                stack.extend(ast.iter_child_nodes(node))
        return sorted(out, key=lambda n: (getattr(n, "lineno", 0), getattr(n, "col_offset", 0)))  # bindings in order

    def visit(self, scope: ast.AST, inherited: dict[str, set[str]]) -> None:
        aliases, own = {**self.members, **inherited}, self._own(scope)
        if isinstance(scope, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            for arg in [*scope.args.posonlyargs, *scope.args.args, *scope.args.kwonlyargs]:
                annotation = ast.unparse(arg.annotation) if arg.annotation else ""
                for cls, keys in self.keys_of_class.items():
                    if re.search(rf"\b{cls}\b", annotation):
                        aliases[arg.arg] = keys
        for node in own:
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    self._bind(target, node.value, aliases)
            elif isinstance(node, ast.AnnAssign | ast.NamedExpr) and node.value is not None:
                self._bind(node.target, node.value, aliases)
            elif isinstance(node, ast.For | ast.comprehension):
                self._bind(node.target, node.iter, aliases)
        for node in own:
            if isinstance(node, ast.Attribute):
                self.reads[node.attr] |= self.keys(node.value, aliases)
            if isinstance(node, _SCOPES):
                self.visit(node, aliases)

    def module(self, tree: ast.Module) -> None:
        """Twice: the first pass finds `self.<attr> = <section>` in any method, the second uses it in all."""
        self.members = {}
        self.visit(tree, {})
        self.visit(tree, {})


def test_every_spec_field_is_read_somewhere():
    """Each leaf field is read as an attribute on its own section somewhere in the package (other than where it is
    declared or validated). An entry of a list of sections may instead be passed on whole (`t.model_dump()` for each of
    `launch.kubernetes.tolerations`: Kubernetes objects verbatim); a whole top-level section's dump does not count,
    since dumping `model` into a file would excuse every model field."""
    leaves = list(_leaf_fields(JobSpec))
    keys_of_class: dict[str, set[str]] = defaultdict(set)
    for _, _, section, key in leaves:
        keys_of_class[section.__name__].add(key)
    seen = _SectionReads(keys_of_class)
    for path in SRC.rglob("*.py"):
        if path.relative_to(SRC).as_posix() not in FIELD_READS_EXCLUDED:
            seen.module(ast.parse(path.read_text(), str(path)))
    unread = [path for path, name, _, key in leaves
              if key not in seen.reads[name] and not ("[]." in path and key in seen.reads["model_dump"])]
    assert not unread, f"spec fields no code reads on their own section (a dead knob, or an unseen read): {unread}"


def test_lr_schedule_warms_up_then_decays_to_min_ratio():
    spec = small_spec(Path("/tmp"), "train.max_steps=100", "train.warmup_steps=10", "train.min_lr_ratio=0.2").train
    assert lr_factor(0, spec) == pytest.approx(0.1) and lr_factor(9, spec) == pytest.approx(1.0)
    assert lr_factor(55, spec) == pytest.approx(0.6) and lr_factor(100, spec) == pytest.approx(0.2)


def test_train_seed_changes_data_order_and_init_seed_changes_weights(ctx, session_dir, prepared):
    a, b = StepSampler(100, 0, 8, 4, 1), StepSampler(100, 1, 8, 4, 1)
    assert (a.micro_indices(0, 0, 0) != b.micro_indices(0, 0, 0)).any()
    w0 = _flat(_trainer(ctx, session_dir, prepared).model)
    w1 = _flat(_trainer(ctx, session_dir, prepared, "model.init_seed=1").model)
    assert not torch.equal(w0, w1)


def _grad_norm_seen_by_optimizer(t: Trainer) -> float:
    seen = []

    def hook(opt, args, kwargs):
        grads = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                 for g in opt.param_groups for p in g["params"] if p.grad is not None]
        seen.append(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item())

    t.optimizer.register_step_pre_hook(hook)
    t.record = t.train_step()
    return seen[0]


def test_grad_clipping_is_applied_and_the_pre_clip_norm_logged(ctx, session_dir, prepared):
    free = _trainer(ctx, session_dir, prepared, "train.max_grad_norm=null")
    clipped = _trainer(ctx, session_dir, prepared, "train.max_grad_norm=0.01")
    assert _grad_norm_seen_by_optimizer(free) == pytest.approx(free.record.grad_norm, rel=1e-4)
    assert _grad_norm_seen_by_optimizer(clipped) == pytest.approx(0.01, rel=1e-3)
    assert clipped.record.grad_norm == pytest.approx(free.record.grad_norm, rel=1e-5) and free.record.grad_norm > 0.1


def test_activation_checkpointing_gives_the_same_loss_and_gradients(ctx, session_dir, prepared):
    plain = _trainer(ctx, session_dir, prepared)
    ac = _trainer(ctx, session_dir, prepared, "parallel.activation_checkpointing=full")
    assert ac.model.is_activation_checkpointing and not plain.model.is_activation_checkpointing
    r0, r1 = plain.train_step(), ac.train_step()
    assert r0.loss == pytest.approx(r1.loss, rel=1e-6) and r0.grad_norm == pytest.approx(r1.grad_norm, rel=1e-5)


def test_reshard_after_forward_controls_whether_block_params_stay_gathered(ctx, session_dir, prepared):
    for reshard, sharded in (("true", True), ("false", False)):
        t = _trainer(ctx, session_dir, prepared, f"parallel.reshard_after_forward={reshard}")
        batch = t.sampler.step_batches(t.rows, 0, 0)[0]
        t.model(input_ids=batch.input_ids, position_ids=batch.position_ids)
        layer = t.model.model.layers[0]
        assert isinstance(next(layer.parameters()), DTensor) == sharded


def test_peak_override_and_bf16_precision(ctx, session_dir, prepared):
    t = _trainer(ctx, session_dir, prepared, "train.precision=bf16", "train.peak_tflops=2.5")
    assert (t.peak_tflops, t.peak_source) == (2.5, "train.peak_tflops")
    seen = []
    hook = t.model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    t.train_step()
    hook.remove()
    assert seen and set(seen) == {torch.bfloat16}


def test_compile_wraps_each_block(ctx, session_dir, prepared):
    t = _trainer(ctx, session_dir, prepared, "parallel.compile=true")
    assert all(layer._compiled_call_impl is not None for layer in t.model.model.layers)
    assert t.train_step().loss > 0


def test_compiled_blocks_do_not_recompile_for_batches_of_other_document_lengths(ctx, session_dir, prepared):
    """Packed rows differ in their documents every step; the compiled blocks must not recompile for each. (The
    per-document attention itself runs outside them, a graph break by design on this path: CUDA's variable-length
    kernel is what removes it.)"""
    from torch._dynamo.utils import counters

    from shardline.data.loader import make_batch

    torch._dynamo.reset()
    counters.clear()
    t = _trainer(ctx, session_dir, prepared, "parallel.compile=true")
    t.train_step()
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0
    lengths = set()
    for _ in range(3):
        index = t.sampler.micro_indices(t.step, 0, t.dp_rank)
        lengths.add(tuple(make_batch(t.rows, index).spans.lengths))
        t.train_step()
    assert len(lengths) == 3  # three different document layouts went through
    assert counters["stats"]["unique_graphs"] == graphs and not counters["recompiles"], dict(counters["recompiles"])


@pytest.mark.parametrize("policy", ["selective", "full"])
def test_selective_checkpointing_recomputes_no_matmul_or_attention_and_full_recomputes_both(
        ctx, session_dir, prepared, policy):
    """Counted in one step's dispatches: selective keeps the outputs of the matmuls and the attention kernel (the
    ops torchtitan saves), so neither runs again in backward; full recomputes every block's forward, both included."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from shardline.parallel.fsdp import SAVED_OPS

    attention = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default  # SDPA's CPU kernel

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: dict = defaultdict(int)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[func] += 1
            return func(*args, **(kwargs or {}))

    counts = {}
    for ac in ("none", policy):
        t = _trainer(ctx, session_dir, prepared, f"parallel.activation_checkpointing={ac}")
        t.train_step()  # warm: the first step builds plans and state
        with Count() as c:
            t.train_step()
        counts[ac] = c.ops
    assert counts["none"][attention] > 0 and counts["none"][torch.ops.aten.mm.default] > 0
    if policy == "selective":
        assert counts[policy][attention] == counts["none"][attention]
        assert counts[policy][torch.ops.aten.mm.default] == counts["none"][torch.ops.aten.mm.default]
    else:
        assert counts[policy][attention] == 2 * counts["none"][attention]
        assert counts[policy][torch.ops.aten.mm.default] > counts["none"][torch.ops.aten.mm.default]
    gpu_attention = {torch.ops.aten._scaled_dot_product_cudnn_attention.default,
                     torch.ops.aten._scaled_dot_product_flash_attention.default,
                     torch.ops.aten._scaled_dot_product_efficient_attention.default,
                     torch.ops.aten._flash_attention_forward.default}
    assert gpu_attention <= SAVED_OPS  # the same on CUDA, whichever kernel SDPA or the varlen path picks


def test_lora_settings_reach_peft(ctx, session_dir, prepared):
    t = _trainer(ctx, session_dir, prepared, "model.lora.enabled=true", "model.lora.r=2", "model.lora.alpha=8",
                 "model.lora.dropout=0.1", "model.lora.target_modules=[q_proj]")
    cfg = t.model.peft_config["default"]
    assert (cfg.r, cfg.lora_alpha, cfg.lora_dropout, set(cfg.target_modules)) == (2, 8, 0.1, {"q_proj"})
    trainable = [n for n, p in t.model.named_parameters() if p.requires_grad]
    assert trainable and all("q_proj.lora_" in n for n in trainable)


def test_unknown_lora_target_is_a_spec_error(ctx, session_dir, prepared):
    from shardline.errors import SpecError

    with pytest.raises(SpecError, match="model.lora.target_modules"):
        _trainer(ctx, session_dir, prepared, "model.lora.enabled=true", "model.lora.target_modules=[qkv]")


def test_tied_embeddings_share_one_matrix(ctx, session_dir, prepared):
    t = _trainer(ctx, session_dir, prepared, "model.arch.tie_embeddings=true")
    untied = _trainer(ctx, session_dir, prepared)
    base = t.model.model
    assert t.model.lm_head.weight is base.embed_tokens.weight and t.params.tied and not untied.params.tied
    assert t.params.total == untied.params.total - t.params.embedding
    assert t.flops_per_token == untied.flops_per_token  # the tied projection is still a matmul


def test_launch_settings_reach_torchrun():
    from shardline.engines.local import torchrun_command

    spec = small_spec(Path("/tmp"), "launch.max_restarts=3", "parallel.nproc_per_node=2",
                      "train.global_batch_size=8")
    cmd = torchrun_command(spec, Path("s.yaml"))
    assert "--max-restarts=3" in cmd and "--nproc-per-node=2" in cmd and cmd[-4:] == ["--spec", "s.yaml",
                                                                                          "--task", "train"]


def test_worker_refuses_a_spec_for_a_different_world_size(tmp_path):
    import subprocess
    import sys

    from shardline.spec.resolve import spec_to_yaml

    spec = small_spec(tmp_path, "parallel.nproc_per_node=2", "run.id=mismatch")
    path = tmp_path / "spec.yaml"
    path.write_text(spec_to_yaml(spec))
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["MASTER_PORT"] = str(free_port())
    out = subprocess.run([sys.executable, "-m", "shardline.worker", "--spec", str(path)], capture_output=True,
                         text=True, env=env, timeout=120)
    assert out.returncode == 2 and "world size 2" in out.stdout


def test_profile_steps_writes_a_trace_and_an_ops_table_with_the_step_phases(ctx, session_dir, prepared):
    t = _trainer(ctx, session_dir, prepared, "observe.profile_steps=2")
    for _ in range(5):
        t.train_step()
    out = t.run_dir / "profile"
    assert sorted(p.name for p in out.iterdir()) == ["ops-rank-0.txt", "trace-rank-0.json"]
    table = (out / "ops-rank-0.txt").read_text()
    assert table.startswith("steps 4-5, rank 0")
    assert all(f"shardline.{phase}" in table for phase in ("data", "forward", "backward", "optimizer", "sync"))
    assert "aten::mm" in table or "aten::addmm" in table


def test_a_bf16_lora_run_holds_its_frozen_base_in_bf16_and_trains_as_with_fp32_masters(ctx, session_dir, prepared,
                                                                                        monkeypatch):
    """The frozen base in bf16 (no fp32 master, no per-step cast) computes with the same bf16 values the fp32 masters
    were cast to each step: the first step's loss and the adapters' gradients are bitwise those of the old layout.
    Tied embeddings stay one parameter; the adapters keep fp32 masters."""
    lora = ("train.precision=bf16", "model.lora.enabled=true", "model.arch.tie_embeddings=true")
    new = _trainer(ctx, session_dir, prepared, *lora)
    frozen = {n: p.dtype for n, p in new.model.named_parameters() if not p.requires_grad}
    trained = {n: p.dtype for n, p in new.model.named_parameters() if p.requires_grad}
    assert frozen and set(frozen.values()) == {torch.bfloat16}, frozen
    assert trained and set(trained.values()) == {torch.float32}, trained
    base = new.model.get_base_model()
    assert base.lm_head.weight is base.model.embed_tokens.weight
    from shardline.parallel import fsdp

    monkeypatch.setattr(fsdp, "frozen_in_compute_dtype", lambda model, precision: None)  # the old layout
    old = _trainer(ctx, session_dir, prepared, *lora)
    assert {p.dtype for p in old.model.parameters()} == {torch.float32}
    grads = []
    for t in (new, old):
        batch = t.sampler.step_batches(t.rows, 0, 0)[0]
        loss = t.model(input_ids=batch.input_ids, position_ids=batch.position_ids, labels=batch.labels).loss
        loss.backward()
        grads.append({n: p.grad.full_tensor().clone() for n, p in t.model.named_parameters() if p.requires_grad})
        t.model.zero_grad(set_to_none=True)
        grads[-1]["loss"] = loss.detach().float()
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        assert torch.equal(grads[0][name], grads[1][name]), name
