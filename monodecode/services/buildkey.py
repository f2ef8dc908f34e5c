"""Build keys: one sha256 over everything a compiled kernel depends on.

Two builds with the same key are interchangeable; anything that could change the machine code
or its meaning changes the key: backend, arch, every model dimension (through
``ModelDims.digest``), weight and KV dtypes, TP size, step widths, KV block size, a digest of
the backend's kernel sources, and the compiler version. Images bake artifacts under these keys;
the runtime recomputes the key and loads only an exact match.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

BUILD_KEY_SCHEMA = 1

# Files that can change generated code; caches and bytecode never do.
_SOURCE_SUFFIXES = (".py", ".c", ".cc", ".cpp", ".h", ".hpp", ".ll", ".mlir", ".json", ".toml", ".txt")
_SKIP_DIRS = {"__pycache__", ".pytest_cache"}


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def build_key(
    backend: str,
    arch: str,
    dims: Any,
    weight_dtype: str,
    kv_dtype: str,
    tp_size: int,
    widths: Iterable[int],
    block_size: int,
    source_digest: str,
    compiler_version: str,
) -> str:
    """sha256 hex of the canonical JSON of every build input. ``dims`` is a ``ModelDims`` (its
    ``digest()`` is used) or an already computed dims digest string."""
    dims_digest = dims if isinstance(dims, str) else dims.digest()
    payload = {
        "schema": BUILD_KEY_SCHEMA,
        "backend": str(backend),
        "arch": str(arch),
        "dims": dims_digest,
        "weight_dtype": str(weight_dtype),
        "kv_dtype": str(kv_dtype),
        "tp_size": int(tp_size),
        "widths": [int(w) for w in widths],
        "block_size": int(block_size),
        "source_digest": str(source_digest),
        "compiler_version": str(compiler_version),
    }
    return hashlib.sha256(canonical_json(payload).encode()).hexdigest()


def source_files(package_dir: str | Path) -> list[Path]:
    root = Path(package_dir)
    if root.is_file():
        return [root]
    files = []
    for path in root.rglob("*"):
        if path.is_file() and path.suffix in _SOURCE_SUFFIXES and not (_SKIP_DIRS & set(path.relative_to(root).parts)):
            files.append(path)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def source_digest(package_dir: str | Path, extra_files: Iterable[str | Path] = ()) -> str:
    """sha256 over (relative path, contents) of every kernel source file under ``package_dir``
    (a directory or a single file), plus ``extra_files`` (e.g. the shared plan module)."""
    root = Path(package_dir)
    if not root.exists():
        raise FileNotFoundError(f"kernel source {root} does not exist")
    h = hashlib.sha256()
    base = root if root.is_dir() else root.parent
    entries = [(p.relative_to(base).as_posix(), p) for p in source_files(root)]
    entries += [(f"extra/{Path(p).name}", Path(p)) for p in extra_files]
    for rel, path in entries:
        data = path.read_bytes()
        h.update(rel.encode() + b"\0" + str(len(data)).encode() + b"\0")
        h.update(data)
    return h.hexdigest()
