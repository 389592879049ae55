"""Prepare once: source → tokenizer → prompt/answer ids → packed, memory-mapped token shards.

The result lives in a content-addressed directory `<cache_dir>/<version>/`, where `version` hashes the
source data, tokenizer, the task's prompt template, seq len, packing and split settings; it is the dataset version
recorded for a run. It is built in a temporary directory and renamed into place atomically, under a
file lock, so concurrent ranks (or nodes sharing a filesystem) prepare it once and never see a
half-written directory. `meta.json` lists every file with its size; a directory that does not match
its list (a file deleted or truncated, a copy from an older shardline, a directory written by hand) is
prepared again, with a warning, instead of failing later in the loader.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
from transformers import PreTrainedTokenizerBase

from shardline.data.example import Example
from shardline.data.packing import Document, PackedRows, pack
from shardline.data.render import check_chat_template, needs_chat_template, render
from shardline.data.sources import SPLITS, SourceData, load_source
from shardline.data.tokenizer import load_tokenizer, pad_id, tokenizer_fingerprint, train_bpe
from shardline.errors import DataError
from shardline.spec import JobSpec
from shardline.storage import check_locations
from shardline.tasks import get_task

PREPARE_VERSION = "1"
PACKED_SPLITS = ("train", "validation")
ARRAYS = ("tokens", "loss_mask", "position_ids", "n_real")
Progress = Callable[[str, int], None]
LOCATIONS = ("data.path", "data.cache_dir", "model.path", "model.tokenizer")
"""Spec locations preparation reads or writes: local paths (or mounts), never URLs."""
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreparedData:
    root: Path

    @property
    def version(self) -> str:
        return self.root.name

    @cached_property
    def meta(self) -> dict:
        return json.loads(self.file("meta.json").read_text())

    @cached_property
    def stats(self) -> dict:
        return json.loads(self.file("stats.json").read_text())

    def file(self, name: str) -> Path:
        """`root/name`; a DataError naming the directory when it is gone (deleted while a run reads it)."""
        path = self.root / name
        if not path.exists():
            raise DataError(str(self.root), f"the prepared data has no {name} (deleted while in use?)",
                            "run `shardline prepare` with the run's spec, or resume the run "
                            "(`shardline train RUN_DIR`), which prepares it again")
        return path

    def tokenizer(self) -> PreTrainedTokenizerBase:
        return load_tokenizer(str(self.file("tokenizer")))

    def rows(self, split: str) -> PackedRows:
        """Memory-mapped packed rows of `train` or `validation`."""
        arrays = {a: np.load(self.file(f"{split}.{a}.npy"), mmap_mode="r") for a in ARRAYS}
        return PackedRows(**arrays)

    def examples(self, split: str) -> list[Example]:
        with self.file(f"{split}.jsonl").open() as f:
            return [Example(**json.loads(line)) for line in f]


def default_cache_dir(spec: JobSpec) -> Path:
    return Path(spec.data.cache_dir or Path(spec.run.dir) / "prepared").expanduser()


def prepare(spec: JobSpec, progress: Progress | None = None) -> PreparedData:
    """Return the prepared data for `spec`, building it first if no complete copy exists."""
    check_locations(spec, LOCATIONS)
    cache = default_cache_dir(spec)
    cache.mkdir(parents=True, exist_ok=True)
    source = load_source(spec.data)
    version = dataset_version(spec, source)
    final = cache / version
    if incomplete(final, version) is None:
        return PreparedData(final)
    with _locked(cache / f".{version}.lock"):
        problem = incomplete(final, version)
        if problem is None:  # another process finished it while we waited
            return PreparedData(final)
        for leftover in cache.glob(f".*-{version}-*"):  # of a killed prepare: only the lock holder writes them
            shutil.rmtree(leftover, ignore_errors=True)
        if final.exists():
            log.warning("prepared data %s %s: preparing it again", final, problem)
        tmp = cache / f".tmp-{version}-{os.getpid()}"
        try:
            _build(spec, source, tmp, version, progress)
            _replace(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return PreparedData(final)


def incomplete(root: Path, version: str) -> str | None:
    """Why `root` is not a complete prepared directory of `version` (None when it is): the files listed in
    its meta.json must all be there with their sizes, and stats.json, written last, must exist."""
    if not root.exists():
        return "does not exist"
    try:
        meta = json.loads((root / "meta.json").read_text())
    except (OSError, ValueError):
        return "has no readable meta.json"
    if meta.get("version") != version or not isinstance(meta.get("files"), dict):
        return f"has a meta.json of another version or format ({meta.get('version')!r})"
    for name, size in meta["files"].items():
        path = root / name
        if not path.is_file():
            return f"is missing {name}"
        if path.stat().st_size != size:
            return f"has {name} of {path.stat().st_size} bytes, not {size}"
    if not (root / "stats.json").is_file():
        return "has no stats.json (its preparation was interrupted)"
    return None


def _replace(tmp: Path, final: Path) -> None:
    """Rename `tmp` to `final`, moving an incomplete `final` aside first (a rename cannot replace a directory)."""
    stale = final.parent / f".stale-{final.name}-{os.getpid()}"
    if final.exists():
        os.rename(final, stale)
    try:
        os.rename(tmp, final)
    finally:
        shutil.rmtree(stale, ignore_errors=True)


def dataset_version(spec: JobSpec, source: SourceData) -> str:
    d, m = spec.data, spec.model
    tokenizer_src = m.tokenizer or m.path
    tokenizer_id = tokenizer_fingerprint(tokenizer_src) if tokenizer_src else f"bpe:{m.arch.vocab_size}"
    prompt_version = get_task(d.task).prompt.version
    parts = [PREPARE_VERSION, source.fingerprint, tokenizer_id, prompt_version, d.prompt_format,
             str(spec.train.seq_len), str(d.packing)]
    if d.assistant_turns != "all":  # (kept out of the default's parts: the embedded default's version stays)
        parts.append(f"assistant_turns={d.assistant_turns}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


@contextmanager
def _locked(path: Path):
    with path.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _tokenizer_for(spec: JobSpec, source: SourceData) -> PreTrainedTokenizerBase:
    src = spec.model.tokenizer or spec.model.path
    if src:
        tok = load_tokenizer(src)
    else:
        tok = train_bpe((t for ex in source.splits["train"] for t in _texts(ex)), spec.model.arch.vocab_size)
    first = next((ex for split in SPLITS for ex in source.splits[split]), None)
    if first is not None and needs_chat_template(first, spec.data.prompt_format):
        check_chat_template(tok, spec.model.tokenizer and "model.tokenizer" or "model.path",
                            "data.prompt_format=chat" if first.kind == "prompt_answer" else "a conversation")
    return tok


def _texts(ex: Example) -> list[str]:
    """What a tokenizer trained on the data learns from."""
    if ex.kind == "chat":
        return [m["content"] for m in ex.messages]
    if ex.kind == "text":
        return [ex.text or ""]
    return [ex.context, ex.question, ex.answer] + ([ex.prompt] if ex.prompt else [])


def _encode(tok: PreTrainedTokenizerBase, examples: list[Example], spec: JobSpec,
            dropped: Counter, progress: Progress | None, split: str) -> list[Document]:
    docs = []
    seq_len = spec.train.seq_len
    template = get_task(spec.data.task).prompt
    batch = 512
    for start in range(0, len(examples), batch):
        chunk = examples[start : start + batch]
        for ex in chunk:
            r = render(tok, ex, template, spec.data.prompt_format, spec.data.assistant_turns)
            if ex.kind == "text":  # a long document is cut into pieces, each starting afresh; none is dropped
                for at in range(0, len(r.ids), seq_len):
                    loss = np.asarray(r.loss[at : at + seq_len], dtype=np.uint8)
                    loss[0] = 0
                    docs.append(Document(ids=np.asarray(r.ids[at : at + seq_len], dtype=np.int32), loss=loss))
                continue
            if len(r.ids) > seq_len:
                dropped[f"{split}:too_long"] += 1
                continue
            docs.append(Document(ids=np.asarray(r.ids, dtype=np.int32), loss=np.asarray(r.loss, dtype=np.uint8)))
        if progress:
            progress(split, len(chunk))
    return docs


def _build(spec: JobSpec, source: SourceData, out: Path, version: str, progress: Progress | None) -> None:
    out.mkdir(parents=True)
    tok = _tokenizer_for(spec, source)
    tok.save_pretrained(out / "tokenizer")
    pad = pad_id(tok)
    dropped = Counter(source.dropped)
    stats: dict = {"rows_read": source.rows_read, "format": source.format, "splits": {}}
    for split in SPLITS:
        examples = source.splits[split]
        docs = _encode(tok, examples, spec, dropped, progress, split)
        split_stats = {"examples": len(examples), "kept": len(docs)}
        if split in PACKED_SPLITS:
            if not docs:
                raise DataError(
                    spec.data.path or "generated data", f"no {split} example fits train.seq_len="
                    f"{spec.train.seq_len}", "raise train.seq_len",
                )
            rows = pack(docs, spec.train.seq_len, pad, spec.data.packing)
            for name in ARRAYS:
                np.save(out / f"{split}.{name}.npy", getattr(rows, name))
            real = int(rows.n_real.sum())
            split_stats |= {"rows": len(rows.n_real), "tokens": real, "loss_tokens": int(rows.loss_mask.sum()),
                            "pad_tokens": rows.pad_tokens, "fill": round(real / rows.tokens.size, 4)}
        with (out / f"{split}.jsonl").open("w") as f:
            for ex in examples:
                f.write(json.dumps(ex.to_dict()) + "\n")
        stats["splits"][split] = split_stats
    stats["dropped"] = dict(sorted(dropped.items()))
    files = {str(p.relative_to(out)): p.stat().st_size for p in sorted(out.rglob("*")) if p.is_file()}
    meta = {"version": version, "seq_len": spec.train.seq_len, "pad_id": pad, "eos_id": tok.eos_token_id,
            "vocab_size": len(tok), "prompt_format": spec.data.prompt_format, "packing": spec.data.packing,
            "files": files}
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
    # stats.json is written last: its presence marks a complete directory.
    (out / "stats.json").write_text(json.dumps(stats, indent=2))
