"""Materialise a meta-device model in place, each rank allocating and filling only the parameter slices it owns.

Call it after `parallelize` (FSDP2 turns every parameter into a DTensor sharded on dim 0 over a 1-D or
replicate × shard mesh) or on a plain model (one process, whole tensors): the same code fills both.

Checkpoints: every rank reads its own slices of the safetensors files itself (`get_slice(key)[rows]` reads
only the bytes of the rows it owns) rather than one rank per node reading everything and scattering it. On a
shared mount or the node's page cache the ranks' reads add up to one pass over the files, run in parallel and
need no collective, and no rank ever holds more than its own shards: no full tensor to broadcast or scatter,
no second host copy. Rows are read in pieces of `READ_CHUNK_BYTES`, the file memory-mapped only while a piece
is read: mapped pages count in a process's RSS, and safetensors' `pread` backend reads a whole tensor to slice
it. Measured (bench/RESULTS-memory.md): 2 ranks loading a 1.1B bf16 checkpoint peak at 2.60 GB RSS each —
0.36 GB of interpreter and libraries, their fp32 half of the weights and 0.03 GB more — versus 7.02 GB with
`from_pretrained` in every rank. With HSDP each replica reads the files once. Hub names are downloaded by
every rank into the HF cache (its file locks make that safe); staging a checkpoint on node-local disk
(`model.local_cache`) is not done here.

A mixture of experts' fused expert weights (`mlp.experts.gate_up_proj [E, 2I, H]`) are read from the per-expert
tensors hub checkpoints store (`shardline.model.expert_layout`): a rank whose shard holds experts a..b reads only
those experts' tensors.

Random init (no `model.path`, or `model.random_init`; LoRA adapters always) is HF's / peft's scheme, made
deterministic per parameter and independent of the world size: each tensor is cut into fixed blocks of rows
(`INIT_BLOCK_ELEMENTS` elements), block b of parameter `name` is drawn on the CPU from a generator seeded by
(init_seed, name, b), and a rank draws only the blocks that overlap its rows. Names are Hugging Face keys
(peft's prefix and `.base_layer` removed), so a LoRA model's base equals the plain model's, on any device.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import threading
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from shardline.errors import SpecError
from shardline.model.expert_layout import StackedExperts, model_keys
from shardline.model.families import is_multimodal_checkpoint, language_model_key
from shardline.model.moe import EXPERT_WEIGHTS, is_moe
from shardline.model.nf4 import is_nf4, to_nf4
from shardline.spec import ModelSpec

INIT_BLOCK_ELEMENTS = 1 << 22
"""Random init is drawn in blocks of whole rows of about this many elements (16 MiB of fp32)."""

READ_CHUNK_BYTES = 16 << 20
"""Checkpoint rows are read in pieces of at most this many bytes of fp32 (one piece in memory at a time)."""

STALE_KEY_SUFFIX = "rotary_emb.inv_freq"
"""Older Llama checkpoints saved this non-persistent buffer; it is recomputed, so such keys are ignored (as HF does)."""

Init = float | Callable[[torch.Tensor, torch.Generator], torch.Tensor]
"""A constant, or a sampler filling a tensor in place from a generator."""


@dataclass(frozen=True)
class _Param:
    names: list[str]
    """HF names of every occurrence (more than one for tied weights); the first is the canonical one."""
    module: nn.Module
    param: nn.Parameter

    @property
    def name(self) -> str:
        return self.names[0]


def hf_name(name: str) -> str:
    """The Hugging Face checkpoint key of a module parameter name (peft's prefix and `.base_layer` removed)."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def materialize(model: nn.Module, spec: ModelSpec, device: torch.device) -> None:
    """Allocate `model`'s parameters (DTensors: only the local shard) and buffers on `device` and fill them.

    Base weights come from `spec.path`'s safetensors (only this rank's slices are read; missing, unexpected or
    misshapen keys raise a SpecError naming them) or from the random init of `spec.init_seed`; LoRA adapters get
    peft's init (lora_A kaiming-uniform, lora_B zeros), deterministically; tied weights stay tied; rotary
    buffers are recomputed. A meta NF4 weight (`shardline.model.nf4`: a QLoRA base, never sharded) is filled whole
    in its dtype and quantized on `device`, one weight at a time.
    """
    ties = _tie_groups(model)
    quantized = _detach_nf4(model)  # to_empty would allocate each as an empty NF4: filled whole below instead
    model.to_empty(device=device)
    for (first, first_name), *others in ties:  # a plain model's to_empty unties them
        for module, name in others:
            module._parameters[name] = first._parameters[first_name]
    params = _params(model)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    std = base.config.initializer_range
    with torch.no_grad():
        if spec.path is None or spec.random_init:
            random = params
        else:
            random = [p for p in params if _is_lora(p.name)]
            _load_checkpoint([p for p in params if not _is_lora(p.name)], spec.path, quantized, device, base)
        _fill_all_random(random, spec.init_seed, std)
        if spec.path is None or spec.random_init:
            for p, attr in quantized:
                dense = replace(p, param=torch.empty(p.param.shape, dtype=p.param.dtype, device=device))
                _fill_all_random([dense], spec.init_seed, std)
                _set_nf4(p, attr, dense.param)
        _init_buffers(model)


def _fill_all_random(params: list[_Param], seed: int, std: float) -> None:
    """Fill every parameter's slice with its blocks of the deterministic init, the blocks spread over as many threads
    as torch's intra-op budget (1 per rank under torchrun with several processes; the cores of a single-process
    run). Each block has its own generator, so the values are the same on any number of threads; the draws release
    the GIL (an 8B model is ~8·10⁹ of them, ~30 s on one core)."""
    jobs = [job for p in params for job in _fill_random(p, seed, std)]
    threads = min(torch.get_num_threads(), len(jobs))
    scratch = threading.local()

    def run(job: Callable[[Scratch], None]) -> None:
        with torch.no_grad():  # grad mode is per thread
            job(scratch)

    if threads <= 1:
        for job in jobs:
            run(job)
        return
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(run, jobs))  # raises what a job raised


