#!/bin/sh
# Runtime stage, after the wheels stage's installed root was copied onto the base: proves nothing
# of the base changed (its distributions, snapshot in the wheels stage from the same base, against
# now) and that the base's vLLM is one the plugin supports, and adds the non-root user the image
# runs as.
set -eu
PY=python3
UID_=${MONODECODE_UID:-10001}
HOME_=/home/monodecode
B=/opt/monodecode/build
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_BREAK_SYSTEM_PACKAGES=1 PIP_ROOT_USER_ACTION=ignore PIP_PROGRESS_BAR=off

"$PY" "$B/pyenv.py" snapshot /tmp/after.json
"$PY" "$B/pyenv.py" undisturbed /opt/monodecode/base-packages.json /tmp/after.json
rm -f /tmp/after.json
"$PY" -c "import monodecode, monodecode_ops.cli"  # the runtime and the CLI import
"$PY" -m monodecode_ops.base_vllm  # the base's vLLM is in the plugin's supported range (or absent)

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
