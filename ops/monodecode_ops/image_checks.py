"""Checks of a monodecode image: does this image fit this node (``verify --image``), and is the
image ``verify`` runs inside intact (``baked_checks``)?

Both compare the baked manifest with the facts recorded at build time (the labels, or
``image.json`` inside the image) and every baked file with the checksum the manifest records.
Files are read through a created, never started container, so nothing in the image runs on the
host. A malformed label or an unreachable engine is an ``ImageError``; everything else (arch
mismatch, tampered manifest or artifact, no artifact for the model, a vLLM outside the plugin's
range) is a failed check.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from monodecode.errors import ArtifactError, MonodecodeError
from monodecode.jsonio import read_json_file
from monodecode.services.artifacts import MANIFEST, ArtifactStore, parse_manifest
from monodecode.services.platform import Platform
from monodecode_ops.base_vllm import supported_vllm, vllm_problem
from monodecode_ops.engine import connect, get_image, image_files
from monodecode_ops.labels import (
    ARCHS,
    DEFAULT_ARTIFACT_DIR,
    IMAGE_INFO_PATH,
    L_BUILD_KEYS,
    L_MANIFEST_DIGEST,
    ImageLabels,
)
from monodecode_ops.output import Check

if TYPE_CHECKING:
    import docker

    from monodecode.model.dims import ModelDims


# ---------------------------------------------------------------------------------------------
# What an image holds


@dataclass
class ImageContents:
    """Labels plus the baked files of one image (read once, checked by verify and shown by inspect)."""

    image: str
    image_id: str
    created: str
    size_bytes: int
    labels: ImageLabels
    all_labels: dict[str, str]
    manifest_text: str | None  # None when the image lacks artifact-dir/manifest.json
    image_info: dict[str, Any] | None
    artifact_problems: list[tuple[str, str | None]] = field(default_factory=list)  # (build key, problem)
    manifest_error: str | None = None
    entries: list[Any] = field(default_factory=list)

    @property
    def manifest_digest(self) -> str | None:
        if self.manifest_text is None:
            return None
        return "sha256:" + hashlib.sha256(self.manifest_text.encode()).hexdigest()

    def to_dict(self) -> dict[str, Any]:
        return {
            "image": self.image,
            "id": self.image_id,
            "created": self.created,
            "size_bytes": self.size_bytes,
            "labels": self.all_labels,
            "monodecode": self.labels.to_dict(),
            "image_info": self.image_info,
            "manifest": {
                "path": f"{self.labels.artifact_dir}/{MANIFEST}",
                "digest": self.manifest_digest,
                "error": self.manifest_error,
                "artifacts": [
                    {**e.to_dict(), "problem": dict(self.artifact_problems).get(e.build_key)} for e in self.entries
                ],
            },
        }


def read_image(image: str, client: docker.DockerClient | None = None) -> ImageContents:
    """Labels (validated; ``ImageError`` if bad) and baked files of ``image``, checksums verified."""
    client = client or connect()
    img = get_image(client, image)
    labels = ImageLabels.from_labels(image, img.labels)
    contents = ImageContents(
        image=image,
        image_id=img.id,
        created=img.attrs.get("Created", ""),
        size_bytes=int(img.attrs.get("Size", 0) or 0),
        labels=labels,
        all_labels=dict(img.labels or {}),
        manifest_text=None,
        image_info=None,
    )
    art_name = PurePosixPath(labels.artifact_dir).name
    with image_files(client, image, [labels.artifact_dir, IMAGE_INFO_PATH]) as tmp:
        info = tmp / PurePosixPath(IMAGE_INFO_PATH).name
        if info.is_file():
            try:
                contents.image_info = read_json_file(info, IMAGE_INFO_PATH)
            except MonodecodeError as e:
                contents.image_info = {"error": str(e)}
        store = ArtifactStore(tmp / art_name)
        if store.manifest_path.is_file():
            try:
                contents.manifest_text = store.manifest_path.read_bytes().decode()  # no newline translation
                contents.entries = parse_manifest(contents.manifest_text, f"{labels.artifact_dir}/{MANIFEST}")
            except (ArtifactError, UnicodeDecodeError) as e:
                contents.manifest_error = str(e) if isinstance(e, ArtifactError) else f"{MANIFEST} is not UTF-8"
            else:
                contents.artifact_problems = [(e.build_key, p) for e, p in store.verify_all()]
    return contents


# ---------------------------------------------------------------------------------------------
# verify --image


def _arch_check(labels: ImageLabels, platform: Platform) -> Check:
    name = "image arch"
    if platform.kind != "rocm":
        return Check.skipped(
            name,
            f"no AMD GPU on this node ({platform.kind}: {platform.name}); the image is for {labels.arch}",
            data={"image_arch": labels.arch, "node_arch": platform.arch},
        )
    if platform.arch not in ARCHS:
        return Check.failure(
            name,
            f"node GPU arch {platform.arch} is not one monodecode builds for ({', '.join(ARCHS)})",
            data={"image_arch": labels.arch, "node_arch": platform.arch},
        )
    if platform.arch != labels.arch:
        return Check.failure(
            name,
            f"image is built for {labels.arch}, this node's GPU is {platform.arch} ({platform.name}); "
            f"use the {platform.arch} image",
            data={"image_arch": labels.arch, "node_arch": platform.arch},
        )
    return Check.passed(
        name,
        f"{labels.arch} matches the node's GPU ({platform.name})",
        data={"image_arch": labels.arch, "node_arch": platform.arch},
    )


def vllm_check(labels: ImageLabels) -> Check:
    """The image's vLLM (its label) against the range the plugin supports."""
    name = "image vLLM"
    data = {"vllm_version": labels.vllm_version, "supported": supported_vllm()}
    if not labels.vllm_version:
        return Check.skipped(name, "the image has no vLLM: it can verify and run kernels, not serve", data=data)
    problem = vllm_problem(labels.vllm_version)
    if problem:
        return Check.failure(name, problem.replace("the base image has", "the image has"), data=data)
    return Check.passed(name, f"vLLM {labels.vllm_version}, one the plugin supports ({data['supported']})", data=data)


