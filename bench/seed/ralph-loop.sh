#!/usr/bin/env bash
# The seed's ralph-loop.sh, rebuilt from the blog post in shared/seed/ so the bench can run the
# approach ralph-run replaces on the same stand-in server. The post shows ensure_vllm_alive()
# whole and the main loop in outline; this keeps their commands, order and fixed waits:
#   - health: `curl -sS --max-time 3 $VLLM_BASE_URL/models`, at the start of every iteration and
#     right after the agent (no watch while the agent runs: a death is seen when it returns);
#   - diagnostics: one sequential block appended to vllm-deaths.log, no timeout on any command;
#   - recovery: $START_VLLM, on failure `sleep 30` and $START_VLLM once more, then
#     `curl --max-time 5`; unrecovered -> exit 4;
#   - the agent under `timeout 300`.
# What the post does not show is rebuilt the plain way and marked "(rebuilt)": the loop's item
# selection and prompt, and the verification hook it leaves for "the next article" (ticked and
# committed, else a strike; 3 strikes -> "- [!]"). The Korean messages are translated.
#
# Everything the seed hard-codes is an environment variable whose default is the seed's value.
# bench_mark lines add timestamps for the bench (no-ops unless BENCH_MARKS names a file).
#
# usage: ralph-loop.sh          run the loop in the current directory (a git work tree)
#        source ralph-loop.sh   define the functions only (the bench times them one by one)

VLLM_BASE_URL="${VLLM_BASE_URL:-http://127.0.0.1:8000/v1}"
MODEL="${MODEL:-qwen3-coder}"
START_VLLM="${START_VLLM:-$HOME/gpu-scheduler/start_vllm.sh}"
GPU_SCHED="${GPU_SCHED:-$HOME/gpu-scheduler/gpu-sched}"
LOG_DIR="${LOG_DIR:-logs}"
AGENT="${AGENT:-opencode}"          # called as: timeout $AGENT_TIMEOUT $AGENT PROMPT
AGENT_TIMEOUT="${AGENT_TIMEOUT:-300}"
RETRY_WAIT="${RETRY_WAIT:-30}"
MAX_ITER="${MAX_ITER:-200}"
STRIKES="${STRIKES:-3}"
DEATH_LOG="$LOG_DIR/vllm-deaths.log"

bench_mark() {  # WHAT: "<epoch seconds> WHAT" appended to $BENCH_MARKS
  [[ -z "${BENCH_MARKS:-}" ]] || echo "$EPOCHREALTIME $1" >>"$BENCH_MARKS"
}

# Stage 2 of ensure_vllm_alive, verbatim, lifted into a function so the bench can time it alone.
capture_diagnostics() {
  local context_iter="$1"
  local context_item="$2"
  local context_prompt_size="$3"
  echo "===== vLLM down detected at $(date '+%Y-%m-%d %H:%M:%S') ====="
  echo "context: iter=$context_iter, item=$context_item"
  echo "last prompt size: ${context_prompt_size:-(N/A)} chars"
  echo ""
  echo "--- CHECKLIST ---"
  echo " size: $(wc -c < CHECKLIST.md) chars / $(wc -l < CHECKLIST.md) lines"
  echo " done(x): $(grep -cE '^[ ]*- \[x\]' CHECKLIST.md), todo([ ]): $(grep -cE '^[ ]*- \[ \]' CHECKLIST.md), skipped(!): $(grep -cE '^[ ]*- \[!\]' CHECKLIST.md)"
  echo ""
  echo "--- PLAN.md ---"
  echo " size: $(wc -c < PLAN.md) chars / $(wc -l < PLAN.md) lines"
  echo ""
  echo "--- last 5 commits ---"
  git log --oneline -5 | sed 's/^/ /'
  echo ""
  echo "--- docker container ---"
  docker ps -a --filter name=vllm-spark-head --format ' {{.Status}} / {{.RunningFor}}'
  echo ""
  echo "--- vLLM container, last 60 lines ---"
  docker logs --tail 60 vllm-spark-head 2>&1 | sed 's/^/ /'
  echo ""
  echo "--- nvidia-smi ---"
  nvidia-smi --query-gpu=name,memory.used,memory.free,memory.total --format=csv,noheader | sed 's/^/ /'
  echo ""
  echo "--- GPU scheduler status ---"
  "$GPU_SCHED" status 2>&1 | sed 's/^/ /'
  echo "===== END ====="
  echo ""
}

