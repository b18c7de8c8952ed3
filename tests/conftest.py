"""The suite's root: it loads the shared fixtures (tests/support/fixtures.py) and the tiers
(tests/support/tiers.py) as plugins. The helpers that several folders share live in
tests/support/ (`from support.e2e import Scenario`: tests/ is on sys.path through
pyproject.toml's `pythonpath`), a folder's own in its *_helpers.py and conftest.py.

Every test belongs to one tier (its marker, given by tiers.py from where it lives): `unit` (pure
functions, no process started: the inner loop, `pytest -m unit`), `system` (real processes on
loopback: the default), and the tiers that need an install: `ssh`, `browser`, `promtool`, `docker`,
`agents`, `real`, `llamacpp`, `slurm`. The run ends with a table of the tiers: ran, skipped and why.

Under `CI=true` a green run means every tier ran. Excuses are per test: a skipped test fails the run
unless `RALPH_ALLOW_SKIP` (`tier/what: why; ...`, written by ci/run-tests.sh from the installs' own
`.cache/*.unavailable` statements) names its tier and the `what` its skip reason says is missing
(the reason's head, before its first ": ", names it: "opencode not installed at ...", "real vLLM
unavailable here: ..."). So npm failing excuses opencode's and codex's tests, not aider's. And each
install tier must have run at least one test that needs its install (`needs_install`, in tiers.py):
the ones that need nothing (the stand-in halves, the recipes) do not count as the tier having run,
unless the tier's needing tests all skipped with an excuse. With `RALPH_EVERY_TIER=1`
(ci/run-tests.sh) every tier the run's `-m` selects must run a test: a tier whose tests were all
deselected or never collected fails.
"""

pytest_plugins = ["support.tiers", "support.fixtures"]
