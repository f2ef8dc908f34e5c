"""``monodecode-ops precompile``: bake FlyDSL K1/K2 code for one arch and model into an artifact dir.

    monodecode-ops precompile --arch gfx942 --profile llama3-8b --out /opt/monodecode/artifacts
    monodecode-ops precompile --arch gfx950 --model /models/Qwen3-8B --out DIR --widths 1,2,4,8
    monodecode-ops precompile --arch gfx942 --profile llama3-8b --tp-size 8 --out DIR

Runs on a machine without a GPU. Compiles every width (in a subprocess: some compiler failures
abort the interpreter), refuses kernels that break their ISA budget, and records the FlyDSL cache
entries and code objects under the build key in ``DIR/manifest.json`` (sha256 of every file), the
form the runtime loads at startup with FlyDSL in run-only mode. Prints the ISA table (``--json``
for machines). Bad arguments are one ``error:`` line (exit 2).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from monodecode.errors import ConfigError
from monodecode.kernels.flydsl.geometry import MAX_TP, MAX_WIDTH
from monodecode_ops.output import console, emit_json, print_table

DEFAULT_WIDTHS = "1,2,4,8"


def parse_widths(text: str) -> list[int]:
    try:
        widths = sorted({int(w) for w in text.split(",") if w.strip()})
    except ValueError:
        raise ConfigError(f"--widths must be comma-separated positive integers, got {text!r}") from None
    if not widths or widths[0] < 1 or widths[-1] > MAX_WIDTH:
        raise ConfigError(f"--widths must list integers in 1..{MAX_WIDTH}, got {text!r}")
    return widths


def register(app: typer.Typer) -> None:
    @app.command("precompile")
    def precompile_cmd(
        arch: str = typer.Option(..., "--arch", help="gfx942 (MI300X/MI325X) or gfx950 (MI350X/MI355X)."),
        out: Path = typer.Option(..., "--out", help="Artifact directory (manifest.json + files)."),
        profile: Optional[str] = typer.Option(None, "--profile", help="Named model profile (tiny, llama3-8b, ...)."),
        model: Optional[Path] = typer.Option(None, "--model", help="Model directory with a Hugging Face config.json."),
        widths: str = typer.Option(DEFAULT_WIDTHS, "--widths", help="Step widths to build, e.g. 1,2,4,8."),
        weight_dtype: str = typer.Option("bf16", "--weight-dtype", help="bf16, or fp8 (the arch's FP8 format)."),
        block_size: int = typer.Option(16, "--block-size", help="Paged-KV block size."),
        tp_size: int = typer.Option(1, "--tp-size", help="Tensor-parallel size the kernels are planned for (1..8)."),
        as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    ) -> None:
        """Compile every width of K1/K2 ahead of time and write artifacts + manifest."""
        from monodecode.kernels.flydsl.arch import arch_spec
        from monodecode.model.dims import load_dims
        from monodecode.model.profiles import profile_dims
        from monodecode.services.artifacts import ArtifactStore

        spec = arch_spec(arch)
        if (profile is None) == (model is None):
            raise ConfigError("give exactly one of --profile NAME or --model DIR")
        if block_size < 1:
            raise ConfigError(f"--block-size must be >= 1, got {block_size}")
        if not 1 <= tp_size <= MAX_TP:
            raise ConfigError(f"--tp-size must be in 1..{MAX_TP}, got {tp_size}")
        if weight_dtype not in ("bf16", "fp8", "fp8_fnuz"):
            raise ConfigError(f"--weight-dtype must be bf16 or fp8, got {weight_dtype!r}")
        if weight_dtype != "bf16":
            weight_dtype = spec.fp8_kind  # the format the hardware decodes: FNUZ on gfx942, OCP on gfx950
        dims = profile_dims(profile) if profile else load_dims(model)
        ws = parse_widths(widths)
        if out.exists() and not out.is_dir():
            raise ConfigError(f"--out {out} exists and is not a directory")

        from monodecode.kernels.flydsl.bake import precompile

        entry, table = precompile(
            ArtifactStore(out),
            arch,
            dims,
            ws,
            weight_dtype,
            block_size,
            profile=profile or dims.architecture,
            tp_size=tp_size,
        )
        result = {
            "build_key": entry.build_key,
            "arch": arch,
            "profile": entry.profile,
            "widths": list(entry.widths),
            "weight_dtype": weight_dtype,
            "tp_size": tp_size,
            "manifest": str(out / "manifest.json"),
            "files": len(entry.files),
            "isa": table,
        }
        if as_json:
            emit_json(result)
            return
        print_table(
            f"flydsl {arch} {entry.profile} ({weight_dtype}, TP {tp_size}): ISA budgets",
            ["kernel", "width", "VGPR", "AGPR", "SGPR", "spills", "scratch", "LDS", "waves/SIMD", "grid"],
            [
                [
                    r["kernel"],
                    r["width"],
                    r["vgprs"],
                    r["agprs"],
                    r["sgprs"],
                    r["spills"],
                    r["scratch"],
                    f"{r['lds']}/{r['lds_limit']}",
                    r["waves_per_simd"],
                    f"{r['grid']}/{r['cus']}",
                ]
                for r in table
            ],
        )
        console().print(f"build key {entry.build_key}  ({len(entry.files)} files) -> {out / 'manifest.json'}")
