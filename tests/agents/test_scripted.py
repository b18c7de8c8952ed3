"""The scripted model: the answers that make opencode, codex, aider and claude do an item.

The requests are shaped as the real agents send them (recorded in /work/notes and described in
the README's Agents section); the shell commands the model hands out are run with real bash in
a real git repository. These tests need no agent binary, so they run everywhere.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from support.e2e import make_workspace

from ralph_runner.standin.scripted import load_script, reply_for

ITEM = "add the $(road) & 'car'"
CHECKLIST = f"- [x] first\n  - [ ] {ITEM}\r\n- [ ] {ITEM} again\n"


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "script.yaml"
    path.write_text('items:\n  - match: road\n    files: {road.txt: "a road\\n"}\n')
    return path


def opencode_quoted(text: str) -> str:
    """opencode run quotes a message argument that has spaces."""
    return '"' + text.replace('"', '\\"') + '"'


def opencode_request(tool_results: list[str], workdir: str = "/work") -> dict:
    """opencode 1.18's agent request: system with its <env>, -f attachments, then the prompt."""
    system = f"You are opencode...\n<env>\n  Working directory: {workdir}\n</env>"
    prompt = opencode_quoted(f"Do exactly this item, tick it, commit: {ITEM}\n")
    attachment = "<content>\n" + "".join(
        f"{n}: {line}\n" for n, line in enumerate(CHECKLIST.splitlines(), 1)
    )
    messages = [
        {"role": "system", "content": system},
        {
            "role": "user",
            "content": [{"type": "text", "text": attachment}, {"type": "text", "text": prompt}],
        },
    ]
    for n, result in enumerate(tool_results):
        messages.append({"role": "assistant", "content": "", "tool_calls": [{"id": f"c{n}"}]})
        messages.append({"role": "tool", "tool_call_id": f"c{n}", "content": result})
    tools = [
        {"type": "function", "function": {"name": n}} for n in ("bash", "edit", "read", "write")
    ]
    return {"model": "stand-in", "stream": True, "messages": messages, "tools": tools}


def codex_request(outputs: list[str]) -> dict:
    """codex 0.171's Responses request: developer instructions, environment context, prompt."""
    items: list[dict] = [
        {
            "type": "message",
            "role": "developer",
            "content": [{"type": "input_text", "text": "You are Codex"}],
        },
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "<environment_context><cwd>/w</cwd>"}],
        },
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": f"Do it, commit: {ITEM}"}],
        },
    ]
    for n, output in enumerate(outputs):
        items.append(
            {"type": "function_call", "call_id": f"c{n}", "name": "exec_command", "arguments": "{}"}
        )
        items.append({"type": "function_call_output", "call_id": f"c{n}", "output": output})
    tools = [{"type": "function", "name": "exec_command"}, {"type": "web_search"}]
    return {"model": "stand-in", "stream": True, "input": items, "tools": tools}


def test_no_script_answers_ok_to_everything() -> None:
    assert reply_for("chat", opencode_request([]), None).text == "OK"
    assert reply_for("responses", codex_request([]), None).tool_calls == []


def test_opencode_is_led_through_read_edit_write_commit_then_a_text(script: Path) -> None:
    steps = []
    results: list[str] = []
    while True:
        reply = reply_for("chat", opencode_request(results), script)
        if not reply.tool_calls:
            break
        (call,) = reply.tool_calls
        steps.append((call.name, json.loads(call.arguments)))
        results.append("ok")
    assert reply.text == f"Done: {ITEM}"
    assert [name for name, _ in steps] == ["read", "edit", "write", "bash"]
    assert steps[0][1] == {"filePath": "/work/CHECKLIST.md"}
    assert steps[1][1]["oldString"] == f"- [ ] {ITEM}"  # the prompt's item, unquoted
    assert steps[1][1]["newString"] == f"- [x] {ITEM}"
    assert steps[2][1] == {"filePath": "/work/road.txt", "content": "a road\n"}
    assert steps[3][1]["command"].startswith("git add -A && git commit")


def test_codex_shell_commands_tick_write_and_commit_in_a_real_repo(
    tmp_path: Path, script: Path
) -> None:
    repo = make_workspace(tmp_path / "w", [])
    (repo / "CHECKLIST.md").write_bytes(CHECKLIST.encode())
    subprocess.run(["git", "-C", str(repo), "commit", "-qam", "checklist"], check=True)
    outputs: list[str] = []
    while (reply := reply_for("responses", codex_request(outputs), script)).tool_calls:
        (call,) = reply.tool_calls
        arguments = json.loads(call.arguments)
        assert call.name == "exec_command" and arguments["workdir"] == "/w"
        done = subprocess.run(["bash", "-c", arguments["cmd"]], cwd=repo, capture_output=True)
        assert done.returncode == 0, done.stderr
        outputs.append("Process exited with code 0")

    assert len(outputs) == 2  # the edit, then the commit
    expected = CHECKLIST.replace(f"  - [ ] {ITEM}\r", f"  - [x] {ITEM}\r")
    assert (repo / "CHECKLIST.md").read_bytes() == expected.encode()  # every other byte kept
    assert (repo / "road.txt").read_text() == "a road\n"
    log = subprocess.run(["git", "-C", str(repo), "log", "-1", "--format=%s"], capture_output=True)
    assert log.stdout.decode().strip() == f"done: {ITEM}"
    status = subprocess.run(["git", "-C", str(repo), "status", "--porcelain"], capture_output=True)
    assert status.stdout == b""


