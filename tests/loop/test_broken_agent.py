"""Agents that fail: a broken agent stops the loop with exit 6 instead of burning the checklist,
an item the agent cannot do is still skipped, and the agent's own words (cleaned, capped,
masked) reach strikes, the console, `status` and death records.

`ralph-run` runs as a subprocess on a real git repository; the agents are bash scripts.
"""

from __future__ import annotations

import json
import uuid

import pytest
from test_loop import Loop, events, of_kind

from ralph_runner.durable.redaction import Redactor
from ralph_runner.loop import failures
from ralph_runner.process import output_text

pytestmark = pytest.mark.timeout(90)

ITEMS = ["first thing", "second thing", "third thing", "fourth thing"]

# opencode with a model it does not know: a coloured error, with numbers that differ each time.
MODEL_NOT_FOUND = r"""#!/bin/bash
echo "$2" >> "$1"
echo "opencode 1.18.33 starting in $PWD"
printf '\033[1m\033[31mError:\033[0m Model not found: vllm/qwen3-%s (request %s, %ss)\n' \
  "$RANDOM" "$(date +%N)" "$RANDOM"
exit 1
"""

# Fails on one item only, with the same words as the broken agent; does the others.
PICKY = r"""#!/bin/bash
echo "$2" >> "$1"
case "$2" in
  hard*) echo "Error: Model not found: vllm/qwen3"; exit 1 ;;
esac
sed -i '0,/^- \[ \] /s//- [x] /' CHECKLIST.md
git commit -qam "done: $2"
"""

# Exits 0 at once without touching anything, saying something different each time.
IDLE = r"""#!/bin/bash
echo "$2" >> "$1"
echo "nothing to do: $(head -c 12 /dev/urandom | base64 | tr -d '0-9+/=')"
"""

# Works on every item (touches PLAN.md) but never finishes one: hard items, not a broken agent.
SLOW_LAZY = r"""#!/bin/bash
echo "$2" >> "$1"
echo "half-done: $2" >> PLAN.md
"""


def agent_loop(workspace: Loop, script: str, items: list[str], **changes) -> Loop:
    """The workspace with `script` as the agent: `agent LOG ITEM`."""
    agent = workspace.root / "agent.sh"
    agent.write_text(script)
    agent.chmod(0o755)
    steps = {
        "loop": {
            "steps": [
                {"name": "agent", "shell": "{{ agent }} {{ log }} {{ item.text }}", "timeout": 20},
                {"verify": {"checked": True, "committed": True}},
            ]
        }
    }
    return workspace.setup(items, **{**steps, **changes})


def calls(loop: Loop) -> list[str]:
    log = loop.root / "agent.log"
    return log.read_text().splitlines() if log.exists() else []


@pytest.fixture
def loop(tmp_path):
    workspace = Loop(tmp_path, f"m{uuid.uuid4().hex[:12]}")
    yield workspace
    assert workspace.close() == [], "a test left agent processes behind"


def test_model_not_found_stops_with_exit_6_after_one_skip_and_says_why(loop):
    agent_loop(loop, MODEL_NOT_FOUND, ITEMS)
    done = loop.run()
    assert done.returncode == 6, done.stderr
    # strikes 3: the first item takes its three strikes (one item failing proves nothing), the
    # first failure on the second item is the same one: stop, with no strike against it
    assert calls(loop) == ["first thing"] * 3 + ["second thing"]
    checklist = loop.checklist()
    assert "- [!] first thing\n- [ ] second thing\n- [ ] third thing\n- [ ] fourth thing\n" in (
        checklist
    )
    all_events = events(done.stdout)
    assert [s["item"] for s in of_kind(all_events, "skip")] == ["first thing"]
    assert [s["item"] for s in of_kind(all_events, "strike")] == ["first thing"] * 3
    (broken,) = of_kind(all_events, "agent-broken")
    assert (broken["previous_item"], broken["item"]) == ("first thing", "second thing")
    assert broken["skipped"] == ["first thing"] and broken["exit_code"] == 6
    assert broken["reason"].startswith("agent: exit 1: Error: Model not found: vllm/qwen3-")
    assert "Model not found" in broken["output_tail"] and "\x1b" not in done.stdout
    assert "opencode 1.18.33 starting" in broken["output_tail"]
    assert "the agent is broken" in done.stderr and "'first thing'" in done.stderr
    assert "Traceback" not in done.stderr

    saved = loop.state()
    assert saved["status"] == "agent-broken" and saved["strikes"] == {}
    assert saved["agent_broken"]["skipped"] == ["first thing"]
    status = loop.command("status", str(loop.work))
    assert "status:     not running (agent-broken)" in status.stdout
    assert "agent:      broken: agent: exit 1: Error: Model not found" in status.stdout
    assert "skipped:    'first thing'" in status.stdout
    as_json = json.loads(loop.command("status", str(loop.work), "--json").stdout)
    assert as_json["status"] == "agent-broken"
    assert as_json["agent_broken"]["skipped"] == ["first thing"]
    assert as_json["agent_broken"]["items"] == ["first thing", "second thing"]

    # Run again without fixing it: it stops at its first failure, nothing more is skipped.
    again = loop.run()
    assert again.returncode == 6, again.stderr
    assert calls(loop)[4:] == ["second thing"]
    assert loop.checklist() == checklist
    assert of_kind(events(again.stdout), "agent-broken")[0]["skipped"] == ["first thing"]


