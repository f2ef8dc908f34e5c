"""``monodecode-ops build``: one image per GPU arch from images/Dockerfile, with the Docker SDK.

Every base is used pinned (``monodecode_ops.bases``): by the digest in its reference, by the
digest its registry serves for the tag (resolved when the plan is made, ``--dry-run`` included),
or, with ``--local-base``, by the image id of an image built in this engine; an unpinnable base
is refused. Per arch the build runs twice against the same cache: first up to the ``artifacts``
stage, whose baked manifest and image.json are read back, then the final stage with those facts
as labels (``ImageLabels.to_labels``). The second pass reuses every cached layer, so only the
labels are new. The log streams with a progress bar per arch; a failed step is one ``error:``
line naming the step with its last output lines. Credentials in ``--pip-index-url`` never reach
the terminal or the JSON plan.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import re
import shlex
import subprocess
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlsplit, urlunsplit

import typer
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.text import Text

from monodecode import __version__
from monodecode.errors import ArtifactError
from monodecode.jsonio import read_json_file
from monodecode.services.artifacts import parse_manifest
from monodecode_ops.bases import BASE_IMAGES, PinnedBase, parse_reference, pin_base
from monodecode_ops.engine import connect, image_files, pull_ref, reason
from monodecode_ops.labels import ARCHS, DEFAULT_ARTIFACT_DIR, L_BACKENDS, L_BUILD_KEYS, ImageError, ImageLabels
from monodecode_ops.options import BuildArch, BuildArchsOpt, Network, NetworkOpt, Profile, ProfilesOpt
from monodecode_ops.output import console, emit_json, json_output, print_table

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
_STEP = re.compile(r"^Step (\d+)/(\d+) : (.*)$")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# Builder chatter that says nothing about why a step failed.
_NOISE = re.compile(r"^(--->|Removing intermediate container|Successfully (built|tagged))")


# ---------------------------------------------------------------------------------------------
# The plan (pure; what --dry-run prints)


@dataclass
class ArchPlan:
    arch: str
    base_image: str  # as asked for (the default of the arch, or --base-image)
    tag: str
    profiles: list[str]
    base: PinnedBase | None = None  # set by pin_bases

    @property
    def build_args(self) -> dict[str, str]:
        """Dockerfile ARGs: the base only ever as pinned."""
        if self.base is None:
            raise ImageError(f"base image {self.base_image} of {self.arch} is not pinned yet")
        return {"BASE_IMAGE": self.base.use, "GFX_ARCH": self.arch, "PROFILES": ",".join(self.profiles)}

    def to_dict(self) -> dict[str, Any]:
        return {
            "arch": self.arch,
            "base_image": self.base_image,
            "base": asdict(self.base) if self.base else None,
            "tag": self.tag,
            "build_args": self.build_args,
        }


@dataclass
class BuildPlan:
    source: str
    archs: list[ArchPlan]
    profiles: list[str]
    network: str
    push: bool
    pull_base: bool
    local_base: bool
    ca_bundle: str | None
    extras: str
    pip_index_url: str | None  # with any credentials: only build.env sees it
    vcs_ref: str
    source_url: str

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k != "archs"}
        d["archs"] = [p.to_dict() for p in self.archs]
        d["pip_index_url"] = redact_url(self.pip_index_url) if self.pip_index_url else None
        return d


def redact_url(url: str) -> str:
    """``url`` without its credentials, for anything printed: ``https://user:***@host/...``, and
    ``https://***@host/...`` when the user part alone is the secret (a token)."""
    try:
        parts = urlsplit(url)
        if "@" not in parts.netloc:
            return url
        host = parts.netloc.rsplit("@", 1)[-1]
        shown = f"{parts.username}:***" if parts.password is not None and parts.username else "***"
        return urlunsplit(parts._replace(netloc=f"{shown}@{host}"))
    except ValueError:  # unparseable: show nothing of it
        return "<unparseable URL>"


