"""What the stand-in's "model" answers: a text and tool calls, the same for every wire format.

The server turns a `Reply` into tokens and streams them as vLLM does; this module decides only
what is said. The default is vLLM answering "OK". With `--script PATH` the model plays a coding
model well enough for a real agent to finish a checklist item against the stand-in:

- a tool-calling agent (opencode's `edit`/`write`/`bash`, codex's `exec_command`) gets one tool
  call per turn: tick the item in the checklist and write its files, then `git commit`; after
  the last tool result it answers with a short text, which ends the agent's run;
- aider gets its whole-file format: the checklist with the item ticked plus the new files, as
  file listings; its commit-message request gets a one-line message;
- opencode's title request gets a title; anything else (probes, the stand-in agent) the
  script's `reply` ("OK").

The agent's progress is read from the conversation itself (the tool results it sent back), so
the server keeps no state between requests, as a real model. The script file (YAML or JSON):

    checklist: CHECKLIST.md        # the file whose item is ticked (relative to the workdir)
    reply: OK                      # the answer to every request that is not an agent's
    items:                         # the first entry whose `match` is in the item text wins
      - match: hello
        shell: make test               # a command a tool-calling agent runs first
        files: {hello.txt: "hello\\n"}   # written besides the tick; default: SLUG.txt
        tick: true                     # false: leave the checklist alone
        commit: true                   # false: edit, but never commit

The item is the text after "commit:" in the prompt (the runbooks' prompts end that way) or the
first unchecked item of a checklist quoted in the request.
"""

from __future__ import annotations

import json
import re
import shlex
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

DEFAULT_TEXT = "OK"
ToolArguments = dict[str, str | list[str]]  # a tool call's arguments (an argv: codex's `shell`)
SCRIPT_KEYS = {"checklist", "reply", "items"}
ITEM_KEYS = {"match", "shell", "files", "tick", "commit"}
# opencode, codex, older codex, claude code
SHELL_TOOLS = ("bash", "exec_command", "shell_command", "shell", "Bash")
PROMPT_ITEM = re.compile(r"commit:\s*(.+)")
UNCHECKED = re.compile(r"^[ \t]*(?:\d+: )?- \[ \] (.+?)\s*$", re.MULTILINE)
FILE_LISTING = re.compile(r"^([^\n`]+)\n(`{3,})[^\n]*\n(.*?)^\2[ \t]*$", re.MULTILINE | re.DOTALL)
WORKDIR = (re.compile(r"Working directory: (\S+)"), re.compile(r"<cwd>([^<]+)</cwd>"))


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as the OpenAI wire formats carry it
    id: str


@dataclass
class Reply:
    text: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


def reply_for(api: str, request: dict, script: Path | None) -> Reply:
    """What the "model" answers. api: "chat" | "completions" | "responses" | "messages";
    request: the parsed JSON body; script: the server's --script file (None: the default reply
    "OK")."""
    if script is None:
        return Reply(text=DEFAULT_TEXT)
    try:
        plan = load_script(script)
    except ValueError as error:  # said to whoever asks: the agent prints it, a test shows it
        return Reply(text=f"stand-in script error: {error}")
    if api == "completions":
        return Reply(text=plan.reply)
    talk = conversation_of(api, request)
    if "title generator" in talk.system:  # opencode names its session first
        return Reply(text=(current_item(talk) or "checklist item")[:50])
    if "commit message" in talk.system:  # aider, after it applied the edits
        return Reply(text=commit_message(ticked_item(talk) or current_item(talk)))
    if "*file listing*" in talk.system:  # aider's whole-file edit format
        return whole_file_reply(talk, plan)
    shell = next((name for name in SHELL_TOOLS if name in talk.tools), None)
    if shell is not None:
        return tool_reply(talk, plan, shell)
    return Reply(text=plan.reply)


# the script


@dataclass(frozen=True)
class ItemPlan:
    """What the agent is made to do for one item."""

    item: str
    files: dict[str, str]
    shell: str | None = None
    tick: bool = True
    commit: bool = True


@dataclass(frozen=True)
class ItemScript:
    """One of a script's `items`: what the agent does for an item whose text holds `match`
    (files None: one file named after the item)."""

    match: str = ""
    files: dict[str, str] | None = None
    shell: str | None = None
    tick: bool = True
    commit: bool = True


