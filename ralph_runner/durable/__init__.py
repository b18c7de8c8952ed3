"""Files that survive crashes: append-only JSONL, atomic replacement."""
