#!/usr/bin/env bash
# ci/run-tests.sh: CI's last step (.ci/run calls it once the installs are done): which tiers may
# skip, then the README's test command, verbatim. Its exit code is CI's: any failure in that
# command (the venv, pip or the tests) fails the run. A `&&` chain that stops half-way does not
# trip `set -e`, so the chain's status is taken and returned explicitly (tests/ci/ checks it).
set -euo pipefail
cd "$(dirname "$0")/.."

stamp() { echo "ci: $(date -u +%H:%M:%S) $*"; }

# A green CI means every tier ran: under CI=true a skipped test fails the run (tests/conftest.py)
# unless RALPH_ALLOW_SKIP excuses it, and each install tier must have run a test that needs its
# install. The excuses are per thing that could not be installed, `tier/what: why`, taken only
# from an install that said so in its one line: a test is excused when its skip reason names
# that `what` (the agents' install names each agent it could not install, so npm failing
# excuses opencode's and codex's tests, not aider's).
export CI=true
allow=()
excuse() { allow+=("$1: ${2//;/,}"); } # tier/what, why (entries are `;` apart)
for tier in vllm:real/vllm llamacpp:llamacpp/llama.cpp docker:docker/docker browser:browser/chromium \
  agents:agents; do
  install=${tier%%:*} what=${tier#*:}
  line=$(tail -n 1 ".cache/install-$install.out" 2>/dev/null || true)
  echo "ci: $install: ${line:-no output from ci/install-$install (.cache/install-$install.out)}"
  if [[ $install == agents ]]; then
    # "install-agents: ...; could not: opencode codex (why); aider (why) (12 s)"
    [[ $line == *"could not: "* ]] || continue
    failed=${line#*could not: }
    [[ $failed =~ ^(.*)\ \([0-9]+\ s\)$ ]] && failed=${BASH_REMATCH[1]} # its time, at the end
    IFS=';' read -ra parts <<<"$failed"
    for part in "${parts[@]}"; do
      part=${part# }
      for agent in ${part%% (*}; do
        excuse "agents/$agent" "$part"
        # the real tier drives claude too (against the real vLLM's /v1/messages)
        if [[ $agent == claude ]]; then excuse "real/claude" "$part"; fi
      done
    done
  elif [[ $line == *skip* || $line == *unavailable* || $line == *"could not"* ||
    $line == *failed* || $line == *exited* ]]; then
    excuse "$what" "$line"
  fi
done
for binary in /usr/sbin/sshd:ssh/sshd /usr/bin/promtool:promtool/promtool; do
  [[ -x ${binary%%:*} ]] || excuse "${binary##*:}" "${binary%%:*} could not be installed"
done
slurm_line=$(tail -n 1 .cache/install-slurm.out 2>/dev/null || true)
echo "ci: slurm: ${slurm_line:-no output from ci/install-slurm.sh (.cache/install-slurm.out)}"
[[ -f .cache/slurm.unavailable ]] && excuse slurm/slurm "$(cat .cache/slurm.unavailable)"
RALPH_ALLOW_SKIP=$(IFS=';'; echo "${allow[*]:-}")
export RALPH_ALLOW_SKIP
echo "ci: skips excused: ${RALPH_ALLOW_SKIP:-none}"

# The README's second command, verbatim (its install finds everything in place):
stamp "tests"
status=0
python3 -m venv .venv && .venv/bin/pip install -q -e '.[test]' && tests/run || status=$?
stamp "done: exit $status"
exit "$status"
