"""Each event in words, as the console shows it (`human_line`); `Painter` colours a part of a
line, or leaves it plain."""

from __future__ import annotations

from collections.abc import Callable

from ralph_runner import events
from ralph_runner.output import durations
from ralph_runner.output.text import columns, plural, step_ended

Painter = Callable[[str, str], str]
STRIKE_TAIL_LINES = 5  # the agent's last words under a strike; the whole tail is in --json


def human_line(event: events.Event, p: Painter, verbose: int = 1) -> str | None:
    """The console's line for `event` (`p` paints a colour); None when it has none: a `Step`
    below -v, an `IterationEnded` (done, retry, strike, skip... said it to people), a kind this
    ralph-run does not know."""
    e = event
    match e:
        case events.Resume():
            return p("yellow", f"resuming at iteration {e.iteration} ({e.deaths} deaths so far)")
        case events.IterationStarted():
            return p("bold", f"iteration {e.iteration}: {e.item}") + p(
                "dim",
                f"  (strikes {e.attempts}, prompt {e.prompt_size} chars; {e.done} done, "
                f"{e.todo} todo, {e.skipped} skipped, {e.deaths} deaths)",
            )
        case events.Step():
            whose = f"[{e.worker}] " if e.worker is not None else ""
            return f"  → {whose}{e.step}" if verbose else None
        case events.StepDone():
            mark = p("green", "✓") if e.ok else p("red", "✗")
            failed = "" if e.ok else " " + p("red", _step_status(e))
            whose = f"[{e.worker}] " if e.worker is not None else ""
            return f"  {mark} {whose}{e.step} " + p("dim", f"{e.seconds:.1f}s") + failed
        case events.Watch():
            return p("red", f"  ! service died during {e.step}: step killed")
        case events.Death():
            cause = f"{e.fault} ({e.reason})" if e.fault else e.reason
            return p("red", f"💀 death #{e.death} at {e.phase}: {cause}")
        case events.Capture():
            line = f"  capturing {e.collectors} diagnostics"
            if e.during_recovery:
                line += (
                    f" (while {e.during_recovery} recovers it: its record holds the moment of "
                    "death)"
                )
            return line
        case events.Report():
            line = (
                f"  📝 report appended to {e.log}"
                if e.written
                else p("red", f"  ⚠ report not written ({e.error}): its record is on stderr")
            )
            return line + (f"\n  🔎 signature: {e.signature}" if e.signature else "")
        case events.Start():
            return p("yellow", f"▶ {e.service} is not running: starting it ({e.reason})")
        case events.Started():
            if e.recovered:
                return p("green", f"  ✅ started in {e.seconds:.1f}s")
            return p("red", f"  ❌ not started: {e.reason}")
        case events.RecoveryWait():
            return f"  ⏳ another loop recovers it: waiting for {e.by}"
        case events.RecoveryStep():
            if e.skipped:
                return p(
                    "dim", f"  ⏭ recovery attempt {e.attempt}: {e.step}: skipped ({e.skipped})"
                )
            return f"  🔁 recovery attempt {e.attempt}: {e.step}"
        case events.RecoveryFailed():
            then = "no attempt left" if e.retry_in is None else f"retrying in {e.retry_in:g} s"
            return p("yellow", f"  attempt {e.attempt} failed ({e.reason}): {then}")
        case events.Recovery():
            if not e.recovered:
                return p("red", f"  ❌ not recovered: {e.reason}")
            if e.by:
                return p("green", f"  ✅ up again in {e.seconds:.1f}s, brought back by {e.by}")
            return p("green", f"  ✅ recovered in {e.seconds:.1f}s ({e.attempts} attempt(s))")
        case events.RejuvenationDue():
            landing = (
                f": {plural(e.in_flight, 'attempt')} in flight land first" if e.in_flight else ""
            )
            return p("cyan", f"♻ restart due at the next item boundary ({e.reason}){landing}")
        case events.Rejuvenated():
            if not e.recovered:
                return p("red", f"  ♻ rejuvenation {e.rejuvenation} failed: {e.error}")
            line = (
                f"  ♻ rejuvenated ({', '.join(e.signs)}) in {e.seconds:.1f}s: no death, no strike"
            )
            return p("green", line)
        case events.Recorder():
            return p("dim", f"  recorder: {e.message}")
        case events.Receipt():
            return p(
                "dim",
                f"  🧾 {plural(e.requests, 'request')}: {e.prompt_tokens} prompt + "
                f"{e.generated_tokens} generated tokens",
            )
        case events.Output():
            return p("dim", "    │ ") + e.text
        case events.Warned():
            return p("yellow", f"  warning: {e.message}")
        case events.Done():
            return p("green", f"  done: {e.item}")
        case events.Retry():
            return p("yellow", "  service died during this attempt: retrying the item, no strike")
        case events.Strike():
            return p("yellow", f"  strike {e.strikes}/{e.of}: {e.reason}") + _tail(
                e.output_tail, p, STRIKE_TAIL_LINES, 2
            )
        case events.Skip():
            return p("red", f"  skipped after {e.strikes} failures: {e.item}")
        case events.ItemSetAside():
            return p("red", f"  set aside (- [!]): {e.item}: {e.reason}") + p(
                "dim", "; the run goes on ('- [ ]' tries it again)"
            )
        case events.AgentFoundBroken():
            skipped = (
                "; skipped meanwhile: " + ", ".join(repr(i) for i in e.skipped)
                if e.skipped
                else "; nothing was skipped"
            )
            return (
                p(
                    "red",
                    f"✋ the agent is broken: it failed the same way on {e.previous_item!r} and "
                    f"{e.item!r} while the service was healthy: {e.reason}",
                )
                + _tail(e.output_tail, p, None)
                + "\n"
                + p("red", f"  stopped instead of skipping the rest (exit {e.exit_code}){skipped}")
            )
        case events.PauseRequested():
            by = f" by {e.by}" if e.by else ""
            when = ": stopping the step now" if e.now else ": after this iteration"
            return p("yellow", f"  pause asked for{by}{when}")
        case events.Paused():
            killed = f" ({e.killed} stopped, no strike: {e.item!r} comes again)" if e.killed else ""
            return p(
                "yellow", f"⏸ paused{killed} before the next iteration: `ralph-run resume` goes on"
            )
        case events.Resumed():
            return p("green", f"▶ resumed after {e.seconds:.0f} s paused")
        case events.PauseStep() | events.ResumeStep():
            which = "pause" if isinstance(e, events.PauseStep) else "resume"
            if e.skipped:
                return p("dim", f"  ⏭ {which} step: {e.step}: skipped ({e.skipped})")
            return f"  {'⏸' if which == 'pause' else '▶'} {which} step: {e.step}"
        case events.PauseSteps():
            if e.ok:
                return p("green", f"  pause steps done in {e.seconds:.1f}s")
            return p("red", f"  pause steps failed: {e.error}; still paused (no death, no strike)")
        case events.ResumeSteps():
            if e.ok:
                return p("green", f"  resume steps done in {e.seconds:.1f}s")
            return p(
                "yellow",
                f"  resume steps failed: {e.error}; going on: the service is checked now, "
                "and started if nothing listens",
            )
        case events.BlockStep():  # the runbook's setup: and teardown: (loop/lifecycle.py)
            if e.skipped:
                return p("dim", f"  ⏭ {e.block} step: {e.step}: skipped ({e.skipped})")
            return f"  {'🔑' if e.block == 'setup' else '🧹'} {e.block} step: {e.step}"
        case events.BlockSteps():
            if e.ok:
                return p("green", f"  {e.block} steps done in {e.seconds:.1f}s")
            then = "the run stops"
            if e.block == "teardown":
                held = e.held is not False
                then = "what setup holds may be held still" if held else "setup acquired nothing"
            return p("red", f"  {e.block} steps failed: {e.error}; {then}")
        case events.UsageLimitHit():
            reset = "  no reset time given" if e.guessed else f"  it resets at {e.reset}"
            then = (
                f": further than limits.max_wait, stopped (exit {e.exit_code}), no strike"
                if e.ends_run
                else f": waiting {durations.span(e.seconds)}, then the item again (no strike)"
            )
            return (
                p("yellow", f"  ⏳ usage limit ({e.source}): {e.line}")
                + "\n"
                + p("red" if e.ends_run else "yellow", reset + then)
            )
        case events.LimitedWait():
            return p("dim", f"  ⏳ usage limit: {durations.span(e.seconds)} left (until {e.until})")
        case events.Interrupted():
            return p("yellow", f"interrupted by {e.signal}: state saved (exit {e.exit_code})")
        case events.WorkerStarted():
            strikable = "" if e.strikable else " (earlier items unsettled: no strike if it fails)"
            return p("bold", f"worker {e.worker}: iteration {e.iteration}: {e.item}") + p(
                "dim", f"  on {e.branch}{strikable}"
            )
        case events.WorkerLanded():
            return p("green", f"  worker {e.worker} landed {e.item!r}") + p(
                "dim", f"  ({plural(e.commits, 'commit')}, head {e.head[:10]})"
            )
        case events.WorkerConflict():
            return p(
                "yellow",
                f"  worker {e.worker}: {e.item!r} conflicts with what landed "
                f"({e.conflicts}/{e.of}): retried on the new head, no strike",
            )
        case events.WorkerRetry():
            then = "once the earlier items settle" if e.waits else "now"
            line = f"  worker {e.worker}: {e.item!r} again {then}, no strike ({e.reason})"
            return p("yellow", line)
        case events.Governed():
            more = "admitted" if e.workers > e.was else "shed"
            line = f"  governor: {e.was} -> {e.workers} of {e.of} workers ({more}: {e.reason})"
            return p("cyan", line)
        case events.Summary():
            how = "stopped at max_iterations: " if e.stopped_at_max else "checklist finished: "
            if not (e.iterations or e.todo or e.stopped_at_max):  # this run had nothing to do
                how = "nothing to do: no '- [ ]' item in the checklist"
                if e.malformed:
                    how += f" ({plural(e.malformed, 'line')} like an item but not one: see above)"
                how += ": "
            return p(
                "bold",
                f"{how}{plural(e.iterations, 'iteration')}, {e.done} done, {e.todo} todo, "
                f"{e.skipped} skipped{f' ({e.set_aside} set aside)' if e.set_aside else ''}, "
                f"{plural(e.deaths, 'death')}, {e.seconds:.1f}s",
            ) + "".join(
                p("dim", f"\n  {count} x {signature}") for signature, count in e.signatures.items()
            )
        case events.Fleet():
            return p("bold", f"{len(e.hosts)} hosts, {e.forks} at a time: {', '.join(e.hosts)}")
        case events.HostDone():
            colour = "green" if e.exit_code == 0 else "yellow"
            return p(colour, f"loop ended: exit {e.exit_code}")
        case events.HostSays():
            return e.text
        case events.FleetSummary():
            return _fleet_table(e, p)
    return None


