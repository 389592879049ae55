"""`model.local_cache`: the staged copy follows the source's content, and an unchanged source is copied once."""

import json
import os
import shutil

from shardline.model import local_cache
from shardline.model.local_cache import stage
from shardline.spec import ModelSpec

WEIGHTS_BYTES = 3 << 20  # larger than a file that is worth hashing: keyed by size and mtime


def _source(root):
    src = root / "model"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"hidden_size": 64}))
    (src / "model.safetensors").write_bytes(b"\0" * WEIGHTS_BYTES)
    return src


def _counting_copies(monkeypatch) -> list:
    copies = []
    real_copytree = shutil.copytree

    def copytree(src, dst, **kw):
        copies.append(src)
        return real_copytree(src, dst, **kw)

    monkeypatch.setattr(local_cache.shutil, "copytree", copytree)
    return copies


def test_unchanged_source_is_staged_once(tmp_path, monkeypatch):
    spec = ModelSpec(path=str(_source(tmp_path)), local_cache=str(tmp_path / "cache"))
    copies = _counting_copies(monkeypatch)
    first = stage(spec)
    assert stage(spec) == first and len(copies) == 1


def test_changed_config_is_staged_again(tmp_path, monkeypatch):
    src = _source(tmp_path)
    spec = ModelSpec(path=str(src), local_cache=str(tmp_path / "cache"))
    first = stage(spec)
    config = src / "config.json"
    st = config.stat()
    config.write_text(json.dumps({"hidden_size": 96}))  # same size: only the content tells
    os.utime(config, ns=(st.st_atime_ns, st.st_mtime_ns))
    second = stage(spec)
    assert second != first and json.loads((second / "config.json").read_text()) == {"hidden_size": 96}
    assert not first.exists()  # the copy of the old content is removed


def test_rewritten_weights_are_staged_again(tmp_path, monkeypatch):
    src = _source(tmp_path)
    spec = ModelSpec(path=str(src), local_cache=str(tmp_path / "cache"))
    stage(spec)
    weights = src / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    weights.write_bytes(b"\1" * WEIGHTS_BYTES)
    os.utime(weights, ns=(mtime + 10**9, mtime + 10**9))  # a rewrite moves the mtime on, whatever the clock says
    copies = _counting_copies(monkeypatch)
    second = stage(spec)
    assert len(copies) == 1 and (second / "model.safetensors").read_bytes()[:1] == b"\1"
