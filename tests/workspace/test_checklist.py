"""checklist.py: items are found like the seed's grep finds them, and a tick or a skip changes
exactly one marker byte of the file."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ralph_runner.errors import FatalError
from ralph_runner.workspace import checklist
from ralph_runner.workspace.checklist import Counts, Item

SEED_LIKE = (
    "# 레이싱 게임\r\n"
    "\r\n"
    "- [x] index.html 골격\r\n"
    "- [!] src/input.js — 좌우 화살표/A/D 키 핸들러\r\n"
    "  - [ ] src/game.js 상태 머신 골격\r\n"
    "\t* [X] nested with a tab and a star\r\n"
    "- [ ] tests/collision.test.js\r\n"
    "- [y] not an item\r\n"
    "-[ ] not an item either\r\n"
    "- [ ]glued is not an item\r\n"
    "- [ ]"
)


def test_parse_finds_items_with_lines_indexes_marks_and_stripped_text():
    assert checklist.parse(SEED_LIKE) == [
        Item("index.html 골격", 3, 0, "x"),
        Item("src/input.js — 좌우 화살표/A/D 키 핸들러", 4, 1, "!"),
        Item("src/game.js 상태 머신 골격", 5, 2, " "),
        Item("nested with a tab and a star", 6, 3, "x"),
        Item("tests/collision.test.js", 7, 4, " "),
    ]


def test_counts_report_progress_and_size():
    assert checklist.counts(SEED_LIKE) == Counts(
        done=2, todo=2, skipped=1, chars=len(SEED_LIKE), lines=10
    )
    assert checklist.counts("").as_dict() == dict(done=0, todo=0, skipped=0, chars=0, lines=0)


def test_next_todo_is_the_first_unchecked_item_in_file_order():
    assert checklist.next_todo(SEED_LIKE) == Item("src/game.js 상태 머신 골격", 5, 2, " ")
    assert checklist.next_todo("- [x] a\n- [!] b\n") is None


def test_ticking_every_todo_finishes_the_checklist():
    text = SEED_LIKE
    while (item := checklist.next_todo(text)) is not None:
        text = checklist.mark(text, item, "x")
    assert checklist.counts(text).todo == 0
    assert len(text) == len(SEED_LIKE)


def test_mark_refuses_a_line_that_no_longer_holds_the_item():
    item = checklist.next_todo(SEED_LIKE)
    edited = "new first line\n" + SEED_LIKE
    with pytest.raises(FatalError, match="no longer holds the item") as caught:
        checklist.mark(edited, item, "!")
    assert caught.value.problems[0].line == item.line
    moved = checklist.find(edited, item.text)
    assert moved.line == item.line + 1
    assert checklist.parse(checklist.mark(edited, moved, "!"))[moved.index].mark == "!"


def test_mark_rejects_an_unknown_marker():
    with pytest.raises(ValueError, match="not a checklist mark"):
        checklist.mark(SEED_LIKE, checklist.next_todo(SEED_LIKE), "?")


def test_read_and_write_keep_every_byte(tmp_path: Path):
    path = tmp_path / "CHECKLIST.md"
    path.write_bytes(SEED_LIKE.encode())
    os.chmod(path, 0o640)
    text = checklist.read(path)
    assert text == SEED_LIKE
    checklist.write(path, checklist.mark(text, checklist.next_todo(text), "!"))
    expected = SEED_LIKE.replace("  - [ ] src/game.js", "  - [!] src/game.js").encode()
    assert path.read_bytes() == expected
    assert os.stat(path).st_mode & 0o777 == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["CHECKLIST.md"]


def test_write_through_a_symlink_replaces_the_target(tmp_path: Path):
    target = tmp_path / "real.md"
    target.write_text("- [ ] a\n")
    link = tmp_path / "CHECKLIST.md"
    link.symlink_to(target)
    checklist.write(link, "- [x] a\n")
    assert link.is_symlink()
    assert target.read_text() == "- [x] a\n"


def test_a_failed_write_is_reported_and_leaves_no_temp_file(tmp_path: Path):
    (tmp_path / "CHECKLIST.md").mkdir()
    with pytest.raises(FatalError, match="cannot write") as caught:
        checklist.write(tmp_path / "CHECKLIST.md", "- [x] a\n")
    assert caught.value.problems[0].file == str(tmp_path / "CHECKLIST.md")
    assert [p.name for p in tmp_path.iterdir()] == ["CHECKLIST.md"]


def test_read_reports_missing_and_undecodable_files(tmp_path: Path):
    missing = tmp_path / "CHECKLIST.md"
    with pytest.raises(FatalError, match="cannot read the checklist") as caught:
        checklist.read(missing)
    assert caught.value.problems[0].file == str(missing)
    bad = tmp_path / "bad.md"
    bad.write_bytes(b"- [x] ok\n- [ ] caf\xe9\n")
    with pytest.raises(FatalError, match="not valid UTF-8") as caught:
        checklist.read(bad)
    problem = caught.value.problems[0]
    assert (problem.file, problem.line, problem.column) == (str(bad), 2, 10)


# --- the grammar: GitHub task lists, plus "[!]" (issue 31, item 7) ---------------------------

GRAMMAR = (
    "- [ ] dash\n"  # 1
    "* [x] star\n"  # 2
    "+ [X] plus\n"  # 3
    "1. [ ] ordered with a dot\n"  # 4
    "10) [!] ordered with a parenthesis\n"  # 5
    "```\n"  # 6
    "- [ ] an example in a code fence\n"  # 7
    "````\n"  # 8: closes the fence (at least as long)
    "~~~ markdown\n"  # 9
    "- [ ] in a tilde fence\n"  # 10
    "```\n"  # 11: a backtick line does not close a tilde fence
    "~~~\n"  # 12
    "-[ ] glued bullet\n"  # 13
    "- [?] unknown mark\n"  # 14
    "- [ ]\n"  # 15: no text
    "- [x]   \r\n"  # 16: blanks only
    "- []\n"  # 17
    "- [ ]glued text\n"  # 18
    "[ ] no list marker\n"  # 19
    "- [link](https://example.com) is a list item, not a task\n"  # 20
    "[1]: https://example.com\n"  # 21
    "  2. [ ] last\n"  # 22
)


def test_items_follow_github_task_lists_and_skip_code_fences():
    assert [(i.line, i.mark, i.text) for i in checklist.parse(GRAMMAR)] == [
        (1, " ", "dash"),
        (2, "x", "star"),
        (3, "x", "plus"),
        (4, " ", "ordered with a dot"),
        (5, "!", "ordered with a parenthesis"),
        (22, " ", "last"),
    ]


def test_lines_that_look_like_items_but_are_not_are_named_in_one_warning():
    assert checklist.near_misses(GRAMMAR) == [13, 14, 15, 16, 17, 18, 19]
    warning = checklist.near_miss_warning(GRAMMAR)
    assert warning is not None and "lines 13, 14, 15, 16, 17, 18, 19 look like an item" in warning
    assert checklist.near_miss_warning("- [ ] fine\n```\n-[ ] in a fence\n```\n") is None
    assert "line 1 looks like an item" in (checklist.near_miss_warning("- [ ]\n") or "")


def test_an_empty_item_is_never_the_next_todo():
    assert checklist.next_todo("- [ ]\n- [ ] \r\n- [ ] real\n") == Item("real", 3, 0, " ")


def test_every_accepted_form_can_be_ticked_and_skipped():
    text = GRAMMAR
    while (item := checklist.next_todo(text)) is not None:
        text = checklist.mark(text, item, checklist.DONE)
    assert [i.mark for i in checklist.parse(text)] == ["x", "x", "x", "x", "!", "x"]
    assert text.count("[ ]") == GRAMMAR.count("[ ]") - 3  # lines 1, 4, 22 only
    assert "1. [x] ordered with a dot\n" in text and "  2. [x] last\n" in text


def test_an_unclosed_fence_hides_the_rest_like_markdown_does():
    assert [i.text for i in checklist.parse("- [ ] a\n~~~~\n- [ ] b\n~~~\n- [ ] c\n")] == ["a"]


# --- generated checklists ------------------------------------------------------------------

KOREAN = st.sampled_from(["상태 머신", "충돌 판정", "좌우 화살표", "테스트", "완료"])
PLAIN = st.text(
    st.characters(blacklist_categories=("Cs", "Cc", "Zl", "Zp"), blacklist_characters="["),
    max_size=20,
)
NEAR_MISSES = st.sampled_from(
    ["- [y] no", "-[ ] no", "- [ ]glued", "- [x]\u00a0nbsp", "[ ] no bullet", "  -  [] empty", ""]
)
NOT_A_FENCE = PLAIN.filter(lambda line: not line.lstrip(" \t\ufeff").startswith(("```", "~~~")))


@dataclass
class Line:
    body: str
    marker_at: int | None  # offset of the marker character inside body, for items
    mark: str = ""
    text: str = ""


@st.composite
def item_lines(
    draw,
    indents=("", " ", "  ", "    ", "\t", " \t"),
    bullets=("-", "*", "+", "1.", "12)"),
    gaps=(" ", "  ", "\t"),
    marks=" xX!",
):
    indent, bullet, gap, mark = (draw(st.sampled_from(c)) for c in (indents, bullets, gaps, marks))
    text = draw(st.lists(st.one_of(KOREAN, PLAIN), max_size=2).map(" ".join))
    text = draw(KOREAN) + (" " + text if text else "")  # an item needs text
    head = f"{indent}{bullet}{gap}["
    return Line(f"{head}{mark}] {text}", len(head), mark.lower(), text.strip())


@st.composite
def checklist_files(draw, items, others):
    """(file text, [(offset of the marker in the text, Line) for each item])."""
    lines = draw(st.lists(st.one_of(items, others.map(lambda body: Line(body, None))), max_size=12))
    endings = draw(st.lists(st.sampled_from(["\n", "\r\n"]), min_size=len(lines)))
    trailing = draw(st.booleans())
    parts = []
    offsets = []
    position = 0
    for number, (line, ending) in enumerate(zip(lines, endings, strict=False)):
        last = number == len(lines) - 1
        piece = line.body + ("" if last and not trailing else ending)
        if line.marker_at is not None:
            offsets.append((position + line.marker_at, line))
        parts.append(piece)
        position += len(piece)
    return "".join(parts), offsets


ANY_CHECKLIST = checklist_files(item_lines(), st.one_of(NOT_A_FENCE, NEAR_MISSES, KOREAN))
# What the seed's `grep -cE '^[ ]*- \[x\]'` understands: spaces, "-", one blank, lowercase x.
SEED_CHECKLIST = checklist_files(
    item_lines(indents=("", " ", "   "), bullets="-", gaps=(" ",), marks=" x!"),
    st.one_of(NOT_A_FENCE, KOREAN),
)


@settings(max_examples=300, deadline=None)
@given(ANY_CHECKLIST, st.data())
def test_mark_changes_only_that_items_marker_byte(generated, data):
    text, items = generated
    parsed = checklist.parse(text)
    assert [(i.mark, i.text) for i in parsed] == [(line.mark, line.text) for _, line in items]
    if not parsed:
        return
    chosen = data.draw(st.sampled_from(parsed))
    new_mark = data.draw(st.sampled_from(["x", "!", " "]))
    before = text.encode("utf-8")
    after = checklist.mark(text, chosen, new_mark).encode("utf-8")
    marker_offset = len(text[: items[chosen.index][0]].encode("utf-8"))
    assert len(after) == len(before)
    changed = [i for i in range(len(before)) if before[i] != after[i]]
    assert set(changed) <= {marker_offset}
    assert after[marker_offset : marker_offset + 1] == new_mark.encode()


@pytest.mark.system  # grep and wc, 25 times
@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(SEED_CHECKLIST)
def test_counts_match_the_seeds_grep_and_wc(tmp_path: Path, generated):
    """The seed counted with `grep -cE '^[ ]*- \\[x\\]'` and `wc -l`/`wc -c` (chars: `wc -m`)."""
    text, _ = generated
    path = tmp_path / "CHECKLIST.md"
    checklist.write(path, text)
    env = {**os.environ, "LC_ALL": "C.UTF-8"}

    def first_number(*argv: str) -> int:
        out = subprocess.run([*argv, str(path)], capture_output=True, text=True, env=env)
        return int(out.stdout.split()[0])

    assert checklist.counts(checklist.read(path)) == Counts(
        done=first_number("grep", "-cE", r"^[ ]*- \[x\]"),
        todo=first_number("grep", "-cE", r"^[ ]*- \[ \]"),
        skipped=first_number("grep", "-cE", r"^[ ]*- \[!\]"),
        chars=first_number("wc", "-m"),
        lines=first_number("wc", "-l"),
    )
