#!/bin/sh
# Runtime stage: installs the wheels resolved by the wheels stage next to the base image's
# packages (offline, --no-deps, each checked against the wheels stage's sha256 lock), proves
# nothing of the base changed and that the base's vLLM is one the plugin supports, removes the
# wheel files (wheels.lock stays as the record of what was added), and adds the non-root user
# the image runs as.
set -eu
PY=python3
UID_=${MONODECODE_UID:-10001}
HOME_=/home/monodecode
B=/opt/monodecode/build
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_BREAK_SYSTEM_PACKAGES=1 PIP_ROOT_USER_ACTION=ignore PIP_PROGRESS_BAR=off

"$PY" "$B/pyenv.py" snapshot /tmp/before.json
"$PY" -m pip install --quiet --no-index --no-deps --require-hashes -r /opt/monodecode/wheels.lock
"$PY" "$B/pyenv.py" snapshot /tmp/after.json
"$PY" "$B/pyenv.py" undisturbed /tmp/before.json /tmp/after.json
rm -f /tmp/before.json /tmp/after.json
"$PY" -c "import monodecode, monodecode_ops.cli"  # the runtime and the CLI import
"$PY" -m monodecode_ops.base_vllm  # the base's vLLM is in the plugin's supported range (or absent)
rm -rf /opt/monodecode/wheels

# Non-root user (numeric uid so USER works even where useradd is missing). ROCm devices are
# group-owned (video, render): join those groups when the base defines them.
if ! getent passwd "$UID_" >/dev/null 2>&1; then
  if command -v useradd >/dev/null 2>&1; then
    groupadd --gid "$UID_" monodecode 2>/dev/null || true
    useradd --uid "$UID_" --gid "$UID_" --home-dir "$HOME_" --create-home --shell /bin/sh monodecode
  else
    echo "monodecode:x:$UID_:" >> /etc/group
    echo "monodecode:x:$UID_:$UID_:monodecode:$HOME_:/bin/sh" >> /etc/passwd
  fi
fi
for g in video render; do
  if getent group "$g" >/dev/null 2>&1 && command -v usermod >/dev/null 2>&1; then
    usermod -a -G "$g" "$(getent passwd "$UID_" | cut -d: -f1)"
  fi
done
mkdir -p "$HOME_"
chown "$UID_:$UID_" "$HOME_"
chmod 0755 "$B"/*.sh "$B"/*.py
ln -sf "$B/entrypoint.py" /usr/local/bin/monodecode-entrypoint
