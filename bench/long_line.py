"""`-v` on one long line without a newline (issue 29, finding 9): the old pending-line buffer
(the whole partial line concatenated and split again at every chunk: quadratic) against
output_text.Lines (cut at 64 KiB: linear), fed the same chunks as a command's pipe gives them.

    .venv/bin/python -m bench.long_line            # 8 MB (the old way takes seconds already)
    .venv/bin/python -m bench.long_line --mb 80    # the issue's line: Lines alone, the old way
                                                   # would take minutes (--old to insist)
"""

from __future__ import annotations

import argparse
import time

from ralph_runner.process.output_text import Lines, clean

CHUNK = 64 * 1024  # what one read of the command's pipe returns at most


def old_way(chunks: list[str]) -> int:
    """The buffer before the fix: every chunk re-joins and re-splits the whole partial line."""
    pending, shown = "", 0
    for chunk in chunks:
        *lines, pending = (pending + chunk).split("\n")
        shown += len([clean(line) for line in lines])
    return shown + (1 if pending else 0)


def new_way(chunks: list[str]) -> int:
    lines = Lines()
    shown = sum(len(lines.feed(chunk)) for chunk in chunks)
    return shown + (1 if lines.end() is not None else 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=8.0, help="the line's size in MB")
    parser.add_argument("--old", action="store_true", help="time the old way past 8 MB too")
    args = parser.parse_args()
    size = int(args.mb * 1_000_000)
    chunks = ["x" * CHUNK] * (size // CHUNK) + ["x" * (size % CHUNK)]
    ways = [("Lines (64 KiB cap)", new_way)]
    if args.mb <= 8 or args.old:
        ways.append(("old partial line", old_way))
    for name, way in ways:
        started = time.perf_counter()
        count = way(chunks)
        print(f"{name:>20}: {time.perf_counter() - started:8.3f} s, {count} lines shown")


if __name__ == "__main__":
    main()
