"""`python -m ralph_runner.standin.start PORT STATE_DIR`: the stand-in's idempotent start script
(start_server.sh, in this package), run with this interpreter as its PYTHON.

A runbook names the module, not the script's path: a copy of demo.yaml saved anywhere starts
the stand-in with `{{ ralph_python }} -m ralph_runner.standin.start {{ port }} {{ standin_dir }}`
(the script's usage and its environment variables: start_server.sh's header).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().with_name("start_server.sh")


def main(argv: list[str]) -> None:
    if any(arg in ("-h", "--help") for arg in argv):
        print(f"usage: python -m ralph_runner.standin.start PORT STATE_DIR\n\n{__doc__}")
        return
    env = {**os.environ, "PYTHON": os.environ.get("PYTHON", sys.executable)}
    os.execvpe("bash", ["bash", str(SCRIPT), *argv], env)


if __name__ == "__main__":
    main(sys.argv[1:])
