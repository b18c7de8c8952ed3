#!/usr/bin/env bash
# A coding agent that takes no time: tick the first "- [ ]" of CHECKLIST.md and commit.
set -euo pipefail
sed -i '0,/^- \[ \]/s//- [x]/' CHECKLIST.md
git commit -qam "done: next item"
