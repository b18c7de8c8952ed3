"""What a command's output says, as text for people: what a terminal would have shown
(`clean`), the line that explains a failure (`explaining_line`), and a reason on one line cut at
a word (`one_line`). Loop strikes, pause and resume blocks and recovery steps all say why a
command failed this way."""

from __future__ import annotations

import re

REASON_CHARS = 200

_ANSI = re.compile(
    r"\x1b\[[0-?]*[ -/]*[@-~]"  # CSI: colours, cursor moves, erase line
    r"|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?"  # OSC: window titles, hyperlinks
    r"|\x1b[@-Z\\-_]"  # the other two-byte escapes
    r"|\x9b[0-?]*[ -/]*[@-~]"  # their one-character (C1) forms: CSI U+009B, as a terminal
    r"|\x9d[^\x07\x1b\x9c]*(?:\x07|\x9c|\x1b\\)?"  # reads them; OSC U+009D
)
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # C0 and C1 controls, DEL


def clean(text: str) -> str:
    """The text a person would have seen on a terminal: no escapes, the last `\\r` overwrite of
    each line (progress bars), no other control characters, no trailing blanks."""
    lines = []
    for line in _ANSI.sub("", text).split("\n"):
        line = line.rstrip("\r").rsplit("\r", 1)[-1]
        lines.append(_CONTROL.sub("", line).rstrip())
    return "\n".join(lines).strip("\n")


def one_line(text: str, limit: int = REASON_CHARS) -> str:
    """`text` on one line (its whitespace runs made one space), cut at the last word boundary
    before `limit` (with " …"), or whole when it has no boundary to cut at. Not output.text.shorten,
    which cuts any text at a column width: a reason keeps its words whole."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    boundary = text.rfind(" ", 0, limit)
    return text if boundary <= 0 else text[:boundary].rstrip(" ,;:") + " …"


# A line that explains a failure: a Python exception or an `Error:`-like line. The first one
# counts: a traceback ends in a wrapper ("RuntimeError: Engine core initialization failed. See
# root cause above.") under the root cause that came first.
_ERROR_LINE = re.compile(
    r"^\s*(?:[\w.]*(?:Error|Exception|Exit)\b[:\s]|error[:\[]|ERROR\b|fatal[:\s]|FATAL\b)",
    re.IGNORECASE,
)
# An agent's JSON error (opencode prints it over several lines, ending in `}`): its message.
_JSON_MESSAGE = re.compile(r'"(?:message|error)"\s*:\s*"((?:[^"\\]|\\.){3,})"')
_WRAPPERS = ("see root cause above", "see stack trace", "for the root cause")


def explaining_line(text: str) -> str | None:
    """The line of a step's output that says why it failed, if one does: an agent's JSON
    error message, else the first error-like line that is not a wrapper pointing elsewhere."""
    message = _JSON_MESSAGE.search(text)
    if message:
        return message.group(1).replace('\\"', '"')
    candidates = [line.strip() for line in text.split("\n") if _ERROR_LINE.match(line)]
    real = [line for line in candidates if not any(w in line.lower() for w in _WRAPPERS)]
    chosen = real or candidates
    return chosen[0] if chosen else None


LINE_CAP = 64 * 1024  # characters of a line without its newline kept before it is shown cut
CUT_MARK = " [cut: a line over 64 KiB]"


class Lines:
    """A command's output, arriving in chunks, as its lines (`-v` shows them one at a time). The
    pending line without a newline is bounded: at LINE_CAP characters it is given as a line
    marked cut, and the rest of it follows in the same way, so an 80 MB line (or a progress bar
    drawn with `\\r` for hours) costs linear time and LINE_CAP of memory."""

    def __init__(self) -> None:
        self.pending = ""

    def feed(self, text: str) -> list[str]:
        """The lines `text` completes (each as `clean` shows it), cut ones marked."""
        *lines, self.pending = (self.pending + text).split("\n")
        found = [clean(line) for line in lines]
        while len(self.pending) >= LINE_CAP:
            found.append(clean(self.pending[:LINE_CAP]) + CUT_MARK)
            self.pending = self.pending[LINE_CAP:]
        return found

    def end(self) -> str | None:
        """The last line, without its newline (None: there is none); the next feed starts anew."""
        pending, self.pending = self.pending, ""
        return clean(pending) if pending else None
