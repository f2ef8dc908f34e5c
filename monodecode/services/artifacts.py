"""Baked kernel artifacts: files on disk listed in ``manifest.json`` under their build keys.

Manifest (schema 1)::

    {"schema": 1, "artifacts": [{"build_key": "<sha256>", "backend": "flydsl", "arch": "gfx942",
      "profile": "tiny", "dims_digest": "<sha256>", "widths": [1, 2, 4, 8],
      "files": [{"path": "<relative path>", "sha256": "<hex>", "bytes": 1234}],
      "compiler": {"name": "flydsl", "version": "0.5.0"}, "created": "2026-11-01T12:00:00Z",
      "extra": {...optional, backend-specific...}}]}

Rules: a file's sha256 and size are verified before anything is handed out (``lookup``); a
malformed manifest, a path leaving the store, a missing file or a checksum mismatch is an
``ArtifactError`` naming the problem, never a load. Writes (``add``) go to temp files renamed
into place, under a lock, so readers never see half a manifest and concurrent precompile runs
do not lose each other's entries.

Trust: the artifact directory is code. FlyDSL artifacts are pickles that are unpickled at
startup, and a manifest certifies only itself: whoever can write the directory can run code in
every server that loads it. So the store refuses (``ArtifactError``) a directory, inside the
store or the store itself, that its group or others may write, and any symlink inside the store
(a symlinked subdirectory or file would hand out, or let ``add`` write, files outside it); only
the store's root may be given through a symlink. Ownership is the deployer's part: the image
bakes the store into /opt/monodecode/artifacts owned by root, with files 0644 and directories
0755, and runs as user 10001, which can read it and write nothing there. A directory mounted
into a pod must be read-only to the server for the same reason.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import hashlib
import json
import os
import stat
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from monodecode.errors import ArtifactError
from monodecode.jsonio import MAX_JSON_BYTES, open_regular, parse_json, read_regular_file
from monodecode.services.faults import faults_from_env, find_fault

MANIFEST = "manifest.json"
SCHEMA = 1
_HEX = set("0123456789abcdef")


@dataclass(frozen=True)
class ArtifactFile:
    path: str  # relative to the store root, POSIX separators
    sha256: str
    bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "sha256": self.sha256, "bytes": self.bytes}


@dataclass(frozen=True)
class ArtifactEntry:
    build_key: str
    backend: str
    arch: str
    profile: str | None
    dims_digest: str
    widths: tuple[int, ...]
    files: tuple[ArtifactFile, ...]
    compiler: dict[str, str]
    created: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    root: Path | None = field(default=None, compare=False)  # set by the store on lookup

    def path_of(self, rel: str) -> Path:
        if self.root is None:
            raise ArtifactError(f"artifact {self.build_key[:12]} is not bound to a store")
        return self.root / rel

    def to_dict(self) -> dict[str, Any]:
        d = {
            "build_key": self.build_key,
            "backend": self.backend,
            "arch": self.arch,
            "profile": self.profile,
            "dims_digest": self.dims_digest,
            "widths": list(self.widths),
            "files": [f.to_dict() for f in self.files],
            "compiler": dict(self.compiler),
            "created": self.created,
        }
        if self.extra:
            d["extra"] = self.extra
        return d


def _is_sha256(s: Any) -> bool:
    return isinstance(s, str) and len(s) == 64 and set(s) <= _HEX


def _safe_rel(path: Any, where: str) -> str:
    if not isinstance(path, str) or not path:
        raise ArtifactError(f"{where}: 'path' must be a non-empty string")
    p = PurePosixPath(path)
    if p.is_absolute() or ".." in p.parts or "\\" in path or "\0" in path:
        raise ArtifactError(f"{where}: path {path!r} leaves the artifact directory")
    return p.as_posix()


def _parse_entry(raw: Any, where: str) -> ArtifactEntry:
    if not isinstance(raw, Mapping):
        raise ArtifactError(f"{where}: must be an object")
    for key, kind in (
        ("build_key", str),
        ("backend", str),
        ("arch", str),
        ("dims_digest", str),
        ("widths", list),
        ("files", list),
        ("compiler", dict),
    ):
        if key not in raw:
            raise ArtifactError(f"{where}: missing field {key!r}")
        if not isinstance(raw[key], kind):
            raise ArtifactError(f"{where}: field {key!r} must be a {kind.__name__}")
    if not _is_sha256(raw["build_key"]):
        raise ArtifactError(f"{where}: 'build_key' must be a 64-digit lowercase sha256 hex string")
    widths = raw["widths"]
    if not widths or any(isinstance(w, bool) or not isinstance(w, int) or w <= 0 for w in widths):
        raise ArtifactError(f"{where}: 'widths' must be a non-empty list of positive integers")
    compiler = raw["compiler"]
    if not isinstance(compiler.get("name"), str) or not isinstance(compiler.get("version"), str):
        raise ArtifactError(f"{where}: 'compiler' needs string fields 'name' and 'version'")
    files = []
    for i, f in enumerate(raw["files"]):
        fw = f"{where}.files[{i}]"
        if not isinstance(f, Mapping):
            raise ArtifactError(f"{fw}: must be an object")
        rel = _safe_rel(f.get("path"), fw)
        if not _is_sha256(f.get("sha256")):
            raise ArtifactError(f"{fw}: 'sha256' must be a 64-digit lowercase hex string")
        size = f.get("bytes")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ArtifactError(f"{fw}: 'bytes' must be a non-negative integer")
        files.append(ArtifactFile(rel, f["sha256"], size))
    if not files:
        raise ArtifactError(f"{where}: 'files' is empty")
    profile = raw.get("profile")
    if profile is not None and not isinstance(profile, str):
        raise ArtifactError(f"{where}: 'profile' must be a string or null")
    extra = raw.get("extra", {})
    if not isinstance(extra, Mapping):
        raise ArtifactError(f"{where}: 'extra' must be an object")
    return ArtifactEntry(
        build_key=raw["build_key"],
        backend=raw["backend"],
        arch=raw["arch"],
        profile=profile,
        dims_digest=raw["dims_digest"],
        widths=tuple(widths),
        files=tuple(files),
        compiler={"name": compiler["name"], "version": compiler["version"]},
        created=str(raw.get("created", "")),
        extra=dict(extra),
    )


def parse_manifest(text: str | bytes, source: str = MANIFEST) -> list[ArtifactEntry]:
    """Parse and validate manifest text; ``ArtifactError`` naming the first problem (never
    another exception, whatever the bytes)."""
    data = parse_json(text, source, ArtifactError)
    if not isinstance(data, Mapping):
        raise ArtifactError(f"{source}: must hold a JSON object")
    if data.get("schema") != SCHEMA:
        raise ArtifactError(f"{source}: unsupported schema {data.get('schema')!r} (expected {SCHEMA})")
    arts = data.get("artifacts")
    if not isinstance(arts, list):
        raise ArtifactError(f"{source}: 'artifacts' must be a list")
    entries = [_parse_entry(a, f"{source}: artifacts[{i}]") for i, a in enumerate(arts)]
    seen: set[str] = set()
    for e in entries:
        if e.build_key in seen:
            raise ArtifactError(f"{source}: build key {e.build_key[:12]} is listed twice")
        seen.add(e.build_key)
    return entries


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temp file in the same directory + rename (no half files)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would leave the file unreadable to a server running as another user
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def manifest_digest(data: bytes) -> str:
    """The digest an image records for its baked manifest (``image.json``'s ``manifest_digest``)."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


IMAGE_INFO_ENV = "MONODECODE_IMAGE_INFO"
BAKED_ARTIFACT_DIR = "/opt/monodecode/artifacts"


def baked_manifest_digest(root: str | Path, environ: Mapping[str, str] | None = None) -> str | None:
    """Inside a monodecode image, the digest its build recorded for the manifest of ``root``
    when ``root`` is the image's baked artifact directory; None elsewhere (nothing to compare
    with). An unreadable ``image.json`` is an ``ArtifactError``."""
    env = os.environ if environ is None else environ
    info_path = env.get(IMAGE_INFO_ENV)
    if not info_path:
        return None
    baked = env.get("MONODECODE_ARTIFACT_DIR") or BAKED_ARTIFACT_DIR
    if os.path.realpath(Path(root).expanduser()) != os.path.realpath(baked):
        return None
    try:
        info = parse_json(read_regular_file(info_path, IMAGE_INFO_ENV, ArtifactError), info_path, ArtifactError)
    except FileNotFoundError:
        return None
    digest = info.get("manifest_digest") if isinstance(info, Mapping) else None
    if not isinstance(digest, str) or not digest.startswith("sha256:"):
        raise ArtifactError(f"{info_path}: no 'manifest_digest' to check the baked manifest against")
    return digest


class ArtifactStore:
    """A directory of artifacts and its ``manifest.json``. With ``manifest_digest`` (an image's
    record of its baked manifest) the manifest's own bytes must match it before any entry is
    trusted: rewriting both the manifest and the files is then caught too."""

    def __init__(self, root: str | Path, manifest_digest: str | None = None):
        self.root = Path(root).expanduser()
        self.manifest_digest = manifest_digest

    @property
    def manifest_path(self) -> Path:
        return self.root / MANIFEST

    def _real_root(self) -> Path:
        """The store's directory (a symlink to it is resolved: the operator named it), refused
        when its group or others may write it. ``FileNotFoundError`` when it does not exist."""
        real = Path(os.path.realpath(self.root))
        st = os.stat(real)
        if not stat.S_ISDIR(st.st_mode):
            raise ArtifactError(f"artifact directory {self.root} is not a directory")
        _refuse_shared_writes(st, f"artifact directory {self.root}")
        return real

    def _path_in_store(self, rel: str, create_dirs: bool = False) -> Path:
        """``rel`` under the real root, each directory on the way a plain directory (no symlink)
        that only its owner may write (made 0755 when ``create_dirs``). ``FileNotFoundError``
        when one is missing."""
        where = f"artifact directory {self.root}"
        path = self._real_root()
        *dirs, name = PurePosixPath(_safe_rel(rel, where)).parts
        for part in dirs:
            path = path / part
            if create_dirs:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(path, 0o755)
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                raise ArtifactError(
                    f"{where}: {rel} goes through the symbolic link {path}; the store holds plain files"
                )
            if not stat.S_ISDIR(st.st_mode):
                raise ArtifactError(f"{where}: {path} is not a directory")
            _refuse_shared_writes(st, f"{where}: {path}")
        return path / name

    def _read(self, rel: str, where: str, limit: int) -> bytes:
        """The bytes of the store's file ``rel`` (never through a symlink), at most ``limit``."""
        return read_regular_file(self._path_in_store(rel), where, ArtifactError, limit, follow_symlinks=False)

    def entries(self) -> list[ArtifactEntry]:
        """All entries (manifest validated, files not checked); [] when there is no manifest."""
        try:
            text = self._read(MANIFEST, str(self.manifest_path), MAX_JSON_BYTES)
        except FileNotFoundError:
            if self.manifest_digest is not None:
                raise ArtifactError(f"{self.manifest_path} is missing; the image recorded one") from None
            return []
        if self.manifest_digest is not None and manifest_digest(text) != self.manifest_digest:
            raise ArtifactError(
                f"checksum mismatch for {self.manifest_path}: digest {manifest_digest(text)[:19]}..., "
                f"the image recorded {self.manifest_digest[:19]}..."
            )
        return [
            ArtifactEntry(**{**e.__dict__, "root": self.root}) for e in parse_manifest(text, str(self.manifest_path))
        ]

    def verify_entry(self, entry: ArtifactEntry) -> None:
        """Check every file's size and sha256; ``ArtifactError`` on the first mismatch."""
        corrupt = find_fault(faults_from_env(), "corrupt_artifact") is not None
        for f in entry.files:
            where = f"artifact {entry.build_key[:12]}: {f.path}"
            try:
                fd = open_regular(self._path_in_store(f.path), where, ArtifactError, follow_symlinks=False)
            except FileNotFoundError:
                raise ArtifactError(f"artifact {entry.build_key[:12]}: file {f.path} is missing") from None
            try:
                st = os.fstat(fd)
                _refuse_shared_writes(st, where)
                size = st.st_size
                if size != f.bytes:
                    raise ArtifactError(
                        f"artifact {entry.build_key[:12]}: checksum mismatch for {f.path} "
                        f"(size {size} bytes, manifest says {f.bytes})"
                    )
                h, last = hashlib.sha256(), b""
                while block := os.read(fd, 1 << 20):
                    h.update(last)
                    last = block
            except OSError as e:
                raise ArtifactError(f"{where}: cannot read: {e.strerror or e}") from None
            finally:
                os.close(fd)
            digest = _final_digest(h, last, corrupt)
            if digest != f.sha256:
                raise ArtifactError(
                    f"artifact {entry.build_key[:12]}: checksum mismatch for {f.path} "
                    f"(sha256 {digest[:12]}, manifest says {f.sha256[:12]})"
                )

    def read_verified(self, entry: ArtifactEntry, relpath: str) -> bytes:
        """The bytes of ``entry``'s file ``relpath``, read once and hashed against the manifest: a
        loader uses these bytes, never re-opens the path (``ArtifactError`` when it differs)."""
        f = next((f for f in entry.files if f.path == relpath), None)
        if f is None:
            raise ArtifactError(f"artifact {entry.build_key[:12]}: {relpath} is not in its manifest entry")
        where = f"artifact {entry.build_key[:12]}: {relpath}"
        try:
            data = self._read(relpath, where, limit=f.bytes + 1)
        except FileNotFoundError:
            raise ArtifactError(f"artifact {entry.build_key[:12]}: file {relpath} is missing") from None
        corrupt = find_fault(faults_from_env(), "corrupt_artifact") is not None
        digest = _final_digest(hashlib.sha256(), data, corrupt)
        if len(data) != f.bytes or digest != f.sha256:
            raise ArtifactError(
                f"artifact {entry.build_key[:12]}: checksum mismatch for {relpath} "
                f"(sha256 {digest[:12]}, manifest says {f.sha256[:12]})"
            )
        return data

    def lookup(self, build_key: str) -> ArtifactEntry | None:
        """The verified entry for ``build_key``; None if the manifest has no such key."""
        for entry in self.entries():
            if entry.build_key == build_key:
                self.verify_entry(entry)
                return entry
        return None

    def verify_all(self) -> list[tuple[ArtifactEntry, str | None]]:
        """Every entry with its problem (None = verified)."""
        out = []
        for entry in self.entries():
            try:
                self.verify_entry(entry)
                out.append((entry, None))
            except ArtifactError as e:
                out.append((entry, str(e)))
        return out

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        try:
            self.root.mkdir(mode=0o755, parents=True, exist_ok=True)  # not shared even under umask 002
            fd = os.open(self._real_root() / ".lock", os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            raise ArtifactError(f"artifact directory {self.root} is not writable: {e.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def add(
        self,
        *,
        build_key: str,
        backend: str,
        arch: str,
        dims_digest: str,
        widths: tuple[int, ...] | list[int],
        files: Mapping[str, bytes | Path],
        compiler: Mapping[str, str],
        profile: str | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> ArtifactEntry:
        """Store ``files`` (relative path -> bytes or a source file to copy) under ``build_key``
        and record them in the manifest (replacing an older entry with the same key)."""
        created = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        records = []
        blobs: list[tuple[str, bytes]] = []
        for rel, content in sorted(files.items()):
            rel = _safe_rel(rel, f"artifact {build_key[:12]}")
            data = Path(content).read_bytes() if isinstance(content, (str, Path)) else bytes(content)
            blobs.append((rel, data))
            records.append({"path": rel, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)})
        raw = {
            "build_key": build_key,
            "backend": backend,
            "arch": arch,
            "profile": profile,
            "dims_digest": dims_digest,
            "widths": list(widths),
            "files": records,
            "compiler": dict(compiler),
            "created": created,
        }
        if extra:
            raw["extra"] = dict(extra)
        entry = _parse_entry(raw, f"artifact {build_key[:12]}")  # same validation as on read
        with self._locked():
            current = self.entries()
            try:
                for rel, data in blobs:
                    atomic_write_bytes(self._path_in_store(rel, create_dirs=True), data)
                kept = [e.to_dict() for e in current if e.build_key != build_key]
                manifest = {"schema": SCHEMA, "artifacts": kept + [entry.to_dict()]}
                body = (json.dumps(manifest, indent=2) + "\n").encode()
                atomic_write_bytes(self._path_in_store(MANIFEST), body)
            except OSError as e:
                raise ArtifactError(f"artifact directory {self.root} is not writable: {e.strerror}") from None
        return ArtifactEntry(**{**entry.__dict__, "root": self.root})


def _refuse_shared_writes(st: os.stat_result, what: str) -> None:
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ArtifactError(
            f"{what} is writable by its group or others (mode {stat.S_IMODE(st.st_mode):04o}); artifacts are "
            "loaded as code, so only their owner may write there"
        )


def _final_digest(h: Any, last: bytes, corrupt: bool) -> str:
    """sha256 once ``last`` (the file's final bytes) is fed; the corrupt_artifact drill hashes the
    file as if its last byte had flipped (an empty file as one 0xFF byte), without re-reading it."""
    if corrupt:
        last = last[:-1] + bytes([last[-1] ^ 0xFF]) if last else b"\xff"
    h.update(last)
    return h.hexdigest()
