"""Prepare once: source → tokenizer → prompt/answer ids → packed, memory-mapped token shards.

The result lives in a content-addressed directory `<cache_dir>/<version>/`, where `version` hashes the
source data, tokenizer, the task's prompt template, seq len, packing and split settings; it is the dataset version
recorded for a run. It is built in a temporary directory and renamed into place atomically, under a
file lock, so concurrent ranks (or nodes sharing a filesystem) prepare it once and never see a
half-written directory. `meta.json` lists every file with its size and checksum; a directory that does not
match its list (a file deleted, truncated or changed, a copy from an older shardline, a directory written by hand
or by someone else sharing the cache) is prepared again, with a warning, instead of being trusted. The files are
checked by the sha256 of their content, smallest first, up to `VERIFY_WHOLE_BYTES` in all; the rest (a large
dataset's biggest arrays) by their size and the sha256 of `SAMPLE_BLOCKS` blocks spread over each (`checksum`), so
opening a prepared directory costs at most about what hashing `VERIFY_WHOLE_BYTES` costs.
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
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from shardline.data import PREPARED_DATA_ENV
from shardline.data.assemble import ARRAYS, PACKED_SPLITS, write_split
from shardline.data.encode import EncodeSettings, chunk_path, encode_source, examples_in_order
from shardline.data.formats import READ_VERSION
from shardline.data.named_templates import use_named_template
from shardline.data.packing import PackedRows
from shardline.data.render import check_chat_template
from shardline.data.sources import SPLITS, Source, open_sources
from shardline.data.splits import Assignment, assign, draw_mixture
from shardline.data.synthetic import RANDOM_TOKENS, write_random_rows
from shardline.data.synthetic import fingerprint as random_rows_fingerprint
from shardline.data.template import resolved_format
from shardline.data.tokenizer import load_tokenizer, pad_id, tokenizer_fingerprint, train_bpe
from shardline.data.too_long import say_too_long
from shardline.errors import DataError
from shardline.example import Example, needs_chat_template
from shardline.spec import JobSpec
from shardline.storage import check_locations, require_local
from shardline.tasks import get_task

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

PREPARE_VERSION = "1"
Progress = Callable[[str, int, int | None, int], None]
"""(stage, examples done since the last call, the stage's total or None, tokens done since the last call)."""
VERIFY_WHOLE_BYTES = 256 << 20
"""Each time a prepared directory is opened, its files are verified by the sha256 of their whole content, smallest
first, up to this many bytes in all (~0.3 s at the ~850 MiB/s one core hashes); the larger rest by sampled blocks."""
SAMPLE_BLOCKS, SAMPLE_BLOCK_BYTES = 64, 64 << 10
"""A larger file's checksum covers this many blocks of this size, evenly spaced from its first to its last byte."""
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

    def row_sources(self, split: str) -> np.ndarray:
        """Each packed row's source (an index into meta["sources"]); validation rows never mix sources."""
        return np.load(self.file(f"{split}.source.npy"))

    def examples(self, split: str) -> list[Example]:
        with self.file(f"{split}.jsonl").open() as f:
            return [Example(**json.loads(line)) for line in f]


def default_cache_dir(spec: JobSpec) -> Path:
    return Path(spec.data.cache_dir or Path(spec.run.dir) / "prepared").expanduser()


def prepare(spec: JobSpec, progress: Progress | None = None) -> PreparedData:
    """Return the prepared data for `spec`, building it first if no complete copy exists."""
    check_locations(spec, LOCATIONS)
    for i, entry in enumerate(spec.data.sources):
        require_local(entry.path, f"data.sources[{i}].path")
    cache = default_cache_dir(spec)
    cache.mkdir(parents=True, exist_ok=True)
    sources = open_sources(spec.data)
    version = dataset_version(spec, sources)
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
        work = cache / f".partial-{version}"  # kept when interrupted: its complete chunks are not tokenized again
        try:
            if sources:
                _build(spec, sources, work, tmp, version, progress)
            else:
                _build_random(spec, tmp, version)
            _replace(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return PreparedData(final)


def prepared_by_launcher() -> PreparedData | None:
    """The directory the local launcher prepared for this run's spec before starting the workers
    (`PREPARED_DATA_ENV`), while it is still complete; None elsewhere (cluster pods, a deleted or damaged copy:
    the worker prepares as usual)."""
    handed = os.environ.get(PREPARED_DATA_ENV)
    if not handed or incomplete(Path(handed), Path(handed).name) is not None:
        return None
    return PreparedData(Path(handed))


def incomplete(root: Path, version: str) -> str | None:
    """Why `root` is not a complete prepared directory of `version` (None when it is): the files listed in
    its meta.json (stats.json among them) must all be there with their sizes and checksums (`checksum`), and
    nothing else but meta.json: no unlisted file, no link."""
    if not root.exists():
        return "does not exist"
    try:
        meta = json.loads((root / "meta.json").read_text())
    except (OSError, ValueError):
        return "has no readable meta.json"
    if meta.get("version") != version or not isinstance(meta.get("files"), dict):
        return f"has a meta.json of another version or format ({meta.get('version')!r})"
    sums = meta.get("sha256")
    if not isinstance(sums, dict) or set(sums) != set(meta["files"]):
        return "has no checksum of every file in its meta.json (an older shardline's, or rewritten)"
    if "stats.json" not in meta["files"]:
        return "has no stats.json in its meta.json (an older shardline's, or its preparation was interrupted)"
    for path in sorted(root.rglob("*")):  # what a reader could pick up besides the listed files (a tokenizer's
        name = str(path.relative_to(root))  # chat_template.jinja, say) or reach through a link
        if path.is_symlink():
            return f"has a link {name} (a prepared directory holds only files)"
        if path.is_file() and name not in meta["files"] and name != "meta.json":
            return f"has {name}, which its meta.json does not list"
    whole = hashed_whole(meta["files"])
    for name, size in meta["files"].items():
        path = root / name
        if not path.is_file():
            return f"is missing {name}"
        if path.stat().st_size != size:
            return f"has {name} of {path.stat().st_size} bytes, not {size}"
        if checksum(path, name in whole) != sums[name]:
            return f"has {name} whose content differs from its checksum in meta.json"
    return None


def hashed_whole(sizes: dict[str, int]) -> set[str]:
    """The files whose whole content is hashed: the smallest first, while they add up to `VERIFY_WHOLE_BYTES`."""
    whole, total = set(), 0
    for name, size in sorted(sizes.items(), key=lambda kv: (kv[1], kv[0])):
        total += size
        if total > VERIFY_WHOLE_BYTES:
            break
        whole.add(name)
    return whole


def checksum(path: Path, whole: bool) -> str:
    """sha256 of the file's content, or (not `whole`) `sampled:` and the sha256 of its size and `SAMPLE_BLOCKS`
    blocks of `SAMPLE_BLOCK_BYTES` spread evenly from its start to its end."""
    size = path.stat().st_size
    with path.open("rb") as f:
        if whole or size <= SAMPLE_BLOCKS * SAMPLE_BLOCK_BYTES:
            return hashlib.file_digest(f, "sha256").hexdigest()
        digest = hashlib.sha256(str(size).encode())
        for i in range(SAMPLE_BLOCKS):
            f.seek((size - SAMPLE_BLOCK_BYTES) * i // (SAMPLE_BLOCKS - 1))
            digest.update(f.read(SAMPLE_BLOCK_BYTES))
    return f"sampled:{digest.hexdigest()}"


def _replace(tmp: Path, final: Path) -> None:
    """Rename `tmp` to `final`, moving an incomplete `final` aside first (a rename cannot replace a directory)."""
    stale = final.parent / f".stale-{final.name}-{os.getpid()}"
    if final.exists():
        os.rename(final, stale)
    try:
        os.rename(tmp, final)
    finally:
        shutil.rmtree(stale, ignore_errors=True)


def dataset_version(spec: JobSpec, sources: list[Source]) -> str:
    d, m = spec.data, spec.model
    tokenizer_src = m.tokenizer or m.path
    tokenizer_id = tokenizer_fingerprint(tokenizer_src) if tokenizer_src else f"bpe:{m.arch.vocab_size}"
    prompt_version = get_task(d.task).prompt.version
    content = _content_fingerprint(d, sources) if sources else random_rows_fingerprint(spec)
    # `auto` with shardline's trained BPE (no chat template) is `plain`: the embedded default's version stays.
    prompt_format = "plain" if d.prompt_format == "auto" and not tokenizer_src and not d.chat_template \
        else d.prompt_format
    parts = [PREPARE_VERSION, content, tokenizer_id, prompt_version, prompt_format,
             str(spec.train.seq_len), str(d.packing)]
    if d.chat_template is not None:
        parts.append(f"chat_template={d.chat_template}")
    if d.assistant_turns != "all":  # (kept out of the default's parts: the embedded default's version stays)
        parts.append(f"assistant_turns={d.assistant_turns}")
    if spec.train.objective == "dpo":  # pairs packed as two documents, not the chosen alone
        parts.append("pairs")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _content_fingerprint(d, sources: list[Source]) -> str:
    """The sources' bytes and every setting that decides which examples go where."""
    if len(sources) == 1 and sources[0].bundled is not None:
        return sources[0].fingerprint  # the generated set: its examples, drawn with the split settings
    entries = [[s.fingerprint, s.name, s.weight, s.reading.format, s.reading.columns.model_dump()] for s in sources]
    settings = [entries, d.seed, d.train_size, d.validation_size, d.test_size, d.group_by, d.task, READ_VERSION,
                sorted(d.roles.items())]
    if any(entry.prompt_format for entry in d.sources):
        settings.append([entry.prompt_format for entry in d.sources])
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


@contextmanager
def _locked(path: Path):
    with path.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _tokenizer_for(spec: JobSpec, sources: list[Source], assignments: list[Assignment], work: Path
                   ) -> PreTrainedTokenizerBase:
    """The model's tokenizer, or a byte-level BPE trained on the training examples (streamed); kept in `work` so
    that a resumed preparation tokenizes its remaining chunks with the same one."""
    saved = work / "tokenizer"
    src = spec.model.tokenizer or spec.model.path
    if saved.is_dir():
        tok = load_tokenizer(str(saved))
    elif src:
        tok = load_tokenizer(src)
    else:
        texts = (t for source, a in zip(sources, assignments, strict=True)
                 for split, ex, _ in examples_in_order(source, a) if split == "train" for t in _texts(ex))
        tok = train_bpe(texts, spec.model.arch.vocab_size)
    if not saved.is_dir():  # (a saved one has it already)
        tok = use_named_template(tok, spec.data.chat_template)
    for i, (source, a) in enumerate(zip(sources, assignments, strict=True)):
        first = next((ex for _, ex, _ in examples_in_order(source, a)), None)
        fmt = source_prompt_format(spec, i)
        if first is not None and needs_chat_template(first, fmt):
            field = f"data.sources[{i}].prompt_format" if spec.data.sources and spec.data.sources[i].prompt_format \
                else "data.prompt_format"
            check_chat_template(tok, spec.model.tokenizer and "model.tokenizer" or "model.path",
                                f"{field}=chat" if first.kind == "prompt_answer" else "a conversation")
    if not saved.is_dir():
        tmp = work / ".tokenizer.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tok.save_pretrained(tmp)
        os.replace(tmp, saved)
    return tok


def source_prompt_format(spec: JobSpec, index: int) -> str:
    """The prompt format of the `index`-th source, as the spec says it (`auto` unresolved): its own, else the
    mixture's one `data.prompt_format`."""
    entries = spec.data.sources
    own = entries[index].prompt_format if index < len(entries) else None
    return own or spec.data.prompt_format


def _texts(ex: Example) -> list[str]:
    """What a tokenizer trained on the data learns from."""
    if ex.kind == "chat":
        return [m["content"] for m in ex.messages]
    if ex.kind == "text":
        return [ex.text or ""]
    return [ex.context, ex.question, ex.answer] + ([ex.prompt] if ex.prompt else [])


def _build(spec: JobSpec, sources: list[Source], work: Path, out: Path, version: str,
           progress: Progress | None) -> None:
    say = progress or (lambda *args: None)
    work.mkdir(parents=True, exist_ok=True)
    assignments = []
    for i, source in enumerate(sources):
        say(f"reading {source.name}", 0, None, 0)
        assignments.append(assign(source, i, spec.data))
    draw_mixture(sources, assignments, spec.data)
    tok = _tokenizer_for(spec, sources, assignments, work)
    settings = EncodeSettings.of(spec, work / "tokenizer")
    formats = [resolved_format(tok, source_prompt_format(spec, i)) for i in range(len(sources))]  # type: ignore[arg-type]
    say_formats(spec, sources, assignments, formats)
    total = sum(a.examples for a in assignments)
    chunks = []
    for i, (source, a) in enumerate(zip(sources, assignments, strict=True)):
        n = encode_source(source, i, a, replace(settings, prompt_format=formats[i]), work,
                          lambda ex, t: say("tokenizing", ex, total, t))
        chunks += [(i, chunk_path(work, i, k)) for k in range(n)]
    out.mkdir(parents=True)
    tok.save_pretrained(out / "tokenizer")
    pad = pad_id(tok)
    dropped = Counter()
    for a in assignments:
        dropped.update(a.dropped)
    stats: dict = {"rows_read": sum(a.examples + sum(a.dropped.values()) for a in assignments),
                   "format": assignments[0].format, "prompt_format": formats[0],
                   "splits": {}}
    per_source = [{"name": s.name, "weight": s.weight, "format": a.format, "prompt_format": fmt,
                   "rows_read": a.examples + sum(a.dropped.values()), "dropped": dict(a.dropped),
                   "train_examples": a.mixed, "repeats": round(a.mixed / max(1, a.train_examples), 3),
                   "tokens": {}, "loss_tokens": {}} for s, a, fmt in zip(sources, assignments, formats, strict=True)]
    for split in SPLITS:
        split_stats = write_split(split, chunks, spec.train.seq_len, spec.data.packing, pad, out, work,
                                  per_source, dropped)
        stats["splits"][split] = split_stats
        if split in PACKED_SPLITS and not split_stats.get("rows"):
            raise DataError(
                spec.data.path or "generated data", f"no {split} example fits train.seq_len="
                f"{spec.train.seq_len}", "raise train.seq_len",
            )
    train_tokens = sum(s["tokens"].get("train", 0) for s in per_source) or 1
    for s in per_source:
        s["share_of_train_tokens"] = round(s["tokens"].get("train", 0) / train_tokens, 4)
    stats["dropped"] = dict(sorted(dropped.items()))
    stats["sources"] = per_source
    say_too_long(spec, sources, assignments, formats, tok, stats)
    _finish(spec, out, version, tok, [s.name for s in sources], stats)


def say_formats(spec: JobSpec, sources: list[Source], assignments: list[Assignment], formats: list[str]) -> None:
    """Which prompt format `auto` chose, where a source has prompts to render (conversations always render with the
    chat template); it is also `prompt_format` in stats.json and meta.json."""
    for i, (source, a, fmt) in enumerate(zip(sources, assignments, formats, strict=True)):
        if source_prompt_format(spec, i) == "auto" and a.format not in ("messages", "conversations", "text"):
            log.info("%s: prompts render %s (data.prompt_format=auto: the tokenizer %s a chat template)", source.name,
                     "with the chat template" if fmt == "chat" else "as plain text", "has" if fmt == "chat" else
                     "has no")


def _build_random(spec: JobSpec, out: Path, version: str) -> None:
    """The random-token rows (`data.task: random_tokens`): the model's tokenizer (or a byte-level BPE, when the
    model is built from `arch`) only bounds the ids and decodes samples."""
    out.mkdir(parents=True)
    src = spec.model.tokenizer or spec.model.path
    tok = load_tokenizer(src) if src else train_bpe([BPE_SEED_TEXT], spec.model.arch.vocab_size)
    tok.save_pretrained(out / "tokenizer")
    vocab = min(tok.vocab_size, spec.model.arch.vocab_size) if not src else tok.vocab_size
    stats = write_random_rows(spec, vocab, pad_id(tok), out)
    _finish(spec, out, version, tok, [RANDOM_TOKENS], stats)


BPE_SEED_TEXT = "".join(chr(c) for c in range(32, 127))
"""What the BPE of a random-token run learns from: printable ASCII (its ids are drawn, never tokenized)."""


def _finish(spec: JobSpec, out: Path, version: str, tok: PreTrainedTokenizerBase, source_names: list[str],
            stats: dict) -> None:
    (out / "stats.json").write_text(json.dumps(stats, indent=2))
    listed = [p for p in sorted(out.rglob("*")) if p.is_file()]  # every file but meta.json, stats.json included
    files = {str(p.relative_to(out)): p.stat().st_size for p in listed}
    whole = hashed_whole(files)
    sums = {name: checksum(out / name, name in whole) for name in files}
    prompt_format = stats.get("prompt_format") or resolved_format(tok, spec.data.prompt_format)  # `auto` resolved
    meta = {"version": version, "seq_len": spec.train.seq_len, "pad_id": pad_id(tok), "eos_id": tok.eos_token_id,
            "vocab_size": len(tok), "prompt_format": prompt_format, "packing": spec.data.packing,
            "sources": source_names, "files": files, "sha256": sums}
    # meta.json is written last (the whole directory is renamed into place after it): it lists the rest.
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