def _manifest_checks(c: ImageContents, prefix: str = "image", facts: str = "labels") -> list[Check]:
    """Manifest vs the recorded digest and build keys (``facts``: the labels, or image.json),
    then every artifact's files."""
    lab = c.labels
    digest_src = f"label {L_MANIFEST_DIGEST}" if facts == "labels" else f"{facts} manifest_digest"
    keys_src = f"label {L_BUILD_KEYS}" if facts == "labels" else f"{facts} build_keys"
    where = f"{lab.artifact_dir}/{MANIFEST}"
    if c.manifest_text is None:
        return [Check.failure(f"{prefix} manifest", f"{where} is missing from the image")]
    checks = []
    if c.manifest_digest != lab.manifest_digest:
        checks.append(
            Check.failure(
                f"{prefix} manifest",
                f"{where} has digest {c.manifest_digest[:19]}..., {digest_src} says {lab.manifest_digest[:19]}... "
                "(the manifest was changed after the build)",
                data={"actual": c.manifest_digest, "label": lab.manifest_digest},
            )
        )
    elif c.manifest_error:
        checks.append(Check.failure(f"{prefix} manifest", c.manifest_error))
    else:
        checks.append(
            Check.passed(
                f"{prefix} manifest",
                f"{where} matches {digest_src} ({lab.manifest_digest[:19]}...)",
                data={"digest": lab.manifest_digest},
            )
        )
    if c.manifest_error:
        return checks
    keys = {e.build_key for e in c.entries}
    if keys != set(lab.build_keys):
        only_m = sorted(k[:12] for k in keys - set(lab.build_keys))
        only_l = sorted(k[:12] for k in set(lab.build_keys) - keys)
        checks.append(
            Check.failure(
                f"{prefix} build keys",
                f"{keys_src} and the manifest disagree (only in the manifest: {', '.join(only_m) or '-'}; "
                f"only in {keys_src}: {', '.join(only_l) or '-'})",
            )
        )
    else:
        checks.append(Check.passed(f"{prefix} build keys", f"{len(keys)} build key(s) agree with the manifest"))
    problems = [(k, p) for k, p in c.artifact_problems if p]
    wrong_arch = [e for e in c.entries if e.arch != lab.arch]
    nfiles = sum(len(e.files) for e in c.entries)
    if problems:
        checks.append(
            Check.failure(
                f"{prefix} artifacts",
                f"{len(problems)} of {len(c.entries)} artifact(s) failed verification: {problems[0][1]}",
                data={"problems": [p for _, p in problems]},
            )
        )
    elif wrong_arch:
        checks.append(
            Check.failure(
                f"{prefix} artifacts",
                f"artifact {wrong_arch[0].build_key[:12]} is compiled for {wrong_arch[0].arch}, the image is labelled {lab.arch}",
            )
        )
    elif not c.entries:
        checks.append(
            Check.passed(
                f"{prefix} artifacts", f"no ahead-of-time artifacts baked (backends: {', '.join(lab.backends)})"
            )
        )
    else:
        checks.append(
            Check.passed(
                f"{prefix} artifacts",
                f"{len(c.entries)} artifact(s), {nfiles} file(s): sizes and sha256 verified",
                data={"artifacts": len(c.entries), "files": nfiles},
            )
        )
    return checks