@dataclass(frozen=True)
class Script:
    checklist: str = "CHECKLIST.md"
    reply: str = DEFAULT_TEXT
    items: tuple[ItemScript, ...] = ()

    def plan_for(self, item: str) -> ItemPlan:
        entry = next((e for e in self.items if e.match in item), ItemScript())
        files = entry.files
        if files is None:
            files = {f"{slug(item)}.txt": f"{item}\n"}
        return ItemPlan(
            item=item, files=files, shell=entry.shell, tick=entry.tick, commit=entry.commit
        )


_cache: dict[Path, tuple[float, Script]] = {}
_cache_lock = threading.Lock()


def load_script(path: Path) -> Script:
    """The script file, parsed once per change; ValueError naming the file and the problem."""
    try:
        mtime = path.stat().st_mtime
    except OSError as error:
        raise ValueError(f"{path}: cannot read the script: {error.strerror}") from None
    with _cache_lock:
        cached = _cache.get(path)
        if cached is not None and cached[0] == mtime:
            return cached[1]
    script = parse_script(path, path.read_text(encoding="utf-8"))
    with _cache_lock:
        _cache[path] = (mtime, script)
    return script


def parse_script(path: Path, text: str) -> Script:
    try:
        data = json.loads(text)
    except ValueError:
        # YAML only where PyYAML is: the stand-in server itself runs on the stdlib alone (the
        # docker tier bind-mounts it into an image that has nothing but python3).
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as error:
            raise ValueError(f"{path}: not YAML or JSON: {error}") from None
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping with keys {', '.join(sorted(SCRIPT_KEYS))}")
    unknown = sorted(set(map(str, data)) - SCRIPT_KEYS)
    if unknown:
        raise ValueError(
            f"{path}: unknown key {unknown[0]!r}; known: {', '.join(sorted(SCRIPT_KEYS))}"
        )
    items = data.get("items") or []
    if not isinstance(items, list) or not all(isinstance(e, dict) for e in items):
        raise ValueError(f"{path}: items: expected a list of mappings")
    for index, entry in enumerate(items):
        bad = sorted(set(map(str, entry)) - ITEM_KEYS)
        if bad:
            raise ValueError(f"{path}: items[{index}]: unknown key {bad[0]!r}")
        if not isinstance(entry.get("files", {}), dict):
            raise ValueError(f"{path}: items[{index}].files: expected a mapping path -> text")
    return Script(
        checklist=str(data.get("checklist", "CHECKLIST.md")),
        reply=str(data.get("reply", DEFAULT_TEXT)),
        items=tuple(item_script(entry) for entry in items),
    )


def item_script(entry: dict[object, object]) -> ItemScript:
    """An `items` entry as read (its keys and `files` checked by parse_script), typed."""
    files = entry.get("files")
    shell = entry.get("shell")
    return ItemScript(
        match=str(entry.get("match", "")),
        files=None if not isinstance(files, dict) else {str(p): str(t) for p, t in files.items()},
        shell=None if shell is None else str(shell),
        tick=bool(entry.get("tick", True)),
        commit=bool(entry.get("commit", True)),
    )


def slug(text: str) -> str:
    """A file name out of an item text: `Add the README` -> `add-the-readme`."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:40] or "item"


# the conversation, whatever the wire format


@dataclass
class Conversation:
    """The parts of a request the script follows."""

    system: str = ""  # system and developer texts
    user_texts: list[str] = field(default_factory=list)
    tool_results: list[str] = field(default_factory=list)  # since the last user message
    tools: set[str] = field(default_factory=set)  # the function tools offered


def conversation_of(api: str, request: dict) -> Conversation:
    talk = Conversation(
        tools={name for tool in request.get("tools") or [] if (name := tool_name(tool))}
    )
    if api == "responses":
        talk.system = str(request.get("instructions") or "")
        items = request.get("input")
        items = (
            [{"type": "message", "role": "user", "content": items}]
            if isinstance(items, str)
            else items
        )
        for item in items or []:
            if item.get("type") == "function_call_output":
                talk.tool_results.append(text_of(item.get("output")))
            elif item.get("type", "message") == "message":
                add_message(talk, str(item.get("role")), text_of(item.get("content")))
        return talk
    if api == "messages":
        add_anthropic_messages(talk, request)
        return talk
    for message in request.get("messages") or []:
        role, text = str(message.get("role")), text_of(message.get("content"))
        if role == "tool":
            talk.tool_results.append(text)
        else:
            add_message(talk, role, text)
    return talk


def add_anthropic_messages(talk: Conversation, request: dict) -> None:
    """The Messages API: `system` on its own; a user message carrying `tool_result` blocks
    answers the assistant's tool calls (its other blocks, reminders, are not a new turn)."""
    talk.system = text_of(request.get("system")) + "\n"
    for message in request.get("messages") or []:
        content = message.get("content")
        blocks = content if isinstance(content, list) else []
        results = [b for b in blocks if isinstance(b, dict) and b.get("type") == "tool_result"]
        if message.get("role") == "user" and results:
            talk.tool_results += [text_of(b.get("content")) for b in results]
        elif message.get("role") == "user":
            add_message(talk, "user", text_of(content))


