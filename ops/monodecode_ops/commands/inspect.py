"""``monodecode-ops inspect IMAGE``: what a monodecode image carries.

Labels (with what each means), the baked manifest (build keys, backends, profiles, widths,
compilers, files) with every file's checksum verified, and the image's versions file. A table
for people, ``--json`` for machines. An image without valid monodecode labels is one
``error:`` line.
"""

from __future__ import annotations

import typer
from rich.text import Text

from monodecode_ops.image_checks import read_image
from monodecode_ops.labels import OCI, PREFIX
from monodecode_ops.output import console, emit_json, json_output, table


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return str(n)


def inspect(
    image: str = typer.Argument(..., help="Image reference (repository:tag, id or repository@digest)."),
) -> None:
    """Show an image's labels, baked manifest, artifacts and build keys."""
    c = read_image(image)
    if json_output():
        emit_json(c.to_dict())
        return
    con = console()
    lab = c.labels
    con.print(
        Text.assemble(
            (image, "bold"), f"  id {c.image_id.split(':')[-1][:12]}  {_size(c.size_bytes)}  created {c.created[:19]}"
        )
    )
    rows = [(k, v) for k, v in sorted(c.all_labels.items()) if k.startswith(PREFIX) or k.startswith(OCI)]
    con.print(table("labels (meanings: images/README.md)", ["label", "value"], rows))
    if c.manifest_text is None:
        con.print(Text(f"no manifest at {lab.artifact_dir}/manifest.json", style="bold red"))
    elif c.manifest_error:
        con.print(Text.assemble(("manifest unreadable:", "bold red"), f" {c.manifest_error}"))
    else:
        problems = dict(c.artifact_problems)
        con.print(
            table(
                f"artifacts in {lab.artifact_dir} (manifest {c.manifest_digest[:19]}...)",
                ["build key", "backend", "arch", "profile", "widths", "files", "bytes", "compiler", "check"],
                [
                    (
                        e.build_key[:16],
                        e.backend,
                        e.arch,
                        e.profile or "-",
                        ",".join(map(str, e.widths)),
                        len(e.files),
                        sum(f.bytes for f in e.files),
                        f"{e.compiler['name']} {e.compiler['version']}",
                        problems.get(e.build_key) or "sha256 ok",
                    )
                    for e in c.entries
                ],
            )
        )
        if not c.entries:
            con.print(f"no ahead-of-time artifacts baked (backends: {', '.join(lab.backends)})")
        if c.manifest_digest != lab.manifest_digest:
            con.print(
                Text(
                    f"manifest digest {c.manifest_digest} does not match label {lab.manifest_digest}", style="bold red"
                )
            )
    info = c.image_info or {}
    versions = info.get("versions") or {}
    if versions:
        con.print(table("versions", ["component", "version"], sorted((k, v or "-") for k, v in versions.items())))


def register(app: typer.Typer) -> None:
    app.command("inspect")(inspect)