def _expand_archs(values: list[BuildArch]) -> list[str]:
    out: list[str] = []
    for v in values or [BuildArch("all")]:
        out.extend(ARCHS if v.value == "all" else [v.value])
    return list(dict.fromkeys(out))


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
    local_base: bool = False,
) -> BuildPlan:
    """The checked plan (no engine needed); ``pin_bases`` then pins its bases."""
    arch_list = _expand_archs(archs)
    profile_list = list(dict.fromkeys(Profile(p).value for p in profiles))
    if not profile_list:
        raise ImageError("no model profile given (--profile NAME)")
    if not _REPO.match(repository):
        raise ImageError(f"--repository {repository!r} is not a valid image repository name (lowercase, a-z0-9._-/)")
    if registry is not None and not _REGISTRY.match(registry.rstrip("/")):
        raise ImageError(f"--registry {registry!r} is not a registry host[:port][/namespace]")
    if tag is not None and not _TAG.match(tag):
        raise ImageError(f"--tag {tag!r} is not a valid tag (letters, digits, _ . -; at most 100 characters)")
    if push and not registry:
        raise ImageError("--push needs --registry (where to push, e.g. ghcr.io/acme)")
    network = Network(network).value
    if base_image is not None:
        parse_reference(base_image)
    if local_base and base_image is None:
        raise ImageError("--local-base needs --base-image (the local image to build on)")
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
    if pip_index_url is not None and not re.fullmatch(r"https?://[^\s'\\]+", pip_index_url):
        raise ImageError(f"--pip-index-url {redact_url(pip_index_url)!r} is not an http(s) URL")
    src = find_source(source)
    plans = [
        ArchPlan(
            arch=arch,
            base_image=base_image or BASE_IMAGES[arch].ref,
            tag=image_ref(repository, registry, tag, arch),
            profiles=profile_list,
        )
        for arch in arch_list
    ]
    return BuildPlan(
        source=str(src),
        archs=plans,
        profiles=profile_list,
        network=network,
        push=push,
        pull_base=pull_base,
        local_base=local_base,
        ca_bundle=ca,
        extras=extras,
        pip_index_url=pip_index_url,
        vcs_ref=_vcs_ref(src),
        source_url=source_url,
    )


def pin_bases(plan: BuildPlan, client=None):
    """Pin every base of ``plan`` (``bases.pin_base``); the engine is needed only for a base
    without a digest in its reference. Returns the client it used (or None)."""
    for p in plan.archs:
        if parse_reference(p.base_image).pinned:
            p.base = PinnedBase(
                ref=p.base_image, use=p.base_image, digest=parse_reference(p.base_image).digest, how="reference"
            )
    todo = [p for p in plan.archs if p.base is None]
    if todo and client is None:
        try:
            client = connect(timeout=BUILD_TIMEOUT_S)
        except ImageError as e:
            raise ImageError(
                f"base image {todo[0].base_image} has no digest; pinning it needs the Docker engine: {e}"
            ) from None
    pinned: dict[str, PinnedBase] = {}
    for p in todo:
        if p.base_image not in pinned:
            pinned[p.base_image] = pin_base(client, p.base_image, local=plan.local_base)
        p.base = pinned[p.base_image]
    return client


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


def ensure_base(client, ref: str, pull: bool) -> None:
    """The base ``ref`` (pinned: name@digest or a local image id) in the engine, pulled if allowed."""
    import docker

    try:
        client.images.get(ref)
    except docker.errors.ImageNotFound:
        if not pull:
            raise ImageError(
                f"base image {ref} is not in the Docker engine (pull it first, or drop --no-pull)"
            ) from None
        try:
            client.images.pull(pull_ref(ref))
        except docker.errors.APIError as e:
            raise ImageError(
                f"base image {ref} is not in the Docker engine and pulling it failed: {reason(e)}"
            ) from None
    except docker.errors.APIError as e:
        raise ImageError(f"cannot look up base image {ref}: {reason(e)}") from None


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
        raise ImageError(f"build for {arch} ({target}) was refused by the Docker engine: {reason(e)}") from None
    except (docker.errors.DockerException, OSError) as e:
        raise ImageError(f"build for {arch} ({target}) lost the Docker engine: {reason(e)}") from None
    if image_id is None:
        raise ImageError(f"build for {arch} ({target}) ended without an image id")
    progress.update(task, completed=offset + st.steps)
    return image_id, st.steps