def aider_request(system: str, user: str) -> dict:
    return {
        "model": "stand-in",
        "stream": True,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": user},
        ],
    }


def test_aider_gets_whole_files_and_a_commit_message(script: Path) -> None:
    files = "I have *added these files to the chat*\n\nCHECKLIST.md\n```\n- [ ] add the road\n"
    files += "- [ ] b\n```\n"
    request = aider_request("You MUST use this *file listing* format:", files)
    request["messages"].append(
        {"role": "user", "content": "Do it, commit: add the road\n\nTo suggest"}
    )
    text = reply_for("chat", request, script).text
    assert "CHECKLIST.md\n```\n- [x] add the road\n- [ ] b\n```\n" in text
    assert "road.txt\n```\na road\n```\n" in text

    diff = "diff --git a/CHECKLIST.md\n-- [ ] add the road\n+- [x] add the road\n"
    ask = aider_request("You generate concise, one-line Git commit messages", diff)
    assert reply_for("chat", ask, script).text == "done: add the road"


def test_an_item_without_a_script_entry_writes_a_file_named_after_it(tmp_path: Path) -> None:
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    reply = reply_for("chat", opencode_request(["ok", "ok"]), empty)
    (call,) = reply.tool_calls
    assert json.loads(call.arguments)["filePath"] == "/work/add-the-road-car.txt"


def test_a_bad_script_is_said_in_the_answer_naming_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("itemz: []\n")
    with pytest.raises(ValueError, match=r"bad\.yaml: unknown key 'itemz'"):
        load_script(bad)
    reply = reply_for("chat", opencode_request([]), bad)
    assert reply.text.startswith("stand-in script error: ") and "itemz" in reply.text


def test_an_items_shell_command_is_the_first_tool_call(tmp_path: Path) -> None:
    path = tmp_path / "script.yaml"
    path.write_text("items:\n  - {match: road, shell: make test, files: {}}\n")
    first = reply_for("responses", codex_request([]), path).tool_calls[0]
    assert json.loads(first.arguments) == {"cmd": "make test", "workdir": "/w"}
    (second,) = reply_for(
        "responses", codex_request(["Process exited with code 0"]), path
    ).tool_calls
    assert "awk" in json.loads(second.arguments)["cmd"]  # then the tick


def claude_request(results: list[str]) -> dict:
    """Claude Code 2.1's request: `system` blocks with its env, its tools (no `type`), the
    prompt with a reminder block; each tool result comes back in a user message of its own."""
    system = [
        {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."},
        {"type": "text", "text": "<env>\nWorking directory: /w\nIs directory a git repo: Yes\n"},
    ]
    prompt = f"Read PLAN.md. Do exactly this item, tick it in CHECKLIST.md, commit: {ITEM}"
    messages: list[dict] = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "<system-reminder>\nAs you answer...</system-reminder>"},
                {"type": "text", "text": prompt},
            ],
        }
    ]
    for n, result in enumerate(results):
        use = {"type": "tool_use", "id": f"t{n}", "name": "Bash", "input": {}}
        messages.append({"role": "assistant", "content": [use]})
        answer = {"type": "tool_result", "tool_use_id": f"t{n}", "content": result}
        messages.append({"role": "user", "content": [answer]})
    tools = [{"name": n, "input_schema": {}} for n in ("Task", "Bash", "Read", "Edit", "Write")]
    return {"model": "stand-in", "system": system, "messages": messages, "tools": tools}


def test_claude_bash_commands_tick_write_and_commit_in_a_real_repo(
    tmp_path: Path, script: Path
) -> None:
    repo = make_workspace(tmp_path / "w", [])
    (repo / "CHECKLIST.md").write_bytes(CHECKLIST.encode())
    subprocess.run(["git", "-C", str(repo), "commit", "-qam", "checklist"], check=True)
    results: list[str] = []
    while (reply := reply_for("messages", claude_request(results), script)).tool_calls:
        (call,) = reply.tool_calls
        arguments = json.loads(call.arguments)
        assert call.name == "Bash" and set(arguments) == {"command", "description"}
        done = subprocess.run(["bash", "-c", arguments["command"]], cwd=repo, capture_output=True)
        assert done.returncode == 0, done.stderr
        results.append("")

    assert len(results) == 2 and reply.text == f"Done: {ITEM}"  # the edit, the commit, a text
    expected = CHECKLIST.replace(f"  - [ ] {ITEM}\r", f"  - [x] {ITEM}\r")
    assert (repo / "CHECKLIST.md").read_bytes() == expected.encode()
    assert (repo / "road.txt").read_text() == "a road\n"
    log = subprocess.run(["git", "-C", str(repo), "log", "-1", "--format=%s"], capture_output=True)
    assert log.stdout.decode().strip() == f"done: {ITEM}"
