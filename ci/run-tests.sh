#!/usr/bin/env bash
# ci/run-tests.sh: CI's last step (.ci/run calls it once the installs are done): which tiers may
# skip, then the README's test command, verbatim. Its exit code is CI's: any failure in that
# command (the venv, pip or the tests) fails the run. A `&&` chain that stops half-way does not
# trip `set -e`, so the chain's status is taken and returned explicitly (tests/ci/ checks it).
set -euo pipefail
cd "$(dirname "$0")/.."

stamp() { echo "ci: $(date -u +%H:%M:%S) $*"; }

# A green CI means every tier ran: under CI=true a skipped test fails the run (tests/conftest.py)
# unless RALPH_ALLOW_SKIP excuses it, each install tier must have run a test that needs its
# install, and (RALPH_EVERY_TIER=1) every tier must appear and run a test: one whose tests were
# all deselected or never collected fails the run. The excuses are per thing that could not be
# installed, `tier/what: why`, taken only from an install's own statement that it could not: the
# file named beside it below, written by the install (ci/install-*.sh, .ci/run) and removed when
# it succeeds. A test is excused when its skip reason names that `what` (each agent has its own
# file, so npm failing excuses opencode's and codex's tests, not aider's). A new tier: one line.
export CI=true RALPH_EVERY_TIER=1
UNAVAILABLE=(
  "real/vllm          .cache/vllm-venv.unavailable"
  "real/claude        .cache/agents/claude.unavailable" # the real tier drives claude too
  "llamacpp/llama.cpp .cache/llamacpp.unavailable"
  "docker/docker      .cache/docker.unavailable"
  "browser/chromium   .cache/browser.unavailable"
  "ssh/sshd           .cache/sshd.unavailable"
  "promtool/promtool  .cache/promtool.unavailable"
  "agents/opencode    .cache/agents/opencode.unavailable"
  "agents/codex       .cache/agents/codex.unavailable"
  "agents/claude      .cache/agents/claude.unavailable"
  "agents/aider       .cache/agents/aider.unavailable"
  "slurm/slurm        .cache/slurm.unavailable"
)
allow=()
for entry in "${UNAVAILABLE[@]}"; do
  read -r what statement _ <<<"$entry"
  [[ -f $statement ]] || continue
  why=$(tr '\n;' '  ' <"$statement" | head -c 300)
  why=${why% }
  echo "ci: $what unavailable: $why ($statement)"
  allow+=("$what: $why")
done
RALPH_ALLOW_SKIP=$(IFS=';'; echo "${allow[*]:-}")
export RALPH_ALLOW_SKIP
echo "ci: skips excused: ${RALPH_ALLOW_SKIP:-none}"

# The README's second command, verbatim (its install finds everything in place):
stamp "tests"
status=0
python3 -m venv .venv && .venv/bin/pip install -q -e '.[test]' && tests/run || status=$?
stamp "done: exit $status"
exit "$status"