def read_build_outputs(client, artifacts_image: str) -> dict[str, Any]:
    """image.json of the artifacts stage, cross-checked against its manifest."""
    with image_files(client, artifacts_image, ["/out/image.json", "/out/artifacts"]) as tmp:
        info_path, manifest = tmp / "image.json", tmp / "artifacts" / "manifest.json"
        if not info_path.is_file() or not manifest.is_file():
            raise ImageError("the precompile stage produced no /out/image.json or /out/artifacts/manifest.json")
        info = read_json_file(info_path, "the precompile stage's image.json", ImageError)
        try:
            text = manifest.read_bytes().decode()  # bytes as written: the digest is over them
        except UnicodeDecodeError:
            raise ImageError("the precompile stage wrote a manifest.json that is not UTF-8") from None
    if not isinstance(info, dict):
        raise ImageError("the precompile stage's image.json is not a JSON object")
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


def image_labels(plan: BuildPlan, p: ArchPlan, info: dict[str, Any]) -> ImageLabels:
    """The facts of the final image (``ImageLabels.to_labels()`` writes them as labels)."""
    versions = info.get("versions") or {}
    return ImageLabels(
        arch=p.arch,
        version=__version__,
        profiles=tuple(plan.profiles),
        backends=tuple(info["backends"]),
        build_keys=tuple(info["build_keys"]),
        manifest_digest=info["manifest_digest"],
        artifact_dir=DEFAULT_ARTIFACT_DIR,
        compilers=tuple(info.get("compilers") or []),
        vllm_version=versions.get("vllm") or "",
        torch_version=versions.get("torch") or "",
        base_name=p.base_image,
        base_digest=p.base.digest,
        revision=plan.vcs_ref,
        created=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        source=plan.source_url,
    )


def push_image(client, ref: str) -> None:
    import docker

    repo, tag = ref.rsplit(":", 1)
    try:
        for chunk in client.images.push(repo, tag=tag, stream=True, decode=True):
            if "error" in chunk:
                raise ImageError(f"push of {ref} failed: {_one_line(chunk['error'])}")
    except docker.errors.APIError as e:
        raise ImageError(f"push of {ref} failed: {reason(e)}") from None


def check_final_manifest(client, p: ArchPlan, image_id: str, info: dict[str, Any]) -> None:
    """The labels were computed from the first pass's manifest; the final image must carry that
    same manifest. If the kernels were rebuilt in between (the layer cache pruned meanwhile), the
    labelled image would describe other files: it is removed and the build fails."""
    where = f"{DEFAULT_ARTIFACT_DIR}/manifest.json"
    with image_files(client, image_id, [where]) as tmp:
        path = tmp / "manifest.json"
        digest = "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "none"
    if digest != info["manifest_digest"]:
        with contextlib.suppress(Exception):
            client.images.remove(p.tag, force=True)
        raise ImageError(
            f"build for {p.arch}: the final image's {where} ({digest[:19]}...) is not the one its labels were "
            f"computed from ({info['manifest_digest'][:19]}...): the kernels were rebuilt between the two passes "
            "(was the build cache pruned meanwhile?); build again"
        )


