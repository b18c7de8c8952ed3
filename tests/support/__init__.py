"""What the test folders share: the helpers that more than one folder imports (`support.standin`,
`support.e2e`, `support.faithful`, ...; a helper that one folder alone uses lives beside its
tests, as `*_helpers.py`), and the suite's fixtures and tier machinery (`support.fixtures`,
`support.tiers`), loaded as pytest plugins by tests/conftest.py's `pytest_plugins`.

`tests/` is on `sys.path` through pyproject.toml's `pythonpath`, so `from support.e2e import
Scenario` works from every folder."""