ensure_vllm_alive() {
  local context_iter="$1"
  local context_item="$2"
  local context_prompt_size="$3"
  # stage 1: health check (alive -> return at once)
  if curl -sS --max-time 3 "$VLLM_BASE_URL/models" > /dev/null 2>&1; then
    return 0
  fi
  echo "💀 vLLM not answering: capturing diagnostics, then restarting"
  bench_mark dead
  # stage 2: diagnostics
  capture_diagnostics "$context_iter" "$context_item" "$context_prompt_size" >> "$DEATH_LOG"
  bench_mark recorded
  echo "📝 diagnostics written: $DEATH_LOG"
  # stage 3: restart (first try -> 30 s wait -> second try)
  echo "🔁 restarting vLLM (1st)"
  if ! "$START_VLLM" 2>&1 | tail -10; then
    echo "❌ 1st restart failed: retrying in ${RETRY_WAIT}s"
    sleep "$RETRY_WAIT"
    echo "🔁 restarting vLLM (2nd)"
    if ! "$START_VLLM" 2>&1 | tail -10; then
      return 1
    fi
  fi
  # stage 4: re-check
  if ! curl -sS --max-time 5 "$VLLM_BASE_URL/models" > /dev/null 2>&1; then
    return 1
  fi
  echo "✅ vLLM recovered, resuming iter $context_iter"
  return 0
}

mark_skipped() {  # ITEM: its first "- [ ] ITEM" line becomes "- [!] ITEM" (rebuilt)
  awk -v line="- [ ] $1" '!done && $0 == line { $0 = "- [!]" substr($0, 6); done = 1 } { print }' \
    CHECKLIST.md > CHECKLIST.md.tmp && mv CHECKLIST.md.tmp CHECKLIST.md
  git commit -q -m "skip: $1 ($STRIKES failures)" CHECKLIST.md
}

main() {
  mkdir -p "$LOG_DIR"
  local iter=0 next item prompt prompt_size head_before
  declare -A strikes=()
  while [ "$iter" -lt "$MAX_ITER" ]; do
    iter=$((iter + 1))
    # next item (rebuilt)
    next=$(grep -n '^- \[ \]' CHECKLIST.md | head -1 || true)
    if [ -z "$next" ]; then
      echo "CHECKLIST done after $((iter - 1)) iterations"
      exit 0
    fi
    item="${next#*- \[ \] }"
    # 1st call: at the start of the iteration
    if ! ensure_vllm_alive "$iter" "$item" ""; then
      echo "❌ vLLM cannot be recovered: stopping the loop"
      exit 4
    fi
    # the prompt (rebuilt: the item and the last commits, as runbooks/demo.yaml)
    prompt="Read PLAN.md. Do exactly this item, tick it in CHECKLIST.md, commit: $item
Recent commits:
$(git log --oneline -5)"
    prompt_size=$(printf '%s' "$prompt" | wc -c)
    head_before=$(git rev-parse HEAD)
    bench_mark agent-start
    timeout "$AGENT_TIMEOUT" "$AGENT" "$prompt"
    # 2nd call: right after the agent
    if ! curl -sS --max-time 3 "$VLLM_BASE_URL/models" > /dev/null 2>&1; then
      echo "💀 vLLM died during the agent call"
      bench_mark death-seen
      ensure_vllm_alive "$iter (post-opencode)" "$item" "$prompt_size" || exit 4
    fi
    # verification hook (rebuilt): ticked and committed, else a strike
    if grep -qxF -- "- [x] $item" CHECKLIST.md && [ "$(git rev-parse HEAD)" != "$head_before" ] \
      && [ -z "$(git status --porcelain)" ]; then
      unset 'strikes[$item]'
    else
      strikes["$item"]=$((${strikes["$item"]:-0} + 1))
      echo "strike ${strikes["$item"]}/$STRIKES: $item"
      if [ "${strikes["$item"]}" -ge "$STRIKES" ]; then
        mark_skipped "$item"
        unset 'strikes[$item]'
      fi
    fi
  done
  echo "stopped at MAX_ITER=$MAX_ITER"
  exit 5
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  main "$@"
fi
