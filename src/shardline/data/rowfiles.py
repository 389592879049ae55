"""Rows of JSON files, read within a bound: the lines of a JSON-lines file and the elements of a JSON array, a buffer
at a time (never a whole file), each row at most `MAX_ROW_BYTES`.

A row over the bound is skipped before it is parsed and yielded as `TooLarge` (with its size), for the reader to
count and name (`shardline.data.sources.read_examples`): one row of 50 MB once cost 9 GB and minutes to tokenize,
and a JSON array was parsed whole. Errors name the file and line.

A file whose name ends in `.gz` is read through gzip as it streams, within the same bound. A UTF-8 byte order mark
(at the start of a file, or of a line where files with one were joined) and CRLF line ends read as the text they
mark.
"""

from __future__ import annotations

import gzip
import io
import json
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, NoReturn

from shardline.errors import DataError

MAX_ROW_BYTES = 16 << 20
"""The largest row read (a JSON line, an array element), in bytes. Fixed, not derived from `train.seq_len`: a text
document of any length is kept (cut into pieces), so a row's useful size has no bound in tokens; 16 MiB holds a long
book or 4M tokens of conversation, and bounds what reading one row costs (a few times its size)."""
READ_BYTES = 1 << 20
"""What a JSON-lines file is read by while a line over the bound is skipped."""
READ_CHARS = 1 << 20
"""What a JSON array is read by."""


@dataclass(frozen=True)
class TooLarge:
    """A row over `MAX_ROW_BYTES`, skipped unread."""

    size: int
    """Its length in bytes."""


def open_bytes(path: Path) -> IO[bytes]:
    """The file's bytes: through gzip, as they are read, when its name ends in `.gz` (in any case)."""
    return gzip.open(path, "rb") if path.name.lower().endswith(".gz") else path.open("rb")


BROKEN_GZIP = (gzip.BadGzipFile, EOFError, zlib.error)
"""What reading a damaged or truncated gzip file raises."""
BOM = "\ufeff"


def _broken_gzip(where: str, e: Exception) -> DataError:
    return DataError(where, f"is not a complete gzip file ({e or type(e).__name__})",
                     "compress the file again (gzip FILE), or decompress it and point data.path at the plain file")


def json_lines(path: Path) -> Iterator[tuple[str, Any]]:
    """(`path:line`, row) for each non-blank line of a JSON-lines file; a line over the bound is a `TooLarge`, read
    past a piece at a time and never held."""
    lineno = 0
    try:
        with open_bytes(path) as f:
            while line := f.readline(MAX_ROW_BYTES + 2):  # the bound and a line break (\r\n)
                lineno += 1
                if len(line) > MAX_ROW_BYTES:
                    size = len(line.rstrip(b"\r\n"))
                    if not line.endswith(b"\n"):
                        while (piece := f.readline(READ_BYTES)) and not piece.endswith(b"\n"):
                            size += len(piece)
                        size += len(piece.rstrip(b"\r\n"))
                    if size > MAX_ROW_BYTES:
                        yield f"{path}:{lineno}", TooLarge(size)
                        continue
                if line.isspace():
                    continue
                yield f"{path}:{lineno}", _json_line(line, f"{path}:{lineno}")
    except BROKEN_GZIP as e:
        raise _broken_gzip(f"{path}:{lineno + 1}", e) from e


def _json_line(line: bytes, where: str) -> Any:
    try:
        text = line.decode()
        return json.loads(text[1:] if text.startswith(BOM) else text)
    except json.JSONDecodeError as e:
        raise DataError(where, f"not valid JSON ({e.msg})", "fix or remove the line") from e
    except UnicodeDecodeError as e:
        raise DataError(where, f"is not UTF-8 text ({e.reason} at byte {e.start})",
                        "save the file as UTF-8 (JSON's encoding)") from e


def json_array(path: Path) -> Iterator[tuple[str, Any]]:
    """(`path#n`, element) for each element of a JSON array file, in order; an element over the bound is a
    `TooLarge`, skipped without parsing it."""
    try:
        with io.TextIOWrapper(open_bytes(path), encoding="utf-8-sig", newline="") as f:
            yield from _Array(f, path).elements()
    except UnicodeDecodeError as e:
        raise DataError(str(path), f"is not UTF-8 text ({e.reason})", "save the file as UTF-8") from e
    except BROKEN_GZIP as e:
        raise _broken_gzip(str(path), e) from e


def starts_with(path: Path, prefix: bytes) -> bool:
    """Whether the file's first bytes after a byte order mark and whitespace are `prefix`."""
    try:
        with open_bytes(path) as f:
            head = f.read(4096)
    except BROKEN_GZIP as e:
        raise _broken_gzip(str(path), e) from e
    return head.removeprefix(BOM.encode()).lstrip().startswith(prefix)


_SPACE = re.compile(r"[ \t\n\r]*")
_IN_STRING = re.compile(r'[^"\\]*')
_OUTSIDE = re.compile(r'[^"\[\]{},]+')