def test_a_missing_agent_binary_stops_with_exit_6(loop):
    agent_loop(
        loop,
        MODEL_NOT_FOUND,
        ITEMS,
        checklist={"path": "CHECKLIST.md", "strikes": 2},
        loop={"steps": [{"name": "agent", "shell": "no-such-agent-xyz {{ item.text }}"}]},
    )
    done = loop.run()
    assert done.returncode == 6, done.stderr
    all_events = events(done.stdout)
    (broken,) = of_kind(all_events, "agent-broken")
    assert broken["reason"].startswith("agent: exit 127: ")
    assert "no-such-agent-xyz: command not found" in broken["output_tail"]
    assert broken["skipped"] == ["first thing"]
    assert len(of_kind(all_events, "skip")) == 1
    assert loop.checklist().count("- [ ] ") == 3


def test_an_item_the_agent_cannot_do_is_skipped_and_the_rest_is_done(loop):
    agent_loop(loop, PICKY, ["easy one", "hard one", "easy two", "easy three"])
    done = loop.run()
    assert done.returncode == 0, done.stderr
    assert "- [x] easy one\n- [!] hard one\n- [x] easy two\n- [x] easy three\n" in loop.checklist()
    assert calls(loop) == ["easy one", "hard one", "hard one", "hard one", "easy two", "easy three"]
    all_events = events(done.stdout)
    assert not of_kind(all_events, "agent-broken")
    strikes = of_kind(all_events, "strike")
    assert [s["reason"] for s in strikes] == [
        "agent: exit 1: Error: Model not found: vllm/qwen3"
    ] * 3
    assert loop.state()["status"] == "finished"


def test_an_agent_that_exits_at_once_without_touching_the_repository_stops_the_loop(loop):
    agent_loop(loop, IDLE, ITEMS, checklist={"path": "CHECKLIST.md", "strikes": 2})
    done = loop.run()
    assert done.returncode == 6, done.stderr
    assert calls(loop) == ["first thing", "first thing", "second thing"]
    (broken,) = of_kind(events(done.stdout), "agent-broken")
    assert broken["reason"] == "verify: item not ticked; no new commit"
    assert broken["skipped"] == ["first thing"]


def test_an_agent_that_works_but_never_finishes_skips_items_as_before(loop):
    agent_loop(loop, SLOW_LAZY, ITEMS[:3], checklist={"path": "CHECKLIST.md", "strikes": 1})
    done = loop.run()
    assert done.returncode == 0, done.stderr  # it touched the repository each time: hard items
    assert loop.checklist().count("- [!] ") == 3
    assert not of_kind(events(done.stdout), "agent-broken")


