"""What the stand-in's "model" answers: a text and tool calls, the same for every wire format.

The server turns a `Reply` into tokens and streams them as vLLM does; this module decides only
what is said. The default is vLLM answering "OK"; `--script PATH` names a file that a richer
version of `reply_for` reads (tool calls that make a real agent edit, tick and commit).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_TEXT = "OK"


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
    """What the "model" answers. api: "chat" | "completions" | "responses"; request: the
    parsed JSON body; script: the server's --script file (None: the default reply "OK")."""
    return Reply(text=DEFAULT_TEXT)