def _step_status(e: events.StepDone) -> str:
    """How a failed step ended: the loop's words (loop/failures.status_text), else the same
    words from the event's fields; never "exit None"."""
    return e.status or step_ended(e.exit_code, e.timed_out, e.killed) or "failed"


def _tail(tail: str | None, p: Painter, lines: int | None, least: int = 1) -> str:
    """An output tail as indented lines under its event (the last `lines`, None: all), if it
    has at least `least` lines (a strike's reason holds the last line already)."""
    shown = [line for line in (tail or "").split("\n") if line.strip()]
    if len(shown) < least:
        return ""
    if lines is not None:
        shown = shown[-lines:]
    return "".join("\n" + p("dim", "    │ ") + line for line in shown)


def _fleet_table(e: events.FleetSummary, p: Painter) -> str:
    """The fleet's end: one row per host."""
    header = ("host", "done", "todo", "skipped", "deaths", "exit")
    rows = [
        [str(v if v is not None else "-") for v in (r["host"], r["done"], r["todo"], r["skipped"],
                                                     r["deaths"], r["exit_code"])]
        for r in e.hosts
    ]  # fmt: skip
    lines = columns([header, *rows])
    return "\n".join([p("bold", lines[0]), *lines[1:], p("bold", f"fleet exit code {e.exit_code}")])
