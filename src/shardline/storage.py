"""Locations that may be URLs: which fields take one, and which package each URL scheme needs.

Only `checkpoint.dir` is opened through fsspec (s3://, gs://, …); every other location is read with
plain file APIs (memory maps, `from_pretrained`), so there a URL is refused up front with the field named.
"""

from __future__ import annotations

import importlib.util
import re
from typing import TYPE_CHECKING

from shardline.errors import SpecError

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem
    from pydantic import BaseModel

SCHEME_PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs",
                   "az": "adlfs", "abfs": "adlfs", "abfss": "adlfs"}
"""The fsspec implementation package of the URL schemes we name in docs; fsspec knows the rest."""
LOCAL_FIELDS = ("run.dir", "model.path", "model.tokenizer", "model.local_cache", "data.path", "data.cache_dir")
"""Fields read with plain file APIs: a local path or a mount (NFS, GCS FUSE), never a URL."""
URL_FIELDS = ("checkpoint.dir",)
"""Fields opened through fsspec: a local path, a mount or a URL."""
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def url_scheme(location: str) -> str | None:
    """`"s3"` for `s3://bucket/x`, None for a plain path."""
    match = _URL.match(location)
    return match.group(1).lower() if match else None


def filesystem_for(location: str, field: str) -> tuple[AbstractFileSystem, str]:
    """The fsspec filesystem and path of a local path or URL (`fsspec.core.url_to_fs`).

    Raises a SpecError naming `field` when the URL scheme is unknown or its package is not installed."""
    import fsspec
    from fsspec.core import url_to_fs

    scheme = url_scheme(location)
    if scheme is not None and scheme not in fsspec.available_protocols():
        raise SpecError(field, f"{location!r} has the unknown URL scheme '{scheme}://'",
                        "use a local path, a mount, or an s3:// or gs:// URL")
    package = SCHEME_PACKAGES.get(scheme or "")
    if package is not None and importlib.util.find_spec(package) is None:
        raise SpecError(field, f"{location!r} is a {scheme}:// URL, but the '{package}' package is not installed",
                        f"pip install {package} (where the workers run), or use a local path or mount")
    try:
        return url_to_fs(location)
    except ImportError as e:  # a scheme fsspec knows whose package is missing: fsspec's message names it
        raise SpecError(field, f"{location!r} is a {scheme}:// URL, but {e}",
                        "install that package, or use a local path or mount") from None


def require_local(location: str | None, field: str) -> None:
    """A SpecError when `location` is a URL: `field` is read with plain file APIs."""
    if location is not None and (scheme := url_scheme(location)) is not None:
        raise SpecError(field, f"{location!r} is a {scheme}:// URL, but {field} takes a local path",
                        "mount the bucket (e.g. GCS FUSE, launch.kubernetes.storage) or copy the files locally; "
                        "only checkpoint.dir takes s3:// or gs:// URLs")


def check_locations(spec: BaseModel, fields: tuple[str, ...] = (*LOCAL_FIELDS, *URL_FIELDS)) -> None:
    """The locations `fields` of a JobSpec are usable from this machine, or a SpecError names the field and the fix.

    Typed as a pydantic model, not JobSpec: this module stays below the spec in the import graph."""
    for field in fields:
        section, name = field.split(".")
        value = getattr(getattr(spec, section), name)
        if field in URL_FIELDS:
            if value is not None:
                filesystem_for(value, field)
        else:
            require_local(value, field)