def add_message(talk: Conversation, role: str, text: str) -> None:
    if role in ("system", "developer"):
        talk.system += text + "\n"
    elif role == "user":
        talk.user_texts.append(text)
        talk.tool_results.clear()  # a new user turn starts the plan again


def tool_name(tool: object) -> str | None:
    """`{"type": "function", "function": {"name"}}` (chat), `{"type": "function", "name"}`
    (responses) or `{"name", "input_schema"}` (messages: no type, or "custom")."""
    if isinstance(tool, dict) and "input_schema" in tool and tool.get("type", "custom") == "custom":
        return tool.get("name")
    if not isinstance(tool, dict) or tool.get("type") != "function":
        return None
    return tool.get("name") or (tool.get("function") or {}).get("name")


def text_of(content: object) -> str:
    """A message content as text: a string or a list of text parts (any wire format)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def current_item(talk: Conversation) -> str | None:
    """The checklist item this conversation is about (see the module's docstring)."""
    unchecked = [m for text in talk.user_texts for m in UNCHECKED.findall(text)]
    for text in reversed(talk.user_texts):
        found = PROMPT_ITEM.search(unquoted(text))
        if found:
            said = found.group(1).strip()
            # "commit: ITEM" may run on ("ITEM." or a closing quote): a known item wins
            known = [item for item in unchecked if said.startswith(item)]
            return max(known, key=len) if known else said
    return unchecked[0] if unchecked else None


def unquoted(text: str) -> str:
    """opencode quotes a message argument that has spaces: `"Do this \\"x\\""` -> `Do this "x"`."""
    text = text.strip()
    if len(text) > 1 and text[0] == text[-1] == '"':
        return text[1:-1].replace('\\"', '"')
    return text


def ticked_item(talk: Conversation) -> str | None:
    """The item a diff ticks (`+- [x] ITEM`), for aider's commit message."""
    for text in talk.user_texts:
        found = re.search(r"^\+[ \t]*- \[x\] (.+?)\s*$", text, re.MULTILINE)
        if found:
            return found.group(1)
    return None


def commit_message(item: str | None) -> str:
    return f"done: {item}" if item else "done: checklist item"


# tool-calling agents


def tool_reply(talk: Conversation, script: Script, shell: str) -> Reply:
    """The next tool call of the plan, judged by the tool results already sent back."""
    item = current_item(talk)
    if item is None:
        return Reply(text="I found no checklist item in the request.")
    plan = script.plan_for(item)
    steps = tool_steps(plan, script.checklist, talk, shell)
    done = len(talk.tool_results)
    if done >= len(steps):
        return Reply(text=f"Done: {item}")
    name, arguments = steps[done]
    call = ToolCall(name=name, arguments=json.dumps(arguments), id=f"call_{uuid.uuid4().hex[:24]}")
    return Reply(tool_calls=[call])


def tool_steps(
    plan: ItemPlan, checklist: str, talk: Conversation, shell: str
) -> list[tuple[str, ToolArguments]]:
    """The agent's tool calls for one item, in order, with the tools it offers."""
    workdir = workdir_of(talk)
    steps: list[tuple[str, ToolArguments]] = []
    if plan.shell is not None:
        steps.append((shell, shell_arguments(shell, plan.shell, workdir)))
    if {"read", "edit", "write"} <= talk.tools:  # opencode: its own file tools
        path = absolute(workdir, checklist)
        if plan.tick:
            old, new = f"- [ ] {plan.item}", f"- [x] {plan.item}"
            steps.append(("read", {"filePath": path}))  # edit refuses a file not read first
            steps.append(("edit", {"filePath": path, "oldString": old, "newString": new}))
        for name, content in plan.files.items():
            steps.append(("write", {"filePath": absolute(workdir, name), "content": content}))
    else:
        edits = ([tick_command(checklist, plan.item)] if plan.tick else []) + [
            write_command(name, content) for name, content in plan.files.items()
        ]
        if edits:
            steps.append((shell, shell_arguments(shell, " && ".join(edits), workdir)))
    if plan.commit:
        commit = f"git add -A && git commit -q -m {shlex.quote(commit_message(plan.item))}"
        steps.append((shell, shell_arguments(shell, commit, workdir)))
    return steps


def workdir_of(talk: Conversation) -> str | None:
    """The agent's working directory, as its system prompt or environment context says."""
    for pattern in WORKDIR:
        for text in (talk.system, *talk.user_texts):
            found = pattern.search(text)
            if found:
                return found.group(1).strip()
    return None


def absolute(workdir: str | None, path: str) -> str:
    if workdir is None or PurePosixPath(path).is_absolute():
        return path
    return str(PurePosixPath(workdir) / path)


def shell_arguments(tool: str, command: str, workdir: str | None) -> ToolArguments:
    """The arguments each agent's shell tool takes."""
    if tool == "exec_command":  # codex: {cmd, workdir}
        return {"cmd": command, **({"workdir": workdir} if workdir else {})}
    if tool == "shell":  # codex before exec_command: an argv
        return {"command": ["bash", "-lc", command], **({"workdir": workdir} if workdir else {})}
    if tool in ("bash", "Bash"):  # opencode, claude code
        return {"command": command, "description": "Run: " + command.split(" ", 1)[0]}
    return {"command": command}


def tick_command(checklist: str, item: str) -> str:
    """Shell that turns the item's `- [ ]` into `- [x]`, every other byte unchanged (awk)."""
    program = (
        'BEGIN { want = "- [ ] " ENVIRON["RALPH_ITEM"] } '
        "!done && (i = index($0, want)) && substr($0, 1, i - 1) ~ /^[ \\t]*$/ "
        '{ $0 = substr($0, 1, i - 1) "- [x] " substr($0, i + 6); done = 1 } { print }'
    )
    path, partial = shlex.quote(checklist), shlex.quote(checklist + ".tick")
    return (
        f"RALPH_ITEM={shlex.quote(item)} awk {shlex.quote(program)} {path} > {partial}"
        f" && mv {partial} {path}"
    )


def write_command(path: str, content: str) -> str:
    parent = str(PurePosixPath(path).parent)
    mkdir = f"mkdir -p {shlex.quote(parent)} && " if parent != "." else ""
    return f"{mkdir}printf %s {shlex.quote(content)} > {shlex.quote(path)}"


# aider


def whole_file_reply(talk: Conversation, script: Script) -> Reply:
    """aider's whole-file format: every changed or new file as a full file listing."""
    item = current_item(talk)
    if item is None:
        return Reply(text="I found no checklist item in the request.")
    plan = script.plan_for(item)
    listings = dict(plan.files)
    if plan.tick:
        current = files_in_chat(talk).get(script.checklist)
        if current is None:
            return Reply(text=f"Please add {script.checklist} to the chat.")
        listings = {script.checklist: tick(current, item), **listings}
    body = "".join(f"{name}\n```\n{ensure_newline(text)}```\n\n" for name, text in listings.items())
    return Reply(text=f"I will do this item and tick it: {item}\n\n{body}")


def files_in_chat(talk: Conversation) -> dict[str, str]:
    """The file listings aider sent (`NAME`, a fence, the content); the latest copy of each."""
    found: dict[str, str] = {}
    for text in talk.user_texts:
        for name, _fence, content in FILE_LISTING.findall(text):
            found[name.strip()] = content
    return found


def tick(text: str, item: str) -> str:
    return text.replace(f"- [ ] {item}", f"- [x] {item}", 1)


def ensure_newline(text: str) -> str:
    return text if text.endswith("\n") or not text else text + "\n"
