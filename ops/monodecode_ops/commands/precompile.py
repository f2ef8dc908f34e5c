"""``monodecode-ops precompile``: bake FlyDSL K1/K2 code for one arch and model into an artifact dir.

    monodecode-ops precompile --arch gfx942 --profile llama3-8b --out /opt/monodecode/artifacts
    monodecode-ops precompile --arch gfx950 --model /models/Qwen3-8B --out DIR --widths 1,2,4,8
    monodecode-ops precompile --arch gfx942 --profile llama3-8b --tp-size 8 --out DIR

Runs on a machine without a GPU. Compiles every width (in a subprocess: some compiler failures
abort the interpreter), refuses kernels that break their ISA budget, and records the FlyDSL cache
entries and code objects under the build key in ``DIR/manifest.json`` (sha256 of every file), the
form the runtime loads at startup with FlyDSL in run-only mode. Prints the ISA table (``--json``
for machines). Bad arguments are one ``error:`` line (exit 2); the options are the shared ones
of ``monodecode_ops.options``.
"""

from __future__ import annotations

from pathlib import Path

import typer

from monodecode.errors import ConfigError
from monodecode.kernels.flydsl.config import MAX_TP, MAX_WIDTH
from monodecode_ops.options import (
    ArchOpt,
    BlockSizeOpt,
    ModelDirOpt,
    ProfileOpt,
    WeightDtype,
    WeightDtypeOpt,
    Widths,
    WidthsOpt,
    path_option,
)
from monodecode_ops.output import console, emit_json, json_output, print_table

DEFAULT_WIDTHS = Widths((1, 2, 4, 8))


def register(app: typer.Typer) -> None:
    @app.command("precompile")
    def precompile_cmd(
        arch: ArchOpt,
        out: Path = path_option("--out", "Artifact directory (manifest.json + files).", default=...),
        profile: ProfileOpt = None,
        model: ModelDirOpt = None,
        widths: WidthsOpt = None,
        weight_dtype: WeightDtypeOpt = WeightDtype("bf16"),
        block_size: BlockSizeOpt = 16,
        tp_size: int = typer.Option(1, "--tp-size", help="Tensor-parallel size the kernels are planned for (1..8)."),
    ) -> None:
        """Compile every width of K1/K2 ahead of time and write artifacts + manifest."""
        from monodecode.kernels.flydsl.arch import arch_spec
        from monodecode.model.dims import load_dims
        from monodecode.model.profiles import profile_dims
        from monodecode.services.artifacts import ArtifactStore

        arch = arch.value
        spec = arch_spec(arch)
        if (profile is None) == (model is None):
            raise ConfigError("give exactly one of --profile NAME or --model DIR")
        if not 1 <= tp_size <= MAX_TP:
            raise ConfigError(f"--tp-size must be in 1..{MAX_TP}, got {tp_size}")
        ws = list(widths or DEFAULT_WIDTHS)
        if ws[-1] > MAX_WIDTH:
            raise ConfigError(f"--widths: the flydsl kernels are built for widths up to {MAX_WIDTH}, got {ws[-1]}")
        # fp8 means the format the hardware decodes: FNUZ on gfx942, OCP on gfx950
        weight_dtype = "bf16" if weight_dtype.value == "bf16" else spec.fp8_kind
        profile = profile.value if profile else None
        dims = profile_dims(profile) if profile else load_dims(model)
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
        if json_output():
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
