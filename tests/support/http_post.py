"""`python http_post.py URL`: an empty POST to URL on loopback, for the shell steps and programs
that tests write (an agent that hangs the engine, a recovery that resumes it), so that the
system tier needs no curl. Exit 0 on a 2xx answer, 1 otherwise (with why on stderr); the
answer's body is capped and the call has a deadline, as every read from a server.
`post_command(url)` is the shell words that run it with this interpreter."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import httpx

DEADLINE_S = 10.0
MAX_BODY = 64 * 1024


def post_command(url: str) -> str:
    """The shell command that POSTs to `url` (this interpreter, this file)."""
    return shlex.join([sys.executable, str(Path(__file__).resolve()), url])


def post(url: str) -> int:
    try:
        with httpx.stream("POST", url, timeout=DEADLINE_S) as answer:
            body = b""
            for chunk in answer.iter_bytes():
                body += chunk
                if len(body) > MAX_BODY:
                    break
    except httpx.HTTPError as error:
        print(f"http_post: {url}: {error}", file=sys.stderr)
        return 1
    if not answer.is_success:
        print(f"http_post: {url}: HTTP {answer.status_code}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(post(sys.argv[1]))