def _detach_nf4(model: nn.Module) -> list[tuple[_Param, str]]:
    """Take the meta NF4 weights out of their modules: (the parameter with its HF name, its attribute)."""
    found = []
    for module_name, module in model.named_modules():
        for attr, param in list(module._parameters.items()):
            if is_nf4(param):
                found.append((_Param([hf_name(f"{module_name}.{attr}")], module, param), attr))
                module._parameters[attr] = None
    return found


def _set_nf4(p: _Param, attr: str, dense: torch.Tensor) -> None:
    """Quantize the whole weight `dense` and put it back into its module as a frozen NF4 parameter."""
    p.module._parameters[attr] = nn.Parameter(to_nf4(dense), requires_grad=False)


def _is_lora(name: str) -> bool:
    return ".lora_" in name


def _tie_groups(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """(module, attribute) of every occurrence of each parameter that more than one module holds."""
    holders: dict[int, list[tuple[nn.Module, str]]] = defaultdict(list)
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                holders[id(param)].append((module, name))
    return [group for group in holders.values() if len(group) > 1]


def _params(model: nn.Module) -> list[_Param]:
    """Each distinct parameter once, with its owning module (the first holder) and all its HF names."""
    found: dict[int, _Param] = {}
    for module_name, module in model.named_modules():
        for name, param in module._parameters.items():
            if param is None:
                continue
            full = hf_name(f"{module_name}.{name}" if module_name else name)
            if id(param) in found:
                found[id(param)].names.append(full)
            else:
                found[id(param)] = _Param([full], module, param)
    return list(found.values())


def _local(param: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """The tensor this rank holds for `param`, and which slice of the full tensor it is."""
    if isinstance(param, DTensor):
        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        local = param.to_local()
        assert tuple(local.shape) == tuple(shape), (local.shape, shape)
        return local, tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
    return param, tuple(slice(0, s) for s in param.shape)


# ---- random init --------------------------------------------------------------------------------------------
def _init_of(p: _Param, std: float) -> Init:
    """How HF (`_init_weights`) and peft initialise this parameter."""
    parts = p.name.split(".")
    if "lora_A" in parts:
        return _lora_a_init
    if "lora_B" in parts or parts[-1] == "bias":
        return 0.0
    # a mixture's fused experts (`[E, out, in]` each) and its routers' weights: normal, as transformers' families do
    fused_experts = parts[-1] in EXPERT_WEIGHTS and parts[-2] == "experts"
    if isinstance(p.module, nn.Linear | nn.Embedding) or fused_experts or type(p.module).__name__.endswith("Router"):
        return lambda t, g: t.normal_(0.0, std, generator=g)
    if "Norm" in type(p.module).__name__:
        return 1.0
    raise ValueError(f"no initialisation rule for {p.name} ({type(p.module).__name__})")


def _lora_a_init(t: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """peft's lora_A init, kaiming-uniform over the input features: of each expert's `[r, in]` too (a fused experts'
    adapter `[E, r, in]`, `shardline.model.expert_lora`; peft's own `(r·E, in)` gets the same bound)."""
    nn.init.kaiming_uniform_(t.view(-1, t.shape[-1]), a=math.sqrt(5), generator=g)
    return t


def _block_seed(seed: int, name: str, block: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}/{block}".encode()).digest()[:8], "little")


Scratch = threading.local
"""A thread's reusable fp32 buffer for drawing blocks (`.values`), so a block costs no fresh allocation."""


def _scratch(scratch: Scratch, n: int) -> torch.Tensor:
    if getattr(scratch, "values", None) is None or scratch.values.numel() < n:
        scratch.values = torch.empty(max(n, INIT_BLOCK_ELEMENTS))
    return scratch.values[:n]


def _fill_random(p: _Param, seed: int, std: float) -> list[Callable[[Scratch], None]]:
    """The work that fills this rank's slice of `p` with the blocks of the deterministic init that overlap it: one
    job per block (any order, any thread), or one fill for a constant."""
    dst, region = _local(p.param)
    init = _init_of(p, std)
    if dst.numel() == 0:
        return []
    if isinstance(init, float):
        return [lambda _: dst.fill_(init)]
    shape, rows, rest = tuple(p.param.shape), region[0], region[1:]
    row = math.prod(shape[1:])
    per_block = max(1, INIT_BLOCK_ELEMENTS // row)
    pad = getattr(p.module, "padding_idx", None) if isinstance(p.module, nn.Embedding) else None

    def block_job(block: int) -> Callable[[Scratch], None]:
        lo, hi = block * per_block, min((block + 1) * per_block, shape[0])

        def job(scratch: Scratch) -> None:
            generator = torch.Generator().manual_seed(_block_seed(seed, p.name, block))
            values = init(_scratch(scratch, (hi - lo) * row).view(hi - lo, *shape[1:]), generator)
            a, b = max(lo, rows.start), min(hi, rows.stop)
            dst[a - rows.start : b - rows.start].copy_(values[(slice(a - lo, b - lo), *rest)])
            if pad is not None and a <= pad < b:
                dst[pad - rows.start].zero_()  # HF zeroes the padding embedding

        return job

    return [block_job(block) for block in range(rows.start // per_block, -(-rows.stop // per_block))]


# ---- checkpoints --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Stored:
    file: Path
    key: str
    """The tensor's name in the file (a multimodal checkpoint's `model.language_model.…`)."""


@dataclass(frozen=True)
class _Experts:
    """A fused expert parameter stored per expert: `parts[j][e]` is projection j of expert e, the parts
    concatenated on their dim 0 (gate, then up), the experts stacked."""

    parts: tuple[tuple[_Stored, ...], ...]

    @property
    def file(self) -> Path:
        return self.parts[0][0].file


Source = _Stored | _Experts


def _checkpoint_files(path: str, model: nn.Module | None = None) -> dict[str, Source]:
    """Model parameter name → where its tensor is stored; a multimodal checkpoint's language model only; a mixture of
    experts' fused weights by transformers' conversion mapping of `model` (`shardline.model.expert_layout`)."""
    stored = _stored_keys(path)
    if model is not None and is_moe(model.config):
        return {name: _Experts(tuple(tuple(_Stored(stored[k], k) for k in part) for part in where.parts))
                if isinstance(where, StackedExperts) else _Stored(stored[where], where)
                for name, where in model_keys(model, stored).items()}
    if not is_multimodal_checkpoint(stored):
        return {key: _Stored(file, key) for key, file in stored.items()}
    return {name: _Stored(file, key) for key, file in stored.items() if (name := language_model_key(key))}


def _stored_keys(path: str) -> dict[str, Path]:
    """Checkpoint key → safetensors file, from `model.safetensors.index.json` or a single `model.safetensors`."""
    root = Path(path)
    if not root.is_dir():
        from huggingface_hub import snapshot_download

        root = Path(snapshot_download(path, allow_patterns=["*.safetensors", "*.safetensors.index.json"]))
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {file: _inside(root, file, index) for file in set(weight_map.values())}
        return {key: files[file] for key, file in weight_map.items()}
    single = root / "model.safetensors"
    if single.is_file():
        single = _inside(root, single.name, single)
        with safe_open(single, "pt") as f:
            return dict.fromkeys(f.keys(), single)
    raise SpecError("model.path", f"{path} has neither model.safetensors nor model.safetensors.index.json",
                    "save the checkpoint with save_pretrained(..., safe_serialization=True)")


def _inside(root: Path, entry: object, named_in: Path) -> Path:
    """`root/entry`, a weights file named by `named_in` (the index, or the file itself), refused with a SpecError
    naming both unless it stays inside the model directory: a relative path without `..` that still lies inside
    `root` once every link is resolved. A model directory comes from outside; an entry that leaves it would read
    someone else's file. Hugging Face's cache is the one layout whose links leave the folder: the files of
    `<repo>/snapshots/<revision>/` link to `<repo>/blobs/`, which counts as inside."""
    real_root = root.resolve()
    allowed = [real_root]
    if real_root.parent.name == "snapshots":
        allowed.append(real_root.parent.parent / "blobs")
    target = (root / str(entry)).resolve() if isinstance(entry, str) and entry else None
    if target is None or Path(entry).is_absolute() or ".." in Path(entry).parts or \
            not any(target.is_relative_to(a) for a in allowed):
        raise SpecError(str(named_in), f"the weights file {entry!r} lies outside the model directory {real_root}"
                        + (f" (it resolves to {target})" if target is not None else ""),
                        "use a model directory whose weights files lie inside it (names relative to the directory, "
                        "as save_pretrained writes them; no absolute paths, `..` or links out); copy the files in "
                        "if they are yours")
    return root / entry


def _load_checkpoint(params: list[_Param], path: str, quantized: list[tuple[_Param, str]] = (),
                     device: torch.device | None = None, model: nn.Module | None = None) -> None:
    """Copy each parameter's local slice from the checkpoint, reading only those bytes; each of `quantized` (meta NF4
    weights and their attributes) is read whole into `device` in its dtype and quantized there. `model` (the causal
    LM) names how a mixture of experts' checkpoint stores its experts."""
    files = _checkpoint_files(path, model)
    whole = {id(p): attr for p, attr in quantized}
    source: dict[str, _Param] = {}
    missing = []
    for p in [*params, *(p for p, _ in quantized)]:
        key = next((n for n in p.names if n in files), None)
        if key is None:
            missing.append(p.name)
        else:
            source[key] = p
    known = {n for p in params for n in p.names} | {p.name for p, _ in quantized}  # a tied weight: either name
    unexpected = sorted(k for k in files if k not in known and not k.endswith(STALE_KEY_SUFFIX))
    if missing or unexpected:
        raise SpecError("model.path", f"{path} does not fit the model built from its config.json: "
                        f"missing keys {_few(missing)}, unexpected keys {_few(unexpected)}",
                        "use a complete Hugging Face checkpoint of this architecture (keys as save_pretrained "
                        "writes them)")
    _check_shapes(source, files)
    for key, p in source.items():
        if id(p) in whole:
            dense = torch.empty(p.param.shape, dtype=p.param.dtype, device=device)
            _copy_rows(dense, tuple(slice(0, n) for n in dense.shape), files[key])
            _set_nf4(p, whole[id(p)], dense)
        else:
            _copy_rows(*_local(p.param), files[key])


def _copy_rows(dst: torch.Tensor, region: tuple[slice, ...], stored: Source) -> None:
    """Fill `dst`, the `region` of a stored tensor, in pieces of at most `READ_CHUNK_BYTES` read at a time."""
    rows, rest = region[0], region[1:]
    step = max(1, READ_CHUNK_BYTES // (math.prod(dst.shape[1:]) * dst.element_size()))
    for a in range(rows.start, rows.stop, step):
        b = min(a + step, rows.stop)
        dst[a - rows.start : b - rows.start].copy_(_read(stored, (slice(a, b), *rest)))


def _check_shapes(source: dict[str, _Param], stored: dict[str, Source]) -> None:
    """Every checkpoint tensor has its parameter's shape (reads only the files' headers); per-expert tensors stack
    to the fused parameter's shape."""
    with contextlib.ExitStack() as stack:
        opened: dict[Path, Any] = {}

        def shape_of(s: _Stored) -> tuple[int, ...]:
            if s.file not in opened:
                opened[s.file] = stack.enter_context(safe_open(s.file, "pt"))
            return tuple(opened[s.file].get_slice(s.key).get_shape())

        for key in sorted(source, key=lambda k: str(stored[k].file)):
            where = stored[key]
            shape = _experts_shape(where, shape_of) if isinstance(where, _Experts) else shape_of(where)
            expected = tuple(source[key].param.shape)
            if shape != expected:
                raise SpecError("model.path", f"{where.file.name}: {key} has shape {shape}, the model expects "
                                f"{expected}", "check that config.json belongs to these weights")


def _experts_shape(experts: _Experts, shape_of: Callable[[_Stored], tuple[int, ...]]) -> tuple[int, ...] | str:
    """The stacked shape [E, Σ part rows, …] of per-expert tensors, or a description of their mismatch."""
    parts = [[shape_of(s) for s in part] for part in experts.parts]
    if any(len(set(shapes)) != 1 for shapes in parts) or len({s[0][1:] for s in parts}) != 1:
        return f"per-expert tensors of differing shapes {sorted({s for p in parts for s in p})}"
    return (len(parts[0]), sum(p[0][0] for p in parts), *parts[0][0][1:])


def _read(stored: Source, region: tuple[slice, ...]) -> torch.Tensor:
    """`region` of a stored tensor; the file is mapped only meanwhile (mapped pages count in the RSS). Of stacked
    experts: only the experts and rows of the region, each expert's parts read and concatenated."""
    if isinstance(stored, _Experts):
        return torch.stack([_read_expert([part[e] for part in stored.parts], region[1:])
                            for e in range(region[0].start, region[0].stop)])
    with safe_open(stored.file, "pt") as f:
        return f.get_slice(stored.key)[region]


def _read_expert(parts: list[_Stored], region: tuple[slice, ...]) -> torch.Tensor:
    """`region` of one expert's parts concatenated on dim 0, reading only the rows it covers."""
    rows, rest, pieces, offset = region[0], region[1:], [], 0
    for stored in parts:
        with safe_open(stored.file, "pt") as f:
            tensor = f.get_slice(stored.key)
            n = tensor.get_shape()[0]
            a, b = max(rows.start, offset), min(rows.stop, offset + n)
            if a < b:
                pieces.append(tensor[(slice(a - offset, b - offset), *rest)])
        offset += n
    return torch.cat(pieces)


def _few(names: list[str], n: int = 8) -> str:
    return f"{names[:n]}" + (f" and {len(names) - n} more" if len(names) > n else "")


# ---- buffers ------------------------------------------------------------------------------------------------
def _init_buffers(model: nn.Module) -> None:
    """Recompute the buffers meta init left empty (they are not in checkpoints): a scalar buffer from the Python
    twin transformers keeps beside it (Gemma 3's `embed_scale` / `scalar_embed_scale`); the others, rotary
    `inv_freq` of any family and layer type included, from the module's own __init__ run again on the CPU with
    its config (transformers' convention for the modules that own such buffers)."""
    for name, module in model.named_modules():
        buffers = dict(module.named_buffers(recurse=False))
        for key in [k for k in buffers if isinstance(getattr(module, f"scalar_{k}", None), int | float)]:
            buffers.pop(key).fill_(getattr(module, f"scalar_{key}"))
        if not buffers:
            continue
        fresh = _rebuilt_buffers(module)
        if fresh is None or set(buffers) - set(fresh):
            raise ValueError(f"{name}: no initialisation after meta init for buffers {sorted(buffers)}")
        for key, buffer in buffers.items():
            buffer.copy_(fresh[key])


def _rebuilt_buffers(module: nn.Module) -> dict[str, torch.Tensor] | None:
    """The buffers of a fresh CPU instance of `module`'s class built from its `config`, or None."""
    config = getattr(module, "config", None)
    if config is None:
        return None
    try:
        with torch.device("cpu"):
            fresh = type(module)(config=config)
    except TypeError:
        return None
    return dict(fresh.named_buffers(recurse=False))
