"""`python -m ralph_runner` is `ralph-run`."""

from ralph_runner.cli import main

main()
