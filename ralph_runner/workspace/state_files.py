"""The names of ralph-run's own files in a workdir, declared once: `.ralph/` and the files of it
that more than one package reads or writes."""

from __future__ import annotations

STATE_DIR = ".ralph"
# The files of .ralph/ that other modules write, named here once: the iteration history
# (deaths/history.py) and where the death records are (deaths/wiring.py).
HISTORY_FILE = "iterations.jsonl"
SOURCES_FILE = "sources.json"
