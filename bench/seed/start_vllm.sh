#!/usr/bin/env bash
# The seed's start_vllm.sh, rebuilt from the excerpt in the blog post: idempotent (a healthy
# server is left alone), `docker compose up -d`, then poll the health URL 90 x 4 s.
# $COMPOSE_UP stands for `cd $VLLM_DIR && docker compose --profile head up -d`.
HEALTH_URL="${HEALTH_URL:-http://127.0.0.1:8000/health}"
COMPOSE_UP="${COMPOSE_UP:?the command that starts the container in the background}"

# already healthy -> skip
if curl -sf "$HEALTH_URL" >/dev/null 2>&1; then
  echo "[start_vllm] vLLM already running"
  exit 0
fi

# start the container
"$COMPOSE_UP" 2>&1 | tail -5

# poll health (vLLM's cold start takes ~3 min)
for i in $(seq 1 90); do
  if curl -sf "$HEALTH_URL" >/dev/null 2>&1; then
    break
  fi
  sleep 4
done
