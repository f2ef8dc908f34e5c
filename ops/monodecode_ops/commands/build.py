"""``monodecode-ops build``: one image per GPU arch from images/Dockerfile, with the Docker SDK.

Per arch the build runs twice against the same cache: first up to the ``artifacts`` stage, whose
baked manifest and image.json are read back, then the final stage with those facts as labels
(build keys, manifest digest, backends, versions). The second pass reuses every cached layer,
so only the labels are new. The log streams with a progress bar per arch; a failed step is one
``error:`` line naming the step with its last output lines.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import re
import shlex
import subprocess
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import typer
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.text import Text

from monodecode import __version__
from monodecode.errors import ArtifactError
from monodecode.model.profiles import PROFILES
from monodecode.services.artifacts import parse_manifest
from monodecode_ops import images as img
from monodecode_ops.images import ARCHS, BASE_IMAGES, ImageError
from monodecode_ops.output import console, emit_json, print_table

DOCKERFILE = "images/Dockerfile"
DOCKERIGNORE = "images/Dockerfile.dockerignore"
CA_IN_CONTEXT = "images/build-config/ca-bundle.crt"
ENV_IN_CONTEXT = "images/build-config/build.env"
DEFAULT_PROFILES = ("tiny", "llama3-8b", "qwen3-8b", "gemma3-27b")
DEFAULT_REPOSITORY = "vllm-monodecode"
BUILD_TIMEOUT_S = 6 * 3600  # a socket read may wait this long for a silent build step

_REPO = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*$")
_REGISTRY = re.compile(r"^[A-Za-z0-9.-]+(?::[0-9]+)?(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*$")
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,100}$")
_NETWORK = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_STEP = re.compile(r"^Step (\d+)/(\d+) : (.*)$")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# Builder chatter that says nothing about why a step failed.
_NOISE = re.compile(r"^(--->|Removing intermediate container|Successfully (built|tagged))")


# ---------------------------------------------------------------------------------------------
# The plan (pure; what --dry-run prints)


@dataclass
class ArchPlan:
    arch: str
    base_image: str
    tag: str
    build_args: dict[str, str]  # Dockerfile ARGs (BASE_IMAGE, GFX_ARCH, PROFILES)


@dataclass
class BuildPlan:
    source: str
    archs: list[ArchPlan]
    profiles: list[str]
    network: str
    push: bool
    pull_base: bool
    ca_bundle: str | None
    extras: str
    pip_index_url: str | None
    vcs_ref: str
    source_url: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _expand_archs(values: list[str]) -> list[str]:
    out: list[str] = []
    for v in values or ["all"]:
        for a in (x.strip() for x in v.split(",")):
            if a == "all":
                out.extend(ARCHS)
            elif a in ARCHS:
                out.append(a)
            else:
                raise ImageError(f"unknown arch {a!r} (choose {', '.join(ARCHS)} or all)")
    return list(dict.fromkeys(out))


def _check_profiles(values: list[str]) -> list[str]:
    profiles = list(dict.fromkeys(p.strip() for v in values for p in v.split(",") if p.strip()))
    if not profiles:
        raise ImageError("no model profile given (--profile NAME)")
    for p in profiles:
        if p not in PROFILES:
            raise ImageError(f"unknown profile {p!r} (known: {', '.join(PROFILES)})")
    return profiles


def find_source(source: Path | None) -> Path:
    """The repository checkout to build from (default: the one this CLI is installed from)."""
    if source is None:
        import monodecode

        source = Path(monodecode.__file__).resolve().parent.parent
        if not (source / DOCKERFILE).is_file():
            source = Path.cwd()
    source = source.resolve()
    for rel in (DOCKERFILE, "pyproject.toml", "monodecode"):
        if not (source / rel).exists():
            raise ImageError(f"{source} is not a monodecode checkout ({rel} is missing); pass --source DIR")
    return source


def _vcs_ref(source: Path) -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(source), "describe", "--always", "--dirty", "--abbrev=12"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def image_ref(repository: str, registry: str | None, tag: str | None, arch: str) -> str:
    name = f"{registry.rstrip('/')}/{repository}" if registry else repository
    return f"{name}:{tag or __version__}-{arch}"


def make_plan(
    *,
    archs: list[str],
    base_image: str | None,
    profiles: list[str],
    repository: str,
    registry: str | None,
    tag: str | None,
    push: bool,
    network: str,
    ca_bundle: Path | None,
    pip_index_url: str | None,
    pull_base: bool,
    extras: str,
    source: Path | None,
    source_url: str,
) -> BuildPlan:
    arch_list = _expand_archs(archs)
    profile_list = _check_profiles(profiles)
    if not _REPO.match(repository):
        raise ImageError(f"--repository {repository!r} is not a valid image repository name (lowercase, a-z0-9._-/)")
    if registry is not None and not _REGISTRY.match(registry.rstrip("/")):
        raise ImageError(f"--registry {registry!r} is not a registry host[:port][/namespace]")
    if tag is not None and not _TAG.match(tag):
        raise ImageError(f"--tag {tag!r} is not a valid tag (letters, digits, _ . -; at most 100 characters)")
    if push and not registry:
        raise ImageError("--push needs --registry (where to push, e.g. ghcr.io/acme)")
    if not _NETWORK.match(network):
        raise ImageError(f"--network {network!r} is not a Docker network name (host, default, none, ...)")
    if base_image is not None and (not base_image.strip() or any(ch.isspace() for ch in base_image)):
        raise ImageError(f"--base-image {base_image!r} is not an image reference")
    if not re.fullmatch(r"[a-z0-9_-]+(,[a-z0-9_-]+)*", extras):
        raise ImageError(f"--extras {extras!r} must be comma-separated extra names (e.g. ops,flydsl)")
    ca = None
    if ca_bundle is not None:
        try:
            text = ca_bundle.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ImageError(f"--ca-bundle {ca_bundle}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
        if "-----BEGIN CERTIFICATE-----" not in text:
            raise ImageError(f"--ca-bundle {ca_bundle}: no PEM certificate in it")
        ca = str(ca_bundle.resolve())
    if pip_index_url is not None and not re.fullmatch(r"https?://\S+", pip_index_url):
        raise ImageError(f"--pip-index-url {pip_index_url!r} is not an http(s) URL")
    src = find_source(source)
    plans = []
    for arch in arch_list:
        base = base_image or BASE_IMAGES[arch].ref
        plans.append(
            ArchPlan(
                arch=arch,
                base_image=base,
                tag=image_ref(repository, registry, tag, arch),
                build_args={"BASE_IMAGE": base, "GFX_ARCH": arch, "PROFILES": ",".join(profile_list)},
            )
        )
    return BuildPlan(
        source=str(src),
        archs=plans,
        profiles=profile_list,
        network=network,
        push=push,
        pull_base=pull_base,
        ca_bundle=ca,
        extras=extras,
        pip_index_url=pip_index_url,
        vcs_ref=_vcs_ref(src),
        source_url=source_url,
    )


# ---------------------------------------------------------------------------------------------
# Running it


def build_env(plan: BuildPlan) -> str:
    """images/build-config/build.env: settings only the wheels stage reads (no ARG steps)."""
    env = {"MONODECODE_EXTRAS": plan.extras}
    if plan.pip_index_url:
        env["PIP_INDEX_URL"] = plan.pip_index_url
    return "".join(f"{k}={shlex.quote(v)}\n" for k, v in env.items())


def build_context(plan: BuildPlan):
    """The build context as an uncompressed tar (a temp file), allowlisted by DOCKERIGNORE."""
    from docker.utils.build import create_archive, exclude_paths

    source = Path(plan.source)
    patterns = [
        line.strip()
        for line in (source / DOCKERIGNORE).read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    files = sorted(exclude_paths(str(source), patterns, dockerfile=DOCKERFILE))
    extra = [(ENV_IN_CONTEXT, build_env(plan))]
    if plan.ca_bundle:
        extra.append((CA_IN_CONTEXT, Path(plan.ca_bundle).read_text()))
    return create_archive(str(source), files=files, extra_files=extra)


@dataclass
class BaseInfo:
    ref: str
    digest: str
    image_id: str


def ensure_base(client, ref: str, pull: bool) -> BaseInfo:
    import docker

    try:
        image = client.images.get(ref)
    except docker.errors.ImageNotFound:
        if not pull:
            raise ImageError(
                f"base image {ref} is not in the Docker engine (pull it first, or drop --no-pull)"
            ) from None
        try:
            image = client.images.pull(img.pull_ref(ref))
        except docker.errors.APIError as e:
            raise ImageError(
                f"base image {ref} is not in the Docker engine and pulling it failed: {img._reason(e)}"
            ) from None
    except docker.errors.APIError as e:
        raise ImageError(f"cannot look up base image {ref}: {img._reason(e)}") from None
    if "@" in ref:
        digest = ref.split("@", 1)[1]
    else:
        repo_digests = image.attrs.get("RepoDigests") or []
        digest = repo_digests[0].split("@", 1)[1] if repo_digests else image.id  # local image: its id
    return BaseInfo(ref=ref, digest=digest, image_id=image.id)


class BuildStepFailed(ImageError):
    pass


@dataclass
class _StreamState:
    arch: str
    step: str = ""
    step_no: int = 0
    steps: int = 0
    tail: deque = field(default_factory=lambda: deque(maxlen=20))


def _one_line(s: str, limit: int = 240) -> str:
    s = " ".join(s.split())
    return s if len(s) <= limit else s[: limit - 3] + "..."


def run_build(
    client,
    context,
    *,
    arch: str,
    target: str,
    tag: str | None,
    build_args: dict[str, str],
    labels: dict[str, str] | None,
    network: str,
    progress: Progress,
    task,
    offset: int,
) -> tuple[str, int]:
    """One ``docker build`` through the SDK; returns (image id, steps it had)."""
    import docker

    context.seek(0)
    st = _StreamState(arch)
    image_id = None
    try:
        stream = client.api.build(
            fileobj=context,
            custom_context=True,
            dockerfile=DOCKERFILE,
            target=target,
            tag=tag,
            buildargs=build_args,
            labels=labels,
            network_mode=network,
            rm=True,
            forcerm=True,
            decode=True,
            pull=False,
        )
        for chunk in stream:
            if "error" in chunk:
                detail = chunk.get("errorDetail", {}).get("message") or chunk["error"]
                last = [ln for ln in st.tail if ln.strip() and not _NOISE.match(ln.strip())][-3:]
                where = f"step {st.step_no}/{st.steps} ({_one_line(st.step, 90)})" if st.step_no else "the start"
                raise BuildStepFailed(
                    f"build for {arch} failed at {where}: {_one_line(detail, 300)}"
                    + (f"; last output: {' | '.join(_one_line(ln, 160) for ln in last)}" if last else "")
                )
            if "aux" in chunk and isinstance(chunk["aux"], dict) and "ID" in chunk["aux"]:
                image_id = chunk["aux"]["ID"]
            text = chunk.get("stream")
            if not text:
                continue
            for line in _ANSI.sub("", text).splitlines():
                if not line.strip():
                    continue
                m = _STEP.match(line.strip())
                if m:
                    st.step_no, st.steps, st.step = int(m.group(1)), int(m.group(2)), m.group(3)
                    st.tail.clear()
                    progress.update(
                        task,
                        total=offset + st.steps,
                        completed=offset + st.step_no - 1,
                        description=_one_line(f"{target}: {st.step}", 70),
                    )
                else:
                    st.tail.append(line)
                    mm = re.match(r"^Successfully built ([0-9a-f]+)$", line.strip())
                    if mm and image_id is None:
                        image_id = mm.group(1)
                progress.console.print(Text(f"{arch} | {line}", style="dim"), soft_wrap=True)
    except docker.errors.APIError as e:
        raise ImageError(f"build for {arch} ({target}) was refused by the Docker engine: {img._reason(e)}") from None
    except (docker.errors.DockerException, OSError) as e:
        raise ImageError(f"build for {arch} ({target}) lost the Docker engine: {img._reason(e)}") from None
    if image_id is None:
        raise ImageError(f"build for {arch} ({target}) ended without an image id")
    progress.update(task, completed=offset + st.steps)
    return image_id, st.steps


def read_build_outputs(client, artifacts_image: str) -> dict[str, Any]:
    """image.json of the artifacts stage, cross-checked against its manifest."""
    with img.image_files(client, artifacts_image, ["/out/image.json", "/out/artifacts"]) as tmp:
        info_path, manifest = tmp / "image.json", tmp / "artifacts" / "manifest.json"
        if not info_path.is_file() or not manifest.is_file():
            raise ImageError("the precompile stage produced no /out/image.json or /out/artifacts/manifest.json")
        try:
            info = json.loads(info_path.read_text())
            text = manifest.read_bytes().decode()  # bytes as written: the digest is over them
        except (ValueError, UnicodeDecodeError) as e:
            raise ImageError(f"the precompile stage wrote an unreadable image.json or manifest.json: {e}") from None
    missing = [k for k in ("backends", "build_keys", "manifest_digest") if k not in info]
    if missing:
        raise ImageError(f"the precompile stage's image.json lacks {', '.join(missing)}")
    try:
        entries = parse_manifest(text, "baked manifest.json")
    except ArtifactError as e:
        raise ImageError(f"the precompile stage wrote a bad manifest: {e}") from None
    digest = "sha256:" + hashlib.sha256(text.encode()).hexdigest()
    if digest != info.get("manifest_digest") or sorted(e.build_key for e in entries) != info.get("build_keys"):
        raise ImageError("the precompile stage's image.json does not match its manifest.json")
    return info


def image_labels(plan: BuildPlan, p: ArchPlan, info: dict[str, Any], base: BaseInfo) -> dict[str, str]:
    """Every label of the final image (images/README.md says what each means)."""
    versions = info.get("versions") or {}
    labels = {
        img.OCI + "title": "vllm-monodecode",
        img.OCI + "description": f"vLLM with monodecode decode megakernels for AMD Instinct {p.arch}",
        img.OCI + "version": __version__,
        img.OCI + "revision": plan.vcs_ref,
        img.OCI + "created": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        img.OCI + "licenses": "Apache-2.0",
        img.OCI + "vendor": "monodecode",
        img.OCI + "base.name": base.ref,
        img.OCI + "base.digest": base.digest,
        img.L_ARCH: p.arch,
        img.L_VERSION: __version__,
        img.L_PROFILES: ",".join(plan.profiles),
        img.L_BACKENDS: ",".join(info["backends"]),
        img.L_BUILD_KEYS: ",".join(info["build_keys"]),
        img.L_MANIFEST_DIGEST: info["manifest_digest"],
        img.L_COMPILERS: ",".join(info.get("compilers") or []),
        img.L_ARTIFACT_DIR: img.DEFAULT_ARTIFACT_DIR,
        img.L_VLLM: versions.get("vllm") or "",
        img.L_TORCH: versions.get("torch") or "",
    }
    if plan.source_url:
        labels[img.OCI + "source"] = plan.source_url
    return labels


def push_image(client, ref: str) -> None:
    import docker

    repo, tag = ref.rsplit(":", 1)
    try:
        for chunk in client.images.push(repo, tag=tag, stream=True, decode=True):
            if "error" in chunk:
                raise ImageError(f"push of {ref} failed: {_one_line(chunk['error'])}")
    except docker.errors.APIError as e:
        raise ImageError(f"push of {ref} failed: {img._reason(e)}") from None


def execute(plan: BuildPlan) -> list[dict[str, Any]]:
    client = img.connect(timeout=BUILD_TIMEOUT_S)
    bases = {p.base_image: ensure_base(client, p.base_image, plan.pull_base) for p in plan.archs}
    context = build_context(plan)
    results = []
    err = console(stderr=True)
    columns = (
        SpinnerColumn(),
        TextColumn("[bold]{task.fields[arch]}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} steps"),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
    )
    try:
        with Progress(*columns, console=err, transient=False) as progress:
            for p in plan.archs:
                task = progress.add_task("waiting", arch=p.arch, total=None)
                base = bases[p.base_image]
                stage_id, n1 = run_build(
                    client,
                    context,
                    arch=p.arch,
                    target="artifacts",
                    tag=None,
                    build_args=p.build_args,
                    labels=None,
                    network=plan.network,
                    progress=progress,
                    task=task,
                    offset=0,
                )
                info = read_build_outputs(client, stage_id)
                image_id, _ = run_build(
                    client,
                    context,
                    arch=p.arch,
                    target="final",
                    tag=p.tag,
                    build_args=p.build_args,
                    labels=image_labels(plan, p, info, base),
                    network=plan.network,
                    progress=progress,
                    task=task,
                    offset=n1,
                )
                progress.update(task, description=f"built {p.tag}")
                pushed = False
                if plan.push:
                    progress.update(task, description=f"pushing {p.tag}")
                    push_image(client, p.tag)
                    pushed = True
                    progress.update(task, description=f"pushed {p.tag}")
                labels = client.images.get(image_id).labels or {}
                results.append(
                    {
                        "arch": p.arch,
                        "tag": p.tag,
                        "id": image_id,
                        "base_image": p.base_image,
                        "base_digest": base.digest,
                        "pushed": pushed,
                        "labels": labels,
                        "image_info": info,
                    }
                )
    finally:
        context.close()
    return results


# ---------------------------------------------------------------------------------------------
# CLI


def build(
    arch: list[str] = typer.Option(["all"], "--arch", "-a", help="gfx942, gfx950 or all (repeatable)."),
    base_image: Optional[str] = typer.Option(
        None, "--base-image", help="Base image for every arch (default: the pinned ROCm vLLM image of each arch)."
    ),
    profile: list[str] = typer.Option(
        list(DEFAULT_PROFILES), "--profile", "-p", help="Model profile to precompile kernels for (repeatable)."
    ),
    repository: str = typer.Option(DEFAULT_REPOSITORY, "--repository", help="Image repository name."),
    registry: Optional[str] = typer.Option(None, "--registry", help="Registry host[/namespace] to tag (and push) for."),
    tag: Optional[str] = typer.Option(
        None, "--tag", help="Tag stem (default: the monodecode version); -ARCH is appended."
    ),
    push: bool = typer.Option(False, "--push", help="Push each image after it is built (needs --registry)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan and build nothing."),
    network: str = typer.Option("host", "--network", help="Network for RUN steps (host works without a bridge)."),
    ca_bundle: Optional[Path] = typer.Option(
        None, "--ca-bundle", help="Extra CA bundle for pip in the build (not shipped in the image)."
    ),
    pip_index_url: Optional[str] = typer.Option(None, "--pip-index-url", help="Python package index for the build."),
    pull: bool = typer.Option(True, "--pull/--no-pull", help="Pull a base image the engine does not have."),
    extras: str = typer.Option("ops,flydsl", "--extras", help="monodecode extras to install in the image."),
    source: Optional[Path] = typer.Option(None, "--source", help="Repository checkout to build from."),
    source_url: str = typer.Option("", "--source-url", help="org.opencontainers.image.source value."),
    as_json: bool = typer.Option(False, "--json", help="Print the result (or plan) as JSON."),
) -> None:
    """Build the monodecode image for each arch (Docker SDK), label it, optionally push it."""
    plan = make_plan(
        archs=arch,
        base_image=base_image,
        profiles=profile,
        repository=repository,
        registry=registry,
        tag=tag,
        push=push,
        network=network,
        ca_bundle=ca_bundle,
        pip_index_url=pip_index_url,
        pull_base=pull,
        extras=extras,
        source=source,
        source_url=source_url,
    )
    if dry_run:
        if as_json:
            emit_json({"dry_run": True, "plan": plan.to_dict()})
            return
        rows = []
        for p in plan.archs:
            rows += [(p.arch, "tag", p.tag), ("", "base image", p.base_image)]
        rows += [
            ("all", "profiles", ",".join(plan.profiles)),
            ("", "push", "yes" if plan.push else "no"),
            ("", "source", f"{plan.source} ({plan.vcs_ref})"),
            ("", "RUN network", plan.network),
            ("", "extras", plan.extras),
            ("", "pip index", plan.pip_index_url or "default"),
            ("", "CA bundle", plan.ca_bundle or "none"),
        ]
        print_table("build plan (dry run: nothing is built)", ["arch", "setting", "value"], rows)
        return
    results = execute(plan)
    if as_json:
        emit_json({"images": results})
        return
    print_table(
        "built images",
        ["arch", "tag", "image id", "backends", "build keys", "pushed"],
        [
            (
                r["arch"],
                r["tag"],
                r["id"].split(":")[-1][:12],
                r["labels"].get(img.L_BACKENDS, ""),
                len([k for k in r["labels"].get(img.L_BUILD_KEYS, "").split(",") if k]),
                "yes" if r["pushed"] else "no",
            )
            for r in results
        ],
    )
    console().print("check one: monodecode-ops inspect TAG; monodecode-ops verify --image TAG")


def register(app: typer.Typer) -> None:
    app.command("build")(build)
