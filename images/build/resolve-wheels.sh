#!/bin/sh
# Wheels stage (not shipped): the only step that needs the network. Builds the monodecode wheel
# from the source in /src, downloads exactly the distributions the base image lacks (each checked
# against the sha256 the index published) into /stage/wheels, and installs them, checked against
# the lock of their sha256, into the separate root /stage/root (with these build scripts under
# /stage/root/opt/monodecode/build). The runtime stage copies that root onto the base: only the
# installed files reach the image, never a wheel, certificate, index URL or download tool.
set -eu
PY=python3
STAGE=/stage
CONF=/src/images/build-config
MONODECODE_EXTRAS=ops,flydsl
# build.env: MONODECODE_EXTRAS, PIP_INDEX_URL, PIP_EXTRA_INDEX_URL (written by monodecode-ops build)
if [ -f "$CONF/build.env" ]; then . "$CONF/build.env"; fi
if [ -n "${PIP_INDEX_URL:-}" ]; then export PIP_INDEX_URL; fi
if [ -n "${PIP_EXTRA_INDEX_URL:-}" ]; then export PIP_EXTRA_INDEX_URL; fi
EXTRAS=$MONODECODE_EXTRAS
CERT=$CONF/ca-bundle.crt

command -v "$PY" >/dev/null 2>&1 || { echo "wheels: python3 is not on PATH in the base image; monodecode images need a base with Python 3.10+ and pip" >&2; exit 1; }
"$PY" -m pip --version >/dev/null 2>&1 || { echo "wheels: 'python3 -m pip' does not work in the base image; monodecode images need pip" >&2; exit 1; }
if [ -s "$CERT" ]; then export PIP_CERT="$CERT"; fi
# The base's Python may be marked externally managed (Debian/Ubuntu); installing next to the
# base's packages is the point here, and the runtime stage checks nothing of the base changed.
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_BREAK_SYSTEM_PACKAGES=1 PIP_ROOT_USER_ACTION=ignore PIP_PROGRESS_BAR=off

mkdir -p "$STAGE/wheels" "$STAGE/build"
cp /src/images/build/* "$STAGE/build/"
# The wheel's build backend is pinned by sha256 (build-system.lock), not fetched unchecked by an
# isolated build; it lives under $STAGE only while the wheel is built.
"$PY" -m pip install --quiet --no-deps --require-hashes --target "$STAGE/backend" -r "$CONF/build-system.lock"
PYTHONPATH="$STAGE/backend" "$PY" -m pip wheel --quiet --no-deps --no-build-isolation --wheel-dir "$STAGE/wheels" /src
rm -rf "$STAGE/backend"
whl=$(ls "$STAGE"/wheels/monodecode-*.whl)
echo "wheels: built $(basename "$whl")"

# What would `pip install monodecode[EXTRAS]` add if every installed distribution stays as it is?
"$PY" "$STAGE/build/pyenv.py" constraints /tmp/installed.txt
"$PY" -m pip install --quiet --dry-run --report /tmp/report.json \
    -c /tmp/installed.txt "monodecode[$EXTRAS] @ file://$whl"
"$PY" "$STAGE/build/pyenv.py" plan /tmp/report.json /tmp/missing.txt
# Every download is checked against the sha256 the index published for the resolved version.
if [ -s /tmp/missing.txt ]; then
  "$PY" -m pip wheel --quiet --no-deps --require-hashes --wheel-dir "$STAGE/wheels" -r /tmp/missing.txt
fi
# Exactly these files, each checked against this lock, installed into the separate root.
"$PY" "$STAGE/build/pyenv.py" lock "$STAGE/wheels" "$STAGE/wheels" "$STAGE/wheels.lock"
ROOT=$STAGE/root
mkdir -p "$ROOT/opt/monodecode"
"$PY" "$STAGE/build/pyenv.py" snapshot "$ROOT/opt/monodecode/base-packages.json"
"$PY" -m pip install --quiet --no-index --no-deps --require-hashes --root "$ROOT" -r "$STAGE/wheels.lock"
cp -r "$STAGE/build" "$ROOT/opt/monodecode/build"
# the record of what was added: wheel file names and sha256
sed "s|^$STAGE/||" "$STAGE/wheels.lock" > "$ROOT/opt/monodecode/wheels.lock"
rm -f /tmp/installed.txt /tmp/report.json /tmp/missing.txt
cat "$ROOT/opt/monodecode/wheels.lock"