def _model_check(c: ImageContents, platform: Platform, dims: ModelDims | None) -> Check:
    name = "image artifacts for model"
    # A missing kernel only matters where the image would run its AOT kernels.
    required = platform.kind == "rocm"
    if dims is None:
        return Check.skipped(
            name, f"no model given; the image bakes profiles {', '.join(c.labels.profiles)}", required=False
        )
    if c.manifest_error or c.manifest_text is None:
        return Check.failure(name, "the image's manifest is unreadable (see image manifest)", required=required)
    digest = dims.digest()
    hits = [e for e in c.entries if e.dims_digest == digest and e.arch == c.labels.arch]
    if hits:
        e = hits[0]
        return Check.passed(
            name,
            f"{', '.join(sorted({h.backend for h in hits}))} artifact(s) for this model "
            f"(profile {e.profile or '-'}, widths {list(e.widths)})",
            data={"build_keys": [h.build_key for h in hits]},
            required=required,
        )
    if not c.entries:
        return Check.skipped(
            name,
            f"the image bakes no ahead-of-time artifacts (backends: {', '.join(c.labels.backends)})",
            required=False,
        )
    return Check.failure(
        name,
        f"no artifact for this model's dims (digest {digest[:12]}) on {c.labels.arch}; "
        f"the image bakes profiles {', '.join(c.labels.profiles)}",
        required=required,
    )


def verify_image(
    image: str,
    platform: Platform,
    *,
    dims: ModelDims | None = None,
    client: docker.DockerClient | None = None,
) -> list[Check]:
    """Checks that ``image`` fits ``platform`` (and the model ``dims`` when given).

    Raises ``ImageError`` when the engine is unreachable, the image is missing or its labels are
    malformed; everything else (arch mismatch, tampered manifest or artifact, no artifact for
    the model) is a failed check.
    """
    c = read_image(image, client)
    lab = c.labels
    checks = [
        Check.passed(
            "image labels",
            f"{image}: monodecode {lab.version} for {lab.arch}, backends {', '.join(lab.backends)}, "
            f"profiles {', '.join(lab.profiles)}",
            data={"image": image, "id": c.image_id, **lab.to_dict()},
        )
    ]
    checks.append(_arch_check(lab, platform))
    checks.append(vllm_check(lab))
    checks.extend(_manifest_checks(c))
    checks.append(_model_check(c, platform, dims))
    return checks


# ---------------------------------------------------------------------------------------------
# verify inside an image


def artifact_dir_checks(art_dir: str | Path) -> list[Check]:
    """An artifact directory given to ``verify --artifact-dir``: it exists, its manifest parses
    and every entry's size and sha256 match. Checked on every node: a node whose backend reads
    no artifacts (no AMD GPU) would otherwise pass with a directory that is missing or broken."""
    store = ArtifactStore(art_dir)
    name = "artifact dir"
    if not store.root.is_dir():
        return [Check.failure(name, f"{store.root} is not a directory")]
    if not store.manifest_path.is_file():
        return [Check.failure(name, f"{store.root} has no {MANIFEST}")]
    try:
        results = store.verify_all()
    except ArtifactError as e:
        return [Check.failure(name, str(e))]
    bad = [f"{entry.build_key[:16]}: {problem}" for entry, problem in results if problem]
    if bad:
        return [Check.failure(name, f"{len(bad)} of {len(results)} entries fail: " + "; ".join(bad))]
    return [Check.passed(name, f"{store.root}: {len(results)} entries, every file's size and sha256 match")]


def baked_checks(info_path: str | Path | None = None) -> list[Check]:
    """Checks of the image ``verify`` runs in: its baked manifest against ``image.json`` (written
    at build time, the same facts as the labels) and every artifact's size and sha256.

    Returns [] outside a monodecode image (no ``$MONODECODE_IMAGE_INFO`` / ``image.json``).
    """
    path = Path(info_path or os.environ.get("MONODECODE_IMAGE_INFO") or IMAGE_INFO_PATH)
    try:
        info = read_json_file(path, str(path))
    except FileNotFoundError:
        return []
    except MonodecodeError as e:
        return [Check.failure("baked manifest", f"image facts unreadable: {e}")]
    try:
        art_dir = os.environ.get("MONODECODE_ARTIFACT_DIR") or DEFAULT_ARTIFACT_DIR
        labels = ImageLabels(
            arch=info["arch"],
            version=str(info["versions"]["monodecode"]),
            profiles=tuple(info["profiles"]),
            backends=tuple(info["backends"]),
            build_keys=tuple(info["build_keys"]),
            manifest_digest=info["manifest_digest"],
            artifact_dir=art_dir,
        )
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [Check.failure("baked manifest", f"{path} is unreadable or incomplete ({type(e).__name__}: {e})")]
    c = ImageContents(
        image="this image",
        image_id="",
        created="",
        size_bytes=0,
        labels=labels,
        all_labels={},
        manifest_text=None,
        image_info=info,
    )
    store = ArtifactStore(art_dir)
    if store.manifest_path.is_file():
        try:
            c.manifest_text = store.manifest_path.read_bytes().decode()
            c.entries = parse_manifest(c.manifest_text, str(store.manifest_path))
        except (ArtifactError, UnicodeDecodeError, OSError) as e:
            c.manifest_error = str(e)
        else:
            c.artifact_problems = [(e.build_key, p) for e, p in store.verify_all()]
    return _manifest_checks(c, prefix="baked", facts=str(path))
