"""The Docker engine, through the Docker SDK: connecting, looking images up, resolving a tag to
its registry digest, and reading files out of an image without running it.

Every problem a user can cause (engine unreachable, image missing, registry refusing) is an
``ImageError`` with one line naming it. The SDK is imported only when an engine is used.
"""

from __future__ import annotations

import contextlib
import os
import tarfile
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from monodecode_ops.labels import DIGEST, PREFIX, ImageError

if TYPE_CHECKING:
    import docker


def reason(e: BaseException) -> str:
    """One line from a Docker SDK / requests exception (they nest and span lines)."""
    text = getattr(e, "explanation", None) or str(e) or type(e).__name__
    text = " ".join(str(text).split())
    return text[:300]


def docker_host() -> str:
    return os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"


def connect(timeout: int | None = 120) -> docker.DockerClient:
    """A client for the engine in ``DOCKER_HOST`` (default the local socket), checked with a ping."""
    try:
        import docker
    except ImportError:
        raise ImageError("the Docker SDK is not installed (pip install 'monodecode[ops]')") from None
    try:
        client = docker.from_env(timeout=timeout)
        client.ping()
    except Exception as e:  # DockerException, requests errors, OSError: all mean "not reachable"
        raise ImageError(
            f"cannot reach the Docker engine at {docker_host()}: {reason(e)} "
            "(is dockerd running? scripts/services.d/dockerd.sh start)"
        ) from None
    return client


def get_image(client: docker.DockerClient, ref: str):
    import docker

    try:
        return client.images.get(ref)
    except docker.errors.ImageNotFound:
        raise ImageError(f"image {ref} is not in the Docker engine (docker pull {ref}, or build it)") from None
    except docker.errors.APIError as e:
        raise ImageError(f"cannot look up image {ref}: {reason(e)}") from None


def pull_ref(ref: str) -> str:
    """What to pull for ``ref``: ``name@digest`` when pinned (the tag then only documents it)."""
    if "@" in ref:
        name, digest = ref.split("@", 1)
        last = name.rsplit("/", 1)[-1]
        if ":" in last:  # drop the tag, keep a registry port
            name = name[: len(name) - len(last)] + last.split(":", 1)[0]
        return f"{name}@{digest}"
    return ref


def registry_digest(client: docker.DockerClient, ref: str) -> str:
    """The digest the registry serves for ``ref`` (a tag) right now, asked through the engine
    (so the engine's registry credentials and mirrors apply)."""
    import docker

    try:
        digest = client.images.get_registry_data(ref).id
    except docker.errors.APIError as e:
        raise ImageError(f"the registry of {ref} did not resolve it to a digest: {reason(e)}") from None
    except (docker.errors.DockerException, OSError, KeyError) as e:
        raise ImageError(f"cannot resolve {ref} to a digest: {reason(e)}") from None
    if not isinstance(digest, str) or not DIGEST.match(digest):
        raise ImageError(f"the registry of {ref} answered {str(digest)[:40]!r}, not a sha256 digest")
    return digest


def _safe_members(tar: tarfile.TarFile, dest: Path) -> list[tarfile.TarInfo]:
    out = []
    for m in tar.getmembers():
        target = (dest / m.name).resolve()
        if not str(target).startswith(str(dest.resolve())) or m.issym() or m.islnk() or m.isdev():
            continue  # nothing from an image may land outside dest or link anywhere
        out.append(m)
    return out


@contextlib.contextmanager
def image_files(client: docker.DockerClient, image: str, paths: Sequence[str]) -> Iterator[Path]:
    """Copy ``paths`` (files or directories) out of ``image`` into a temporary directory.

    ``<tmp>/<basename(path)>`` exists for every path the image has; missing ones are absent.
    The container is created, never started, and always removed.
    """
    import docker

    try:
        container = client.containers.create(
            image,
            entrypoint=["/monodecode-never-started"],
            command=[],
            network_disabled=True,
            labels={PREFIX + "purpose": "read-files"},
        )
    except docker.errors.APIError as e:
        raise ImageError(f"cannot open image {image} to read its files: {reason(e)}") from None
    try:
        with tempfile.TemporaryDirectory(prefix="monodecode-image-") as tmp:
            dest = Path(tmp)
            for path in paths:
                try:
                    chunks, _stat = container.get_archive(path)
                except docker.errors.NotFound:
                    continue
                with tempfile.TemporaryFile() as buf:
                    for chunk in chunks:
                        buf.write(chunk)
                    buf.seek(0)
                    with tarfile.open(fileobj=buf) as tar:
                        extra = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
                        tar.extractall(dest, members=_safe_members(tar, dest), **extra)
            yield dest
    finally:
        with contextlib.suppress(Exception):
            container.remove(force=True, v=True)