def test_strike_reasons_are_clean_capped_masked_and_cut_at_a_word(loop):
    noisy = (
        "#!/bin/bash\n"
        'echo "$2" >> "$1"\n'
        "for i in $(seq 1 100); do"
        " printf '\\033[32mprogress %d\\033[0m\\r\\033[2Kline %d of 100\\n' $i $i; done\n"
        "printf 'fatal: %s token sk-abcdefghijklmnopqrstuvwx\\n' "
        '"$(for w in $(seq 1 80); do printf "word%d " $w; done)"\n'
        "exit 3\n"
    )
    agent_loop(loop, noisy, ["only item"], checklist={"path": "CHECKLIST.md", "strikes": 1})
    done = loop.run()
    assert done.returncode == 0, done.stderr
    (strike,) = of_kind(events(done.stdout), "strike")
    reason, tail = strike["reason"], strike["output_tail"]
    assert reason.startswith("agent: exit 3: fatal: word1 word2 ") and reason.endswith("…")
    assert len(reason) <= len("agent: exit 3: ") + output_text.REASON_CHARS + 1
    assert reason[: -len("…")].split()[-1].startswith("word")  # a whole word before the cut
    assert "\x1b" not in tail and "\r" not in tail and "progress" not in tail
    lines = tail.split("\n")
    assert len(lines) <= failures.TAIL_LINES and len(tail.encode()) <= failures.TAIL_BYTES
    assert lines[-1].startswith("fatal: word1") and lines[-1].endswith("token ****")
    assert "line 100 of 100" in tail and "sk-abc" not in done.stdout


def test_verbose_names_how_a_step_failed_and_never_says_exit_none(loop):
    agent_loop(loop, IDLE, ["one item"], checklist={"path": "CHECKLIST.md", "strikes": 1})
    done = loop.run("-v", json_lines=False)
    assert done.returncode == 0, done.stderr
    assert "exit None" not in done.stdout
    assert "✗ verify" in done.stdout and "item not ticked; no new commit" in done.stdout


def test_a_death_record_carries_the_killed_agents_last_words(loop):
    talker = (
        "#!/bin/bash\n"
        'echo "$2" >> "$1"\n'
        "printf '\\033[36mthinking about %s\\033[0m\\n' \"$2\"\n"
        "echo 'POST /v1/chat/completions (stream)'\n"
        'if [ "$(grep -c . "$1")" = 1 ]; then rm -f "$ALIVE"; sleep 60; fi\n'
        "sed -i '0,/^- \\[ \\] /s//- [x] /' CHECKLIST.md; git commit -qam done\n"
    )
    agent_loop(
        loop,
        talker,
        ["the item"],
        service=True,
        health={"watch": 0.2},
        loop={
            "steps": [
                {
                    "name": "agent",
                    "shell": "{{ agent }} {{ log }} {{ item.text }}",
                    "env": {"ALIVE": "{{ alive }}"},
                    "timeout": 30,
                },
                {"verify": {"checked": True, "committed": True}},
            ]
        },
    )
    done = loop.run()
    assert done.returncode == 0, done.stderr
    records = [
        json.loads(line) for line in (loop.work / "logs" / "deaths.jsonl").read_text().splitlines()
    ]
    death = records[0]
    assert death["event"] == "death" and death["phase"] == "during-step"
    step = death["step"]
    assert step["name"] == "agent" and step["killed"] is True
    assert step["output_tail"] == "thinking about the item\nPOST /v1/chat/completions (stream)"
    assert not of_kind(events(done.stdout), "strike")


# -- the parts, on their own -------------------------------------------------------------------
def test_clean_strips_escapes_and_keeps_the_last_overwrite_of_a_line():
    text = "\x1b[1m\x1b[31mError:\x1b[0m bad\n10%\r50%\r100%\n\x1b]0;title\x07done\x07  \n\n"
    assert output_text.clean(text) == "Error: bad\n100%\ndone"


def test_one_line_cuts_at_a_word_boundary_or_not_at_all():
    assert output_text.one_line("short words") == "short words"
    long = " ".join(f"word{n}" for n in range(100))
    cut = output_text.one_line(long, 50)
    assert cut.endswith("…") and len(cut) <= 51 and long.startswith(cut[:-1])
    assert cut[:-1].split()[-1] in long.split()
    unbroken = "x" * 300
    assert output_text.one_line(unbroken, 50) == unbroken


def test_output_tail_masks_before_it_cuts():
    secret = "hunter2-secret-value"
    text = "\n".join(f"line {n}" for n in range(50)) + f"\nkey={secret}\n"
    tail = failures.output_tail(text, Redactor([secret]))
    assert tail.split("\n")[-1] == "key=****" and len(tail.split("\n")) == failures.TAIL_LINES


def test_the_same_error_on_different_items_normalises_to_one_signature():
    one = failures.normalise("Model not found: qwen-123 at /tmp/x/y.json (id 9f8e7d6c5b4a)", "a")
    two = failures.normalise("Model not found: qwen-9 at /home/u/z (id 0a1b2c3d4e5f)", "a")
    assert one == two
    assert failures.normalise("cannot do first item", "first item") == failures.normalise(
        "cannot do second item", "second item"
    )
