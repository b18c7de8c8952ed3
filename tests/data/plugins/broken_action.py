"""`python broken_action.py ARGS...` is `ralph-run ARGS...` with one more action kind, `boom`,
whose run (and, with BOOM_IN_DESCRIBE=1, describe) raises: a real internal error in a real run,
for the catch-all's tests. Registered before the schema is built, as a module of
ralph_runner/actions would be."""

import os
import sys
import types

from ralph_runner import actions

boom = types.ModuleType("boom")
boom.KEY = "boom"
boom.Params = str


def _raise(params, ctx):
    rendered = ctx.templar.render(params, ctx.variables, where=ctx.where)
    raise RuntimeError(f"the boom action broke on {rendered}\nsecond line")


def _describe(params, ctx):
    if os.environ.get("BOOM_IN_DESCRIBE"):
        _raise(params, ctx)
    return "boom"


boom.run = _raise
boom.describe = _describe
actions.KINDS["boom"] = boom

from ralph_runner import cli  # noqa: E402  (after the kind is registered)

cli.main(sys.argv[1:])
