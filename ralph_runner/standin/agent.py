"""A stand-in coding agent: one chat completion, then tick its checklist item and commit.

Its item is the one its prompt names (the shipped prompts end with `{{ item.text }}`): the open
item whose text the prompt holds (the longest, when several do), else the first open one. So
with `workers: N` each agent ticks the item in hand in its own worktree, as a real agent does.

It behaves like `opencode run` as the loop sees it: it needs the LLM server, it streams the
answer (`"stream": true`, server-sent events, as opencode, aider and codex all do), and when the
call fails (refused, no byte for `--timeout` s, an error status, an error in the stream, a
stream cut before `[DONE]`) it prints a short error and exits 1 having changed nothing, so
ralph-run's verify step and death detection see what they would see in a real run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

# A todo item as GitHub task lists write it (ralph-run's checklist grammar): a `-`, `*`, `+` or
# `1.`/`1)` marker, `[ ]`, text. The stand-in is a program of its own (it imports nothing of
# ralph-run), as a real agent is: it reads the checklist its own way.
UNCHECKED = re.compile(rb"^[ \t]*(?:[-*+]|\d{1,9}[.)])[ \t]+(\[ \])[ \t]+(\S.*?)\r?$", re.MULTILINE)
FENCE = re.compile(rb"^[ \t]{0,3}(```|~~~)", re.MULTILINE)


def ask(url: str, model: str, prompt: str, timeout: float, max_tokens: int = 16) -> str:
    """One streamed chat completion, its content deltas joined; raises httpx.HTTPError or
    ValueError saying what went wrong. `timeout` bounds each wait for the next bytes; a
    `max_tokens` other than 16 is generated in full (vLLM's `ignore_eos`)."""
    payload: dict[str, object] = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if max_tokens != 16:
        payload["ignore_eos"] = True
    endpoint = f"{url.rstrip('/')}/chat/completions"
    with httpx.stream("POST", endpoint, json=payload, timeout=timeout) as response:
        if response.status_code != httpx.codes.OK:
            raise ValueError(f"HTTP {response.status_code}: {response.read().decode()[:200]}")
        parts: list[str] = []
        for data in sse_data(response.iter_lines()):
            if data == "[DONE]":
                return "".join(parts)
            chunk = json.loads(data)
            if "error" in chunk:
                raise ValueError(f"error in the stream: {chunk['error'].get('message')}")
            parts += [c["delta"].get("content") or "" for c in chunk["choices"]]
    raise ValueError("the stream ended before [DONE]")


def sse_data(lines: Iterator[str]) -> Iterator[str]:
    """The data of each server-sent event (its `data:` lines joined), as the standard reads."""
    data: list[str] = []
    for line in lines:
        if not line:
            if data:
                yield "\n".join(data)
            data = []
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
    if data:
        yield "\n".join(data)


def tick(checklist: Path, prompt: str = "") -> str | None:
    """Turns its item's `[ ]` into `[x]`, every other byte unchanged: the open item whose text
    the prompt holds (the longest such), else the first open one (none inside a ``` or ~~~
    fence); the item's text, or None when none is left."""
    data = checklist.read_bytes()
    todo = [
        match
        for match in UNCHECKED.finditer(data)
        if len(FENCE.findall(data[: match.start()])) % 2 == 0  # not inside a fence
    ]
    named = [m for m in todo if _text(m) and _text(m) in prompt]
    chosen = max(named, key=lambda m: len(_text(m))) if named else (todo[0] if todo else None)
    if chosen is None:
        return None
    start, end = chosen.span(1)
    checklist.write_bytes(data[:start] + b"[x]" + data[end:])
    return _text(chosen)


def _text(match: re.Match[bytes]) -> str:
    return match.group(2).decode("utf-8", errors="replace").strip()


def commit(message: str) -> str:
    """`git add -A && git commit`; the new commit's short hash."""
    subprocess.run(["git", "add", "-A"], check=True, capture_output=True)
    subprocess.run(["git", "commit", "-q", "-m", message], check=True, capture_output=True)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], check=True, capture_output=True)
    return head.stdout.decode().strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ralph_runner.standin.agent", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--url",
        default=os.environ.get("RALPH_BASE_URL"),  # off the command line: `ps` shows that
        required="RALPH_BASE_URL" not in os.environ,
        help="OpenAI base URL, e.g. http://127.0.0.1:8000/v1 (default: $RALPH_BASE_URL)",
    )
    parser.add_argument("--model", required=True)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for the LLM call")
    parser.add_argument("--checklist", type=Path, default=Path("CHECKLIST.md"))
    parser.add_argument("--no-commit", action="store_true", help="tick the item but never commit")
    parser.add_argument("--fail", action="store_true", help="exit 1 at once, without calling")
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds to think before calling")
    parser.add_argument(
        "--max-tokens", type=int, default=16, help="tokens to ask for (not 16: all of them)"
    )
    parser.add_argument("prompt", nargs="*", help="the prompt; read from stdin when absent")
    args = parser.parse_args(argv)
    prompt = " ".join(args.prompt) if args.prompt else sys.stdin.read()

    print(f"> agent · {args.model} · {len(prompt)} chars of prompt", flush=True)
    if args.fail:
        print("Error: agent failed (--fail)", file=sys.stderr)
        return 1
    time.sleep(args.sleep)
    try:
        reply = ask(args.url, args.model, prompt, args.timeout, args.max_tokens)
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError, AttributeError) as error:
        print(f"Error: {args.url}: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    print(f"model: {reply}", flush=True)
    try:
        item = tick(args.checklist, prompt)
    except OSError as error:
        print(f"Error: {error}", file=sys.stderr)
        return 1
    if item is None:
        print(f"nothing left to do in {args.checklist}")
        return 0
    print(f"ticked: {item}")
    if not args.no_commit:
        try:
            print(f"committed {commit(f'done: {item}')}: done: {item}")
        except subprocess.CalledProcessError as error:
            print(f"Error: {error}: {error.stderr.decode(errors='replace')}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
