"""reports.py: a death becomes a seed-shaped block in the log and one JSON line beside it, durably,
with secrets masked, and is never lost: not to a full disk, a torn write or a broken template."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ralph_runner.deaths.log import (
    DeathLog,
    Redactor,
    default_template,
    read_records,
    records_path,
    summarize,
)
from ralph_runner.templating import Templar

DEATH_KEYS = {
    "event",
    "death",
    "time",
    "host",
    "runbook",
    "iteration",
    "item",
    "phase",
    "prompt_size",
    "probes",
    "collectors",
}
PROBE_KEYS = {"name", "kind", "ok", "reason", "detail", "seconds"}
COLLECTOR_KEYS = {"name", "ok", "exit_code", "timed_out", "truncated", "seconds", "output"}

COMMITS = (
    "06a5f1d skip: tests/collision.test.js (3 failures)\n"
    "76e39d7 skip: src/collision.js — aabb() (3 failures)\n"
    "5397ac3 feat: requestAnimationFrame main loop\n"
)
CONTAINER_LOG = (
    "(EngineCore pid=123) ERROR AssertionError: num_required_blocks 25 < len(req_blocks) 26\n"
    "\n"
    "(APIServer pid=1) INFO: Application shutdown complete.\n"
)


def death_record(number: int = 2, **changes: Any) -> dict[str, Any]:
    """A death as the loop builds it (the seed's second death)."""
    record: dict[str, Any] = {
        "event": "death",
        "death": number,
        "time": "2026-05-04T11:46:38+09:00",
        "host": "localhost",
        "runbook": "runbooks/vllm.yaml",
        "iteration": 30,
        "item": {"text": "src/game.js 상태 머신 골격", "line": 12, "index": 11, "attempts": 0},
        "phase": "post-step",
        "prompt_size": 12347,
        "prompt_bytes": 12400,
        "service": "vLLM",
        "checklist": {"done": 6, "todo": 22, "skipped": 14, "chars": 3722, "lines": 71},
        "probes": [
            {
                "name": "models endpoint",
                "kind": "http",
                "ok": False,
                "reason": "refused",
                "detail": "connection refused",
                "seconds": 0.002,
            },
            {
                "name": "port open",
                "kind": "tcp",
                "ok": True,
                "reason": None,
                "detail": "",
                "seconds": 0.001,
            },
        ],
        "collectors": [
            collector("last 5 commits", COMMITS),
            collector(
                "docker container status",
                "{{.Status}} Exited (0) 43 minutes ago",  # Go braces: data, never a template
            ),
            collector("vLLM container last 60 lines", CONTAINER_LOG, truncated=True, cut=1234),
            collector("nvidia-smi", "", ok=False, exit_code=127),
            collector("GPU scheduler status", "", ok=False, exit_code=None, timed_out=True),
        ],
    }
    record.update(changes)
    return record


def collector(
    name: str,
    output: str,
    *,
    ok: bool = True,
    exit_code: int | None = 0,
    timed_out: bool = False,
    truncated: bool = False,
    cut: int = 0,
) -> dict[str, Any]:
    return {
        "name": name,
        "ok": ok,
        "exit_code": exit_code,
        "timed_out": timed_out,
        "truncated": truncated,
        "cut_bytes": cut,
        "seconds": 15.002 if timed_out else 0.01,
        "output": output,
    }


def recovery_record(number: int = 2, **changes: Any) -> dict[str, Any]:
    record = {
        "event": "recovery",
        "death": number,
        "time": "2026-05-04T11:47:19+09:00",
        "attempts": 1,
        "recovered": True,
        "seconds": 41.2,
        "reason": None,
        "steps": [{"name": "start vLLM", "ok": True, "exit_code": 0, "output": "up"}],
    }
    record.update(changes)
    return record


def death_log(
    tmp_path: Path,
    log: Path | None = None,
    records: Path | None = None,
    *,
    template: str | None = None,
    secrets: tuple[str, ...] = (),
) -> DeathLog:
    log = log or tmp_path / "logs" / "vllm-deaths.log"
    return DeathLog(
        log,
        records or records_path(log),
        template=default_template() if template is None else template,
        templar=Templar(tmp_path),
        redactor=Redactor(secrets),
    )


def test_records_path_replaces_the_suffix_unless_a_path_is_given():
    assert records_path(Path("logs/vllm-deaths.log")) == Path("logs/vllm-deaths.jsonl")
    assert records_path(Path("logs/deaths")) == Path("logs/deaths.jsonl")
    assert records_path(Path("logs/x.log"), "other/records.jsonl") == Path("other/records.jsonl")
    assert records_path(Path("logs/x.jsonl")) == Path("logs/x.jsonl.records.jsonl")


def test_default_report_has_the_seed_block_shape(tmp_path):
    deaths = death_log(tmp_path)
    deaths.write_death(death_record())

    text = deaths.log_path.read_text(encoding="utf-8")
    assert text.endswith("===== END =====\n\n")
    lines = text.splitlines()
    assert lines[0] == "===== vLLM down detected at 2026-05-04 11:46:38 ====="
    assert lines[1] == (
        "context: iter=30, item=src/game.js 상태 머신 골격 (line 12, strikes 0),"
        " phase=post-step, death #2, host=localhost"
    )
    assert lines[2] == "last prompt size: 12347 chars (12400 bytes)"
    headers = [line for line in lines if line.startswith("--- ")]
    assert headers == [
        "--- failed probes ---",
        "--- CHECKLIST ---",
        "--- last 5 commits ---",
        "--- docker container status ---",
        "--- vLLM container last 60 lines ---",
        "--- nvidia-smi ---",
        "--- GPU scheduler status ---",
    ]
    assert lines.count("===== END =====") == 1
    assert lines[-2:] == ["===== END =====", ""]

    def section(header: str) -> list[str]:
        start = lines.index(header) + 1
        end = next(i for i in range(start, len(lines)) if lines[i].startswith(("---", "=====")))
        return lines[start:end]

    assert section("--- failed probes ---") == [
        " models endpoint (http): refused - connection refused [0.002 s]",
        "",
    ]  # a passing probe is not listed
    assert section("--- CHECKLIST ---") == [
        " size: 3722 chars / 71 lines",
        " done (x): 6, todo ([ ]): 22, skipped (!): 14",
        "",
    ]
    assert section("--- last 5 commits ---") == [
        *(" " + line for line in COMMITS.splitlines()),
        "",
    ]  # one space before each line, like the seed's sed 's/^/ /'
    assert section("--- docker container status ---") == [
        " {{.Status}} Exited (0) 43 minutes ago",
        "",
    ]
    assert section("--- vLLM container last 60 lines ---") == [
        " (cut: first 1234 bytes dropped)",
        *(" " + line for line in CONTAINER_LOG.splitlines()),
        "",
    ]
    assert section("--- nvidia-smi ---") == [" (exit 127)", " (no output)", ""]
    assert section("--- GPU scheduler status ---") == [" (timed out after 15 s)", " (no output)"]


def test_context_without_item_prompt_or_service_still_reads_well(tmp_path):
    record = death_record(item=None, prompt_size=None, phase="start")
    del record["service"], record["prompt_bytes"]
    deaths = death_log(tmp_path)
    deaths.write_death(record)

    lines = deaths.log_path.read_text(encoding="utf-8").splitlines()
    assert lines[0] == "===== service down detected at 2026-05-04 11:46:38 ====="
    assert lines[1].startswith("context: iter=30, item=(none), phase=start, death #2")
    assert lines[2] == "last prompt size: (N/A)"


def test_the_json_line_holds_every_design_key(tmp_path):
    deaths = death_log(tmp_path)
    deaths.write_death(death_record())

    [line] = deaths.records_path.read_text(encoding="utf-8").splitlines()
    record = json.loads(line)
    assert record["event"] == "death"
    assert set(record) >= DEATH_KEYS
    assert record["item"] == death_record()["item"]
    assert all(set(probe) >= PROBE_KEYS for probe in record["probes"])
    assert all(set(c) >= COLLECTOR_KEYS for c in record["collectors"])
    assert record["collectors"][2]["output"] == CONTAINER_LOG


def test_deaths_and_recoveries_are_appended_never_rewritten(tmp_path):
    deaths = death_log(tmp_path)
    deaths.write_death(death_record(1))
    log_before = deaths.log_path.read_bytes()
    records_before = deaths.records_path.read_bytes()
    inodes = (deaths.log_path.stat().st_ino, deaths.records_path.stat().st_ino)

    deaths.write_recovery(recovery_record(1))
    deaths.write_death(death_record(2))
    deaths.write_recovery(
        recovery_record(2, recovered=False, reason="recovery steps failed 2 times", attempts=2)
    )

    assert (deaths.log_path.stat().st_ino, deaths.records_path.stat().st_ino) == inodes
    log = deaths.log_path.read_bytes()
    records = deaths.records_path.read_bytes()
    assert log.startswith(log_before)
    assert records.startswith(records_before)
    assert [(r["event"], r["death"]) for r in read_records(deaths.records_path)] == [
        ("death", 1),
        ("recovery", 1),
        ("death", 2),
        ("recovery", 2),
    ]
    text = log.decode("utf-8")
    assert text.count("===== END =====\n\n") == 2
    assert "===== END =====\n\n--- recovery: recovered after 1 attempt(s) in 41.2 s ---\n" in text
    assert text.endswith("--- recovery FAILED: recovery steps failed 2 times ---\n\n")


def test_a_failed_recovery_shows_the_failing_steps_output(tmp_path):
    deaths = death_log(tmp_path)
    steps = [
        {"attempt": 1, "name": "start vLLM", "ok": False, "exit_code": 1, "output": "no\nluck"},
        {"attempt": 2, "name": "start vLLM", "ok": True, "exit_code": 0, "output": "started"},
        {"attempt": 2, "name": "wait", "ok": False, "exit_code": None, "timed_out": True},
    ]
    deaths.write_recovery(
        recovery_record(reason="not healthy within 60 s", recovered=False, steps=steps)
    )
    deaths.write_recovery(recovery_record(seconds=41.23456))
    assert deaths.log_path.read_text(encoding="utf-8") == (
        "--- recovery FAILED: not healthy within 60 s ---\n"
        " attempt 1, step 'start vLLM' failed (exit 1):\n"
        "  no\n"
        "  luck\n"
        " attempt 2, step 'wait' failed (timed out):\n\n"
        "--- recovery: recovered after 1 attempt(s) in 41.2 s ---\n\n"
    )


def test_a_skipped_collector_says_so(tmp_path):
    skipped = {**collector("docker logs", ""), "skipped": True}
    deaths = death_log(tmp_path)
    deaths.write_death(death_record(collectors=[skipped]))
    text = deaths.log_path.read_text(encoding="utf-8")
    assert "--- docker logs ---\n (skipped: its `when` was false)\n (no output)\n=====" in text


@pytest.mark.system  # a second Python reads the log
def test_a_written_death_is_visible_to_another_process_on_return(tmp_path):
    deaths = death_log(tmp_path)
    deaths.write_death(death_record())
    reader = (
        "import json, sys; "
        "print(json.loads(open(sys.argv[1], encoding='utf-8').readline())['death']); "
        "print(open(sys.argv[2], encoding='utf-8').read().count('===== END ====='))"
    )
    result = subprocess.run(
        [sys.executable, "-c", reader, deaths.records_path, deaths.log_path],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    assert result.stdout.split() == ["2", "1"]


def test_a_user_template_renders_the_record(tmp_path):
    template = tmp_path / "report.j2"
    template.write_text(
        "DEATH {{ death }} of {{ record.runbook }} at {{ time }}: {{ item.text }}\n"
        "{% for c in collectors %}[{{ c.name }}]\n{% endfor %}",
        encoding="utf-8",
    )
    deaths = death_log(tmp_path, template=template.read_text(encoding="utf-8"))
    deaths.write_death(death_record())

    assert deaths.log_path.read_text(encoding="utf-8") == (
        "DEATH 2 of runbooks/vllm.yaml at 2026-05-04T11:46:38+09:00: src/game.js 상태 머신 골격\n"
        "[last 5 commits]\n[docker container status]\n[vLLM container last 60 lines]\n"
        "[nvidia-smi]\n[GPU scheduler status]\n\n"
    )


def test_a_broken_user_template_does_not_lose_the_death(tmp_path):
    deaths = death_log(tmp_path, template="death {{ no_such_field }}\n")
    deaths.write_death(death_record())

    text = deaths.log_path.read_text(encoding="utf-8")
    assert "report template failed" in text
    assert "no_such_field" in text
    assert '"iteration": 30' in text  # the facts are in the log all the same
    assert text.endswith("===== END =====\n\n")
    assert read_records(deaths.records_path)[0]["iteration"] == 30


def test_secrets_and_token_shapes_are_masked_in_log_and_records(tmp_path):
    secret = "hunter2-admin-pass"
    tokens = [
        "sk-proj-AbCdEf0123456789xyzXYZ",
        "hf_AbCdEfGhIjKlMnOpQrStUvWxYz012345",
        "AKIAIOSFODNN7EXAMPLE",
        "eyJhbGciOiJIUzI1NiJ9.payload.sig",  # behind "Bearer "
    ]
    leaky = (
        f"login with {secret}\n"
        f"OPENAI_API_KEY={tokens[0]}\n"
        f"HF_TOKEN={tokens[1]}\n"
        f"aws_access_key_id = {tokens[2]}\n"
        f"Authorization: Bearer {tokens[3]}\n"
    )
    record = death_record()
    record["collectors"][0]["output"] = leaky
    record["item"]["text"] = f"rotate {secret}"
    deaths = death_log(tmp_path, secrets=(secret, "ab", ""))  # too short to mask: ignored
    deaths.write_death(record)

    for path in (deaths.log_path, deaths.records_path):
        text = path.read_text(encoding="utf-8")
        for leaked in (secret, *tokens):
            assert leaked not in text, (path.name, leaked)
        assert "Bearer ****" in text
        assert "rotate ****" in text
    assert record["item"]["text"] == f"rotate {secret}"  # the caller's record is left alone
    log = deaths.log_path.read_text(encoding="utf-8")
    assert " OPENAI_API_KEY=****\n HF_TOKEN=****\n aws_access_key_id = ****\n" in log
    assert "phase=post-step" in log  # "ab" is not masked inside words


def test_redactor_data_keeps_keys_and_non_strings():
    redactor = Redactor(["s3cret"])
    data = {"s3cret": ["x s3cret y", 3, None, True, {"k": ("s3cret",)}]}
    assert redactor.data(data) == {"s3cret": ["x **** y", 3, None, True, {"k": ["****"]}]}
    assert redactor.text("sk-short and hf_short stay") == "sk-short and hf_short stay"
    assert redactor.text("use s3cret s3cret") == "use **** ****"


def test_a_longer_secret_containing_a_shorter_one_is_masked_whole():
    redactor = Redactor(["pass", "password123"])
    assert redactor.text("password123 and pass") == "**** and ****"


def test_a_full_disk_keeps_the_record_on_stderr_and_returns(tmp_path, capsys):
    records = tmp_path / "deaths.jsonl"
    deaths = death_log(tmp_path, log=Path("/dev/full"), records=records, secrets=("hunter2",))
    record = death_record(item={"text": "hunter2", "line": 1, "index": 0, "attempts": 0})

    deaths.write_death(record)  # ENOSPC on the log: no exception

    err = capsys.readouterr().err
    prefix = "ralph-run: could not write death record (/dev/full: No space left on device): "
    assert err.startswith(prefix)
    on_stderr = json.loads(err[len(prefix) :])
    assert on_stderr == json.loads(
        json.dumps(death_record(item={**record["item"], "text": "****"}))
    )
    assert read_records(records) == [on_stderr]  # the twin was still written


def test_nothing_writable_still_returns_with_the_whole_record_on_stderr(tmp_path, capsys):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the log directory should be", encoding="utf-8")
    deaths = death_log(tmp_path, log=blocker / "deaths.log", records=Path("/dev/full"))

    deaths.write_death(death_record())
    deaths.write_recovery(recovery_record())

    death_line, recovery_line = capsys.readouterr().err.splitlines()
    assert death_line.startswith("ralph-run: could not write death record (")
    assert "/dev/full: No space left on device" in death_line
    assert json.loads(death_line.split("): ", 1)[1]) == json.loads(json.dumps(death_record()))
    assert recovery_line.startswith("ralph-run: could not write recovery record (")
    assert json.loads(recovery_line.split("): ", 1)[1])["seconds"] == 41.2


def test_a_torn_last_line_is_skipped_with_a_warning(tmp_path, capsys):
    deaths = death_log(tmp_path)
    deaths.write_death(death_record(1))
    deaths.write_recovery(recovery_record(1))
    whole = json.dumps(death_record(2))
    with deaths.records_path.open("ab") as records:  # kill -9 in the middle of a write
        records.write(whole.encode("utf-8")[: len(whole) // 2])

    assert [r["event"] for r in read_records(deaths.records_path)] == ["death", "recovery"]
    warning = capsys.readouterr().err
    assert "vllm-deaths.jsonl:3: skipped a torn" in warning

    deaths.write_death(death_record(3))  # the next run starts on a fresh line
    assert [r["death"] for r in read_records(deaths.records_path)] == [1, 1, 3]


def test_a_torn_multibyte_character_is_a_torn_line_too(tmp_path, capsys):
    path = tmp_path / "deaths.jsonl"
    good = json.dumps(death_record(1), ensure_ascii=False) + "\n"
    torn = json.dumps(death_record(2), ensure_ascii=False).encode("utf-8")
    cut = torn.index("상".encode()) + 1  # inside a 3-byte character
    path.write_bytes(good.encode("utf-8") + torn[:cut])

    assert [r["death"] for r in read_records(path)] == [1]
    assert "skipped a torn" in capsys.readouterr().err


def test_no_records_file_means_no_deaths(tmp_path):
    assert read_records(tmp_path / "none.jsonl") == []
    assert summarize([]) == "no deaths recorded"


def test_summary_lists_each_death_with_its_recovery_then_totals():
    second = death_record(2, time="2026-05-04T12:30:01+09:00", iteration=35, phase="during-step")
    second["probes"] = [
        {
            "name": "can generate",
            "kind": "completion",
            "ok": False,
            "reason": "timeout",
            "detail": "",
            "seconds": 20.0,
        }
    ]
    second["item"] = {"text": "x" * 100, "line": 40, "index": 30, "attempts": 1}
    records = [
        death_record(1),
        recovery_record(1),
        second,
        recovery_record(2, recovered=False, attempts=2, reason="recovery steps failed 2 times"),
    ]

    lines = summarize(copy.deepcopy(records)).splitlines()

    assert len(lines) == 3
    first, failed, total = lines
    for line, expected in (
        (
            first,
            [
                "#1",
                "2026-05-04 11:46:38",
                "iter 30",
                "post-step",
                "models endpoint: refused",
                "recovered in 41.2 s (1 attempt)",
                "src/game.js 상태 머신 골격",
            ],
        ),
        (
            failed,
            [
                "#2",
                "2026-05-04 12:30:01",
                "iter 35",
                "during-step",
                "can generate: timeout",
                "NOT recovered: recovery steps failed 2 times",
                "x" * 59 + "…",
            ],
        ),
    ):
        positions = [line.index(cell) for cell in expected]
        assert positions == sorted(positions), line
    assert first.index("iter") == failed.index("iter")  # columns line up
    assert total == "total: 2 deaths, 1 recovered (mean 41.2 s, max 41.2 s), 1 not recovered"


def test_summary_counts_a_death_whose_recovery_was_never_recorded():
    summary = summarize([death_record(1), recovery_record(1), death_record(2)])
    assert "no recovery recorded" in summary.splitlines()[1]
    assert summary.splitlines()[-1] == (
        "total: 2 deaths, 1 recovered (mean 41.2 s, max 41.2 s), 0 not recovered,"
        " 1 without a recovery record"
    )