def execute(plan: BuildPlan, client=None) -> list[dict[str, Any]]:
    client = client or connect(timeout=BUILD_TIMEOUT_S)
    for use in dict.fromkeys(p.base.use for p in plan.archs):
        ensure_base(client, use, plan.pull_base)
    context = build_context(plan)
    results = []
    err = console(stderr=True)
    columns = (
        SpinnerColumn(),
        TextColumn("{task.fields[arch]}", style="bold", markup=False),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} steps"),
        TimeElapsedColumn(),
        TextColumn("{task.description}", markup=False),  # build output: text, never markup
    )
    try:
        with Progress(*columns, console=err, transient=False) as progress:
            for p in plan.archs:
                task = progress.add_task("waiting", arch=p.arch, total=None)
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
                    labels=image_labels(plan, p, info).to_labels(),
                    network=plan.network,
                    progress=progress,
                    task=task,
                    offset=n1,
                )
                check_final_manifest(client, p, image_id, info)
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
                        "base_digest": p.base.digest,
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
    arch: BuildArchsOpt = [BuildArch("all")],
    base_image: Optional[str] = typer.Option(
        None,
        "--base-image",
        help="Base image for every arch (default: the upstream vLLM ROCm image). Used pinned: "
        "name:tag@sha256:DIGEST, or a tag the registry resolves to its digest now.",
    ),
    local_base: bool = typer.Option(
        False, "--local-base", help="--base-image is an image of this Docker engine: pin it by its image id."
    ),
    profile: ProfilesOpt = [Profile(p) for p in DEFAULT_PROFILES],
    repository: str = typer.Option(DEFAULT_REPOSITORY, "--repository", help="Image repository name."),
    registry: Optional[str] = typer.Option(
        None, "--registry", help="Registry host[:port][/namespace] to tag (and push) for."
    ),
    tag: Optional[str] = typer.Option(
        None, "--tag", help="Tag stem (default: the monodecode version); -ARCH is appended."
    ),
    push: bool = typer.Option(False, "--push", help="Push each image after it is built (needs --registry)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Check and pin everything, print the plan, build nothing."),
    network: NetworkOpt = Network.host,
    ca_bundle: Optional[Path] = typer.Option(
        None, "--ca-bundle", help="Extra CA bundle for pip in the build (not shipped in the image)."
    ),
    pip_index_url: Optional[str] = typer.Option(
        None, "--pip-index-url", help="Python package index for the build (credentials are never printed)."
    ),
    pull: bool = typer.Option(True, "--pull/--no-pull", help="Pull a base image the engine does not have."),
    extras: str = typer.Option("ops,flydsl", "--extras", help="monodecode extras to install in the image."),
    source: Optional[Path] = typer.Option(None, "--source", help="Repository checkout to build from."),
    source_url: str = typer.Option("", "--source-url", help="org.opencontainers.image.source value."),
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
        network=network.value,
        ca_bundle=ca_bundle,
        pip_index_url=pip_index_url,
        pull_base=pull,
        extras=extras,
        source=source,
        source_url=source_url,
        local_base=local_base,
    )
    client = pin_bases(plan)
    if dry_run:
        if json_output():
            emit_json({"dry_run": True, "plan": plan.to_dict()})
            return
        rows = []
        for p in plan.archs:
            rows += [(p.arch, "tag", p.tag), ("", "base image", p.base.use), ("", "base pinned by", p.base.how)]
        rows += [
            ("all", "profiles", ",".join(plan.profiles)),
            ("", "push", "yes" if plan.push else "no"),
            ("", "source", f"{plan.source} ({plan.vcs_ref})"),
            ("", "RUN network", plan.network),
            ("", "extras", plan.extras),
            ("", "pip index", redact_url(plan.pip_index_url) if plan.pip_index_url else "default"),
            ("", "CA bundle", plan.ca_bundle or "none"),
        ]
        print_table("build plan (dry run: nothing is built)", ["arch", "setting", "value"], rows)
        return
    results = execute(plan, client)
    if json_output():
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
                r["labels"].get(L_BACKENDS, ""),
                len([k for k in r["labels"].get(L_BUILD_KEYS, "").split(",") if k]),
                "yes" if r["pushed"] else "no",
            )
            for r in results
        ],
    )
    console().print("check one: monodecode-ops inspect TAG; monodecode-ops verify --image TAG")


def register(app: typer.Typer) -> None:
    app.command("build")(build)
