"""Locations: a URL scheme whose package is missing, or a URL where a local path is needed, is a named error."""

import importlib.util
import sys

import pytest

from shardline.errors import SpecError
from shardline.storage import check_locations, filesystem_for, url_scheme
from tests.conftest import small_spec


@pytest.fixture
def without_s3fs(monkeypatch):
    monkeypatch.setitem(sys.modules, "s3fs", None)  # an import of s3fs now fails, as where it is not installed
    assert importlib.util.find_spec("s3fs") is None


@pytest.mark.parametrize(("url", "package"), [("s3://bucket/ckpt", "s3fs"), ("gs://bucket/ckpt", "gcsfs")])
def test_missing_filesystem_package_names_field_scheme_and_install(url, package, without_s3fs):
    assert importlib.util.find_spec("gcsfs") is None
    with pytest.raises(SpecError) as err:
        filesystem_for(url, "checkpoint.dir")
    e = err.value
    assert e.where == "checkpoint.dir" and url in e.problem and f"{url_scheme(url)}://" in e.problem
    assert f"pip install {package}" in e.fix


def test_unknown_url_scheme_is_named():
    with pytest.raises(SpecError, match="unknown URL scheme 'nope://'"):
        filesystem_for("nope://bucket/x", "checkpoint.dir")


def test_local_paths_open_without_any_package(tmp_path):
    fs, path = filesystem_for(str(tmp_path), "checkpoint.dir")
    assert fs.exists(path) and url_scheme(str(tmp_path)) is None


@pytest.mark.parametrize("field", ["model.path", "model.local_cache", "data.cache_dir", "run.dir"])
def test_url_in_a_local_only_field_names_the_field(tmp_path, field):
    spec = small_spec(tmp_path, f"{field}=gs://bucket/x")
    with pytest.raises(SpecError) as err:
        check_locations(spec)
    assert err.value.where == field and "gs://" in err.value.problem and "mount" in err.value.fix
