"""Compile-time geometry of the FlyDSL K1/K2 launches for one (dims, width, arch, dtype).

Everything a kernel specialisation bakes in lives here, in plain Python, so it can be unit-tested
and printed next to the ISA figures:

* task tables: GEMV rows go to waves round-robin (global wave ``b*4+w`` takes rows
  ``gw, gw+4G, ...``), attention tasks ``(token, kv_head)`` go to workgroups round-robin;
* LDS chunking of the staged activations (``x_chunk``) within the arch's budget;
* the scratch layout of one width: a header (epoch word, done counter) and the tagged mailboxes
  (one 32-bit word per bf16 value: ``tag16 << 16 | bf16``), 256-byte aligned; widths get
  disjoint regions (``scratch_layout``), so no two widths ever alias.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from monodecode.errors import ConfigError
from monodecode.kernels.flydsl.arch import WAVE_SIZE, WAVES_PER_WORKGROUP, ArchSpec
from monodecode.model.dims import ModelDims

WEIGHT_DTYPES = ("bf16", "fp8", "fp8_fnuz")
HEADER_WORDS = 64  # epoch @0, done counter @1; padded to 256 bytes
ATTN_CHUNK = WAVE_SIZE  # positions scored per wave pass (one per lane)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _align(n: int, a: int = 64) -> int:
    return _ceil(n, a) * a


@dataclass(frozen=True)
class GemvShape:
    """One GEMV stage: ``rows`` outputs (x ``pair`` rows sharing an input), inner dim ``k``."""

    rows: int
    k: int
    vec: int  # weight elements per lane per 16-byte load (8 bf16 / 16 fp8)
    chunk: int  # activation elements per token staged in LDS at a time
    chunks: int
    rows_per_wave: int  # task-table depth: ceil(rows / (G * waves))

    @property
    def step(self) -> int:
        return WAVE_SIZE * self.vec


@dataclass(frozen=True)
class Geometry:
    arch: str
    width: int
    grid: int
    fp8: bool
    hidden: int
    q_size: int
    kv_size: int
    head_dim: int
    num_heads: int
    num_kv_heads: int
    gqa: int
    intermediate: int
    qkv: GemvShape
    o: GemvShape
    gate_up: GemvShape
    down: GemvShape
    # mailbox word offsets inside this width's region
    mb_qkv: int
    mb_o: int
    mb_act: int
    mb_down: int
    region_words: int

    @property
    def region_bytes(self) -> int:
        return self.region_words * 4

    def to_dict(self) -> dict:
        return asdict(self)


def _gemv(rows: int, k: int, width: int, spec: ArchSpec, fp8: bool, pair: int = 1) -> GemvShape:
    vec = 16 if fp8 else 8
    step = WAVE_SIZE * vec
    per_token = spec.x_stage_bytes // (2 * width)  # bf16 activations per token that fit
    chunk = max(step, (per_token // step) * step)
    chunk = min(chunk, _ceil(k, step) * step)
    waves = spec.compute_units * WAVES_PER_WORKGROUP
    return GemvShape(rows=rows, k=k, vec=vec, chunk=chunk, chunks=_ceil(k, chunk),
                     rows_per_wave=_ceil(rows, waves))


def plan_geometry(dims: ModelDims, width: int, spec: ArchSpec, weight_dtype: str, tp_size: int = 1) -> Geometry:
    if weight_dtype not in WEIGHT_DTYPES:
        raise ConfigError(f"flydsl: weight dtype {weight_dtype!r} not supported; supported: {', '.join(WEIGHT_DTYPES)}")
    if tp_size != 1:
        raise ConfigError(f"flydsl: tensor parallel size {tp_size} is not built yet (only 1)")
    if not 1 <= width <= 64:
        raise ConfigError(f"flydsl: width {width} out of range 1..64")
    fp8 = weight_dtype != "bf16"
    vec = 16 if fp8 else 8
    for name, k in (("hidden_size", dims.hidden_size), ("q_size", dims.q_size),
                    ("intermediate_size", dims.intermediate_size)):
        if k % vec:
            raise ConfigError(f"flydsl: {name} {k} is not a multiple of {vec} ({weight_dtype} 16-byte loads)")
    if dims.head_dim % 2 or dims.head_dim > 256 or WAVE_SIZE % (dims.head_dim // 2 if dims.head_dim < 128 else 1):
        raise ConfigError(f"flydsl: head_dim {dims.head_dim} unsupported (even, <= 256)")
    h, q, kv, i = dims.hidden_size, dims.q_size, dims.kv_size, dims.intermediate_size
    qkv = _gemv(q + 2 * kv, h, width, spec, fp8)
    o = _gemv(h, q, width, spec, fp8)
    gate_up = _gemv(i, h, width, spec, fp8, pair=2)
    down = _gemv(h, i, width, spec, fp8)
    mb_qkv = HEADER_WORDS
    mb_o = _align(mb_qkv + width * (q + 2 * kv))
    mb_act = _align(mb_o + width * h)
    mb_down = _align(mb_act + width * i)
    end = _align(mb_down + width * h)
    if width * dims.num_kv_heads > 0 and dims.gqa_group > 16:
        raise ConfigError(f"flydsl: GQA group {dims.gqa_group} > 16 not supported")
    return Geometry(arch=spec.arch, width=width, grid=spec.compute_units, fp8=fp8, hidden=h, q_size=q,
                    kv_size=kv, head_dim=dims.head_dim, num_heads=dims.num_heads,
                    num_kv_heads=dims.num_kv_heads, gqa=dims.gqa_group, intermediate=i, qkv=qkv, o=o,
                    gate_up=gate_up, down=down, mb_qkv=mb_qkv, mb_o=mb_o, mb_act=mb_act, mb_down=mb_down,
                    region_words=end)


def scratch_layout(geoms: list[Geometry]) -> dict[int, tuple[int, int]]:
    """width -> (byte offset, byte size) of its region in one scratch buffer; regions never overlap."""
    out, off = {}, 0
    for g in sorted(geoms, key=lambda g: g.width):
        out[g.width] = (off, g.region_bytes)
        off += _align(g.region_bytes, 256)
    return out