class _Array:
    """A JSON array read a buffer at a time: `buf[pos:]` is what is not consumed yet, `offset` the position of
    `buf[0]` in the file (in characters), `lines` the line breaks before it (for errors)."""

    def __init__(self, f: IO[str], path: Path):
        self.f, self.path = f, path
        self.buf, self.pos, self.offset, self.lines, self.eof = "", 0, 0, 0, False
        self.skipped = self.skipped_from = 0
        """Bytes of the element being skipped before the buffer, and where it starts in the buffer."""
        self.decoder = json.JSONDecoder()

    def elements(self) -> Iterator[tuple[str, Any]]:
        if self._next_char() != "[":
            self._fail(self.pos, "not a JSON array")
        self.pos += 1
        if self._next_char() == "]":
            self.pos += 1
        else:
            n = 0
            while True:
                n += 1
                yield f"{self.path}#{n}", self._element()
                c = self._next_char()
                if c not in (",", "]"):
                    self._fail(self.pos, "expecting ',' delimiter" if c else "the array is not closed")
                self.pos += 1
                if c == "]":
                    break
                self._next_char()
        if self._next_char():
            self._fail(self.pos, "extra data after the array")

    def _element(self) -> Any:
        """The element at `pos`, parsed; a TooLarge when it is longer than the bound (then never parsed whole)."""
        while True:
            try:
                value, end = self.decoder.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as e:
                if self.eof:
                    self._fail(e.pos, e.msg)
                if len(self.buf) - self.pos > MAX_ROW_BYTES:  # too large, or broken: the scan tells which
                    return self._skip(e)
                self._read()
                continue
            if not self.eof and len(self.buf) - end < 4 and not isinstance(value, (dict, list, str)):
                self._read()  # a number cut by the read ("1", "1.", "1e-" of "1.5e-3") goes on in the next one
                continue
            size = end - self.pos
            if size * 4 > MAX_ROW_BYTES:  # a character is 1-4 bytes: they are counted only where it matters
                size = _utf8_len(self.buf[self.pos:end])
            self.pos = end
            return TooLarge(size) if size > MAX_ROW_BYTES else value

    def _skip(self, error: json.JSONDecodeError) -> TooLarge:
        """Pass the element at `pos` without holding it, following its strings and brackets to its end; one that
        ends within the bound was not too large but broken: `error` says where."""
        first, i, depth = self.offset + self.pos, self.pos, 0
        self.skipped, self.skipped_from = 0, self.pos
        while True:
            if i == len(self.buf):
                i = self._drop_and_read(i, "the array is not closed")
            c = self.buf[i]
            if c == '"':
                i = self._string_end(i + 1)
            elif c in "[{":
                depth += 1
                i += 1
            elif c == ",":
                if depth == 0:
                    break
                i += 1
            elif c in "]}":
                if depth == 0:
                    break
                depth -= 1
                i += 1
            else:
                i = _OUTSIDE.match(self.buf, i).end()
        if self.offset + i - first <= MAX_ROW_BYTES:  # within the buffer it was decoded from: `error` still holds
            self._fail(error.pos, error.msg)
        self.pos = i
        return TooLarge(self.skipped + _utf8_len(self.buf[self.skipped_from:i]))

    def _string_end(self, i: int) -> int:
        """The position after the string whose contents start at `i`."""
        while True:
            i = _IN_STRING.match(self.buf, i).end()
            if i < len(self.buf) and self.buf[i] == '"':
                return i + 1
            if i + 1 < len(self.buf):  # a backslash and the character it escapes
                i += 2
            else:
                i = self._drop_and_read(i, "unterminated string")

    def _drop_and_read(self, i: int, problem: str) -> int:
        """Forget the buffer before `i` (counting the bytes skipped) and read on; returns where `i` is now."""
        self.skipped += _utf8_len(self.buf[self.skipped_from:i])
        self.skipped_from = 0
        self.lines += self.buf.count("\n", 0, i)
        self.offset += i
        self.buf, self.pos = self.buf[i:], 0
        if not self._more(READ_CHARS):
            self._fail(len(self.buf), problem)
        return 0

    def _next_char(self) -> str:
        """The next character after whitespace ('' at the end of the file); `pos` is moved to it."""
        while True:
            self.pos = _SPACE.match(self.buf, self.pos).end()
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if self.eof:
                return ""
            self._read()

    def _read(self) -> None:
        """Read on, keeping `buf[pos:]`: at least as much again as it holds (an element is parsed a few times at
        most), never more than the bound past `pos`."""
        self.lines += self.buf.count("\n", 0, self.pos)
        self.offset += self.pos
        self.buf, self.pos = self.buf[self.pos:], 0
        held = len(self.buf)
        self._more(max(READ_CHARS - held, min(held, MAX_ROW_BYTES + 1 - held)))

    def _more(self, n: int) -> bool:
        piece = self.f.read(max(1, n))
        self.eof = not piece
        self.buf += piece
        return bool(piece)

    def _fail(self, at: int, problem: str) -> NoReturn:
        line = self.lines + self.buf.count("\n", 0, at) + 1
        raise DataError(f"{self.path}:{line}", f"not valid JSON ({problem})", "fix the file")


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))
