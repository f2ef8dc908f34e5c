#!/usr/bin/env bash
# Makes a local stand-in for the ROCm vLLM base images, for CI and offline machines where no
# registry is reachable: Debian bookworm (debootstrap minbase) + Python 3.11 + pip + a CPU build
# of torch + tokenizers (what the ROCm vLLM images bring and monodecode does not declare), plus
# the FlyDSL compile-only toolchain laid out like ROCm's /opt/rocm (ld.lld from lld-19,
# llvm-readelf from llvm-19, device bitcode from rocm-device-libs). Everything is installed into the root directory before
# `docker import`, so the image is ONE layer (vfs-backed engines copy every layer in full).
#
# Usage: images/local-base.sh TAG            (root; needs debootstrap, docker, network)
#
# Torch, in this order:
#   $MONODECODE_TORCH_WHEEL                   a CPU torch wheel for CPython 3.11 / x86_64
#   /opt/wheels/torch-2.13.0+cpu-cp311-...    present on the project's CI machines
#   torch==2.13.0 from PyPI                   fallback: PyPI's Linux build (CUDA, several GB)
# Environment: DEBIAN_MIRROR (default http://deb.debian.org/debian), PIP_CERT / SSL_CERT_FILE
# (a CA bundle pip inside the root directory should trust; default the host's bundle).
set -euo pipefail

TAG=${1:?usage: local-base.sh TAG}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
TORCH_VERSION=2.13.0
DEFAULT_WHEEL=/opt/wheels/torch-${TORCH_VERSION}+cpu-cp311-cp311-manylinux_2_28_x86_64.whl
WHEEL=${MONODECODE_TORCH_WHEEL:-$DEFAULT_WHEEL}
CA=${PIP_CERT:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}
PACKAGES=python3,python3-pip,ca-certificates,lld-19,llvm-19,rocm-device-libs

for tool in debootstrap docker chroot; do
  command -v "$tool" >/dev/null || { echo "local-base: $tool not found (apt: debootstrap docker.io)" >&2; exit 1; }
done
[ "$(id -u)" = 0 ] || { echo "local-base: must run as root (debootstrap, chroot)" >&2; exit 1; }

WORK=$(mktemp -d "${TMPDIR:-/var/tmp}/monodecode-base.XXXXXX")
ROOT=$WORK/root
cleanup() { rm -rf "$WORK"; }
trap cleanup EXIT

t0=$SECONDS
echo "local-base: debootstrap bookworm minbase + $PACKAGES"
debootstrap --variant=minbase --include="$PACKAGES" bookworm "$ROOT" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 || {
  echo "local-base: debootstrap failed; last lines:" >&2; tail -n 20 "$WORK/debootstrap.log" >&2; exit 1; }

# ROCm's layout for the compile-only toolchain (what FlyDSL looks for under ROCM_PATH=/opt/rocm).
mkdir -p "$ROOT/opt/rocm/llvm/bin" "$ROOT/opt/rocm/amdgcn"
ln -sfn /usr/lib/llvm-19/bin/ld.lld "$ROOT/opt/rocm/llvm/bin/ld.lld"
ln -sfn /usr/lib/llvm-19/bin/llvm-readelf "$ROOT/opt/rocm/llvm/bin/llvm-readelf"
ln -sfn /usr/lib/x86_64-linux-gnu/amdgcn/bitcode "$ROOT/opt/rocm/amdgcn/bitcode"

mkdir -p "$ROOT/tmp/base"
if [ -f "$WHEEL" ]; then
  cp "$WHEEL" "$ROOT/tmp/base/"
  torch_req=/tmp/base/$(basename "$WHEEL")
  echo "local-base: torch from $WHEEL"
else
  torch_req=torch==$TORCH_VERSION
  echo "local-base: no torch wheel at $WHEEL (set MONODECODE_TORCH_WHEEL); installing $torch_req from PyPI (large)"
fi
# env -i: the host's pip/requests variables (find-links, CA paths) mean nothing inside the root.
envv=(PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root PIP_BREAK_SYSTEM_PACKAGES=1
      PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore)
if [ -f "$CA" ]; then cp "$CA" "$ROOT/tmp/base/ca.crt"; envv+=(PIP_CERT=/tmp/base/ca.crt); fi
cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
chroot "$ROOT" env -i "${envv[@]}" python3 -m pip install --quiet "$torch_req"
# tokenizers' own dependencies (huggingface_hub, httpx, ...) only serve from_pretrained downloads.
chroot "$ROOT" env -i "${envv[@]}" python3 -m pip install --quiet --no-deps tokenizers
# Fewer files = faster layer copies on vfs: C++ headers/CMake files of torch, docs, man pages.
site=$ROOT/usr/local/lib/python3.11/dist-packages
rm -rf "$site/torch/include" "$site/torch/share/cmake" "$ROOT"/usr/share/doc/* "$ROOT"/usr/share/man/* \
  "$ROOT"/usr/share/info/* "$ROOT"/usr/share/locale/*
rm -rf "$ROOT/tmp/base" "$ROOT"/var/cache/apt/archives/*.deb "$ROOT"/var/lib/apt/lists/*
: > "$ROOT/etc/resolv.conf"
chroot "$ROOT" python3 -c "import torch, tokenizers; print('local-base: torch', torch.__version__, 'tokenizers', tokenizers.__version__)" 2>/dev/null

echo "local-base: importing into docker as $TAG"
tar --numeric-owner -C "$ROOT" -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["/bin/bash"]' \
  --change 'LABEL org.opencontainers.image.title=monodecode-local-base org.opencontainers.image.description="Debian bookworm + Python 3.11 + CPU torch: a local stand-in for the ROCm vLLM base images"' \
  - "$TAG" >/dev/null
echo "local-base: $TAG ready in $((SECONDS - t0)) s ($(du -sh "$ROOT" | cut -f1), $(find "$ROOT" | wc -l) files)"
