#!/usr/bin/env bash
# `pip install PIP_ARGS... -e SPEC` into PYTHON's venv, one such install at a time: every editable
# install of this repository rewrites monodecode.egg-info in the work tree, and make test-deps runs
# three at once (scripts/setup-toolchains.sh). Usage: pip-editable.sh PYTHON SPEC [PIP_ARGS...]
set -euo pipefail
python=$1
spec=$2
shift 2
cd "$(dirname "$0")/../.."
mkdir -p .tools
exec flock .tools/.editable-install.lock "$python" -m pip --disable-pip-version-check -q install "$@" -e "$spec"
