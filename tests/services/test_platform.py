"""Node discovery from the AMD KFD sysfs topology (a directory tree laid out like /sys)."""

from pathlib import Path

from monodecode.services.platform import detect_platform, gfx_name, list_kfd_gpus

# properties as the amdgpu driver prints them (subset; values of an MI300X in SPX and of a CPU node)
MI300X = """cpu_cores_count 0
simd_count 1216
mem_banks_count 1
gfx_target_version 90402
simd_per_cu 4
drm_render_minor 128
max_waves_per_simd 8
"""
CPU_NODE = """cpu_cores_count 96
simd_count 0
gfx_target_version 0
"""


def make_node(root: Path, idx: int, props: str, partition: str | None = None, product: str | None = None):
    node = root / f"sys/class/kfd/kfd/topology/nodes/{idx}"
    node.mkdir(parents=True)
    (node / "properties").write_text(props)
    (node / "gpu_id").write_text(str(1000 + idx))
    minor = next((l.split()[1] for l in props.splitlines() if l.startswith("drm_render_minor")), None)
    if minor:
        dev = root / f"sys/class/drm/renderD{minor}/device"
        dev.mkdir(parents=True)
        if partition:
            (dev / "current_compute_partition").write_text(partition + "\n")
        if product:
            (dev / "product_name").write_text(product + "\n")


def test_gfx_name_encoding():
    assert gfx_name(90402) == "gfx942"
    assert gfx_name(90500) == "gfx950"
    assert gfx_name(90010) == "gfx90a"
    assert gfx_name(110000) == "gfx1100"


def test_kfd_topology_spx_and_cpx(tmp_path):
    make_node(tmp_path, 0, CPU_NODE)
    make_node(tmp_path, 1, MI300X, partition="spx", product="AMD Instinct MI300X")
    # a CPX partition: 38 CUs visible
    make_node(
        tmp_path,
        2,
        MI300X.replace("simd_count 1216", "simd_count 152").replace("drm_render_minor 128", "drm_render_minor 136"),
        partition="CPX",
    )
    (tmp_path / "sys/module/amdgpu").mkdir(parents=True)
    (tmp_path / "sys/module/amdgpu/version").write_text("6.10.5\n")
    gpus = list_kfd_gpus(tmp_path)
    assert [(g.node, g.arch, g.compute_units, g.partition_mode) for g in gpus] == [
        (1, "gfx942", 304, "SPX"),
        (2, "gfx942", 38, "CPX"),
    ]
    p = detect_platform(device=0, sysfs_root=tmp_path)
    assert (p.kind, p.arch, p.compute_units, p.partition_mode, p.source) == ("rocm", "gfx942", 304, "SPX", "kfd")
    assert p.name == "AMD Instinct MI300X" and p.driver == "amdgpu 6.10.5"
    assert p.is_supported_amd and p.is_gpu and not p.torch_usable and p.torch_device == "cpu"
    p2 = detect_platform(device=1, sysfs_root=tmp_path)
    assert (p2.compute_units, p2.partition_mode) == (38, "CPX")


def test_no_kfd_means_cpu(tmp_path):
    p = detect_platform(sysfs_root=tmp_path)
    assert p.kind == "cpu" and p.arch == "cpu" and p.compute_units >= 1 and not p.is_gpu


def test_garbage_properties_do_not_crash(tmp_path):
    make_node(tmp_path, 0, "simd_count lots\ngfx_target_version ???\n")
    assert list_kfd_gpus(tmp_path) == []


def test_this_machine():
    # whatever this machine is, discovery answers without raising and is self-consistent
    p = detect_platform()
    assert p.kind in ("cpu", "cuda", "rocm") and p.compute_units >= 0
    assert p.to_dict()["arch"] == p.arch
