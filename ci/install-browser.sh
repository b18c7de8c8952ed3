#!/usr/bin/env bash
# The report's browser test (tests/test_report.py) needs Debian's chromium, headless.
# Idempotent: a machine that has it is left alone; prints one line either way.
set -uo pipefail
# its statement that it could not, for ci/run-tests.sh's excuses; removed once chromium is here
unavailable="$(dirname "$0")/../.cache/browser.unavailable"
rm -f "$unavailable"

if [ -x /usr/bin/chromium ]; then
  echo "install-browser: $(/usr/bin/chromium --version 2>/dev/null || echo chromium) already installed"
  exit 0
fi
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
if { as_root apt-get update -qq &&
     DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq chromium >/dev/null; } 2>/dev/null &&
   [ -x /usr/bin/chromium ]; then
  echo "install-browser: installed $(/usr/bin/chromium --version 2>/dev/null)"
else
  echo "install-browser: could not install chromium (apt-get failed): the browser test will skip"
  mkdir -p "$(dirname "$unavailable")" && echo "install-browser: apt-get install chromium failed" >"$unavailable"
fi
