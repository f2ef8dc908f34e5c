"""Reading JSON from outside (configs, manifests, markers): every failure is one error line.

``json.loads`` alone lets through, or crashes on: nesting past the recursion limit
(``RecursionError``), integers past Python's digit limit (``ValueError``), ``NaN`` /
``Infinity`` and numbers like ``1e999`` that become infinite, text that is not UTF-8, and paths
that are directories or FIFOs (a read that blocks forever). ``parse_json`` and
``read_json_file`` turn each into the caller's ``MonodecodeError`` subclass, naming the source.
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
from pathlib import Path
from typing import Any

from monodecode.errors import MonodecodeError

MAX_JSON_BYTES = 16 << 20  # configs, manifests and markers are small; anything larger is refused


class _NotFinite(ValueError):
    pass


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NotFinite(text)
    return value


def _no_constant(name: str) -> float:
    raise _NotFinite(name)


def parse_json(text: str | bytes, where: str, error: type[MonodecodeError] = MonodecodeError) -> Any:
    """The value of JSON ``text`` (bytes must be UTF-8); ``error`` naming ``where`` otherwise."""
    if isinstance(text, (bytes, bytearray)):
        if len(text) > MAX_JSON_BYTES:
            raise error(f"{where} is larger than {MAX_JSON_BYTES} bytes")
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as e:
            raise error(f"{where} is not UTF-8 text (byte {e.start})") from None
    elif len(text) > MAX_JSON_BYTES:
        raise error(f"{where} is larger than {MAX_JSON_BYTES} characters")
    try:
        return json.loads(text, parse_float=_finite_float, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise error(f"{where} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except RecursionError:
        raise error(f"{where} is nested too deeply") from None
    except _NotFinite as e:
        raise error(f"{where} holds {e}, not a finite number") from None
    except ValueError:  # an integer literal past Python's digit limit
        raise error(f"{where} has a number with too many digits") from None


def open_regular(
    path: str | Path, where: str, error: type[MonodecodeError] = MonodecodeError, follow_symlinks: bool = True
) -> int:
    """A read-only descriptor of ``path`` if it is a regular file (following symlinks unless
    ``follow_symlinks`` is False: then a symlink is ``error``); a directory, FIFO, device or
    socket is ``error``, and opening never blocks (O_NONBLOCK). ``FileNotFoundError`` passes
    through. The caller closes the descriptor."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | (0 if follow_symlinks else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise
    except OSError as e:
        if e.errno == errno.ELOOP and not follow_symlinks:
            raise error(f"{where}: {path} is a symbolic link") from None
        raise error(f"{where}: cannot read {path}: {e.strerror or e}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise error(f"{where}: {path} is not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular_file(
    path: str | Path,
    where: str,
    error: type[MonodecodeError] = MonodecodeError,
    limit: int = MAX_JSON_BYTES,
    follow_symlinks: bool = True,
) -> bytes:
    """The bytes of the regular file ``path`` (``open_regular``), at most ``limit`` of them."""
    fd = open_regular(path, where, error, follow_symlinks)
    try:
        if os.fstat(fd).st_size > limit:
            raise error(f"{where}: {path} is larger than {limit} bytes")
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    except OSError as e:
        raise error(f"{where}: cannot read {path}: {e.strerror or e}") from None
    finally:
        os.close(fd)


def read_json_file(path: str | Path, where: str, error: type[MonodecodeError] = MonodecodeError) -> Any:
    """``parse_json`` of a regular file's bytes. ``FileNotFoundError`` passes through."""
    return parse_json(read_regular_file(path, where, error), where, error)
