#!/usr/bin/env bash
# Install the real coding agents the agent tests drive, pinned, under .cache/ (gitignored):
#   .cache/agents/node_modules/.bin/{opencode,codex}   (npm: opencode-ai, @openai/codex)
#   .cache/agents/node_modules/.bin/claude             (npm: @anthropic-ai/claude-code, its
#                                                       native binary from the optional
#                                                       @anthropic-ai/claude-code-<platform>)
#   .cache/aider-venv/bin/aider                        (pip: aider-chat, in its own venv)
# Idempotent: a second run finds the pinned versions in place and takes seconds.
# Prints one line: what it installed, or why it could not (the agent tests then skip), each
# failure naming the agents it leaves out first: "could not: opencode codex (npm not found);
# claude (npm not found); aider (pip install ... failed, ...)"; and, for each agent it could not
# install, that statement in .cache/agents/<agent>.unavailable (removed once it installs):
# ci/run-tests.sh excuses those agents' tests by those files only.
set -uo pipefail
cd "$(dirname "$0")/.."

OPENCODE=opencode-ai@1.18.33
CODEX=@openai/codex@0.171.0
CLAUDE=@anthropic-ai/claude-code@2.1.332
AIDER=aider-chat==0.86.2
NODE_DIR=.cache/agents
AIDER_VENV=.cache/aider-venv
LOG=.cache/install-agents.log

mkdir -p "$NODE_DIR"
rm -f "$NODE_DIR"/*.unavailable
: >"$LOG"
done_parts=()
failed_parts=()

# Do both binaries run and say the pinned versions?
npm_agents_work() {
  local bin="$NODE_DIR/node_modules/.bin"
  [[ "$("$bin/opencode" --version 2>/dev/null)" == "${OPENCODE##*@}" ]] &&
    [[ "$("$bin/codex" --version 2>/dev/null)" == *" ${CODEX##*@}" ]]
}

install_npm() {
  if npm_agents_work; then
    done_parts+=("opencode+codex cached")
    return
  fi
  command -v npm >/dev/null || { failed_parts+=("opencode codex (npm not found)"); return; }
  [ -f "$NODE_DIR/package.json" ] || echo '{"private": true}' >"$NODE_DIR/package.json"
  npm install --prefix "$NODE_DIR" --no-audit --no-fund --save-exact "$OPENCODE" "$CODEX" \
    >>"$LOG" 2>&1
  # opencode-ai's postinstall links the platform's binary into place; npm may skip scripts
  npm_agents_work || (cd "$NODE_DIR/node_modules/opencode-ai" && node postinstall.mjs) >>"$LOG" 2>&1
  if npm_agents_work; then
    done_parts+=("$OPENCODE $CODEX installed")
  else
    failed_parts+=("opencode codex (npm install $OPENCODE $CODEX failed, see $LOG)")
  fi
}

# Does claude run and say the pinned version ("2.1.332 (Claude Code)")?
claude_works() {
  [[ "$("$NODE_DIR/node_modules/.bin/claude" --version 2>/dev/null)" == "${CLAUDE##*@} "* ]]
}

# Its own npm install, so that a failure names claude alone. npm installs the platform's
# native binary as an optional dependency; --include=optional in case the config omits them.
install_claude() {
  if claude_works; then
    done_parts+=("claude cached")
    return
  fi
  command -v npm >/dev/null || { failed_parts+=("claude (npm not found)"); return; }
  [ -f "$NODE_DIR/package.json" ] || echo '{"private": true}' >"$NODE_DIR/package.json"
  npm install --prefix "$NODE_DIR" --no-audit --no-fund --save-exact --include=optional \
    "$CLAUDE" >>"$LOG" 2>&1
  if claude_works; then
    done_parts+=("$CLAUDE installed")
  else
    failed_parts+=("claude (npm install $CLAUDE failed, see $LOG)")
  fi
}

install_aider() {
  if [ -x "$AIDER_VENV/bin/aider" ] &&
    [ "$("$AIDER_VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("aider-chat"))' 2>/dev/null)" = "${AIDER##*==}" ]; then
    done_parts+=("aider cached")
    return
  fi
  if { [ -x "$AIDER_VENV/bin/python" ] || python3 -m venv "$AIDER_VENV"; } >>"$LOG" 2>&1 &&
    ci/pip-install.sh "$AIDER_VENV" -q "$AIDER" >>"$LOG" 2>&1 && [ -x "$AIDER_VENV/bin/aider" ]; then
    done_parts+=("$AIDER installed")
  else
    failed_parts+=("aider (pip install $AIDER failed, see $LOG)")
  fi
}

start=$SECONDS
install_npm
install_claude
install_aider
summary="install-agents: ${done_parts[*]:-nothing}"
if [ "${#failed_parts[@]}" -gt 0 ]; then
  for part in "${failed_parts[@]}"; do
    for agent in ${part%% (*}; do echo "install-agents: $part" >"$NODE_DIR/$agent.unavailable"; done
  done
  failed=$(printf '; %s' "${failed_parts[@]}")
  summary+="; could not: ${failed#; }"
fi
echo "$summary ($((SECONDS - start)) s)"
exit 0
