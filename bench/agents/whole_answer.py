"""A coding agent whose calls are not streamed (a `curl` to /chat/completions, as scripts and
batch clients send them): one call of the prompt given, answered whole, then the first item
of CHECKLIST.md ticked and committed.

    python bench/agents/whole_answer.py URL MAX_TOKENS PROMPT
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import httpx


def main(url: str, max_tokens: str, prompt: str) -> int:
    body = {
        "model": "stand-in",
        "max_tokens": int(max_tokens),
        "ignore_eos": True,
        "messages": [{"role": "user", "content": prompt}],
    }
    answer = httpx.post(f"{url}/chat/completions", json=body, timeout=600)
    if answer.status_code != 200:
        print(f"HTTP {answer.status_code}", file=sys.stderr)
        return 1
    checklist = Path("CHECKLIST.md")
    checklist.write_text(re.sub(r"^- \[ \]", "- [x]", checklist.read_text(), count=1, flags=re.M))
    subprocess.run(["git", "commit", "-qam", "done: next item"], check=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:4]))
