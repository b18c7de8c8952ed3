"""`ralph-run deaths`: the seed's questions answered from records and histories, as a CLI."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.standin import python_env

pytestmark = pytest.mark.timeout(60)

START = 1_800_000_000.0
KV = "AssertionError: num_required_blocks {n} < len(req_blocks) {m}"


def iso(epoch: float) -> str:
    from datetime import datetime

    return datetime.fromtimestamp(epoch).astimezone().isoformat(timespec="seconds")


def night(
    host: str, iterations: int, seed: int, above: float = 0.25, below: float = 0.005
) -> tuple[list[dict], list[dict]]:
    """A made-up night on one host: prompts grow; above 12,000 chars one iteration in four dies
    of the KV-cache assertion (other numbers each time), below it one in 200 hangs."""
    rng = random.Random(seed)
    records: list[dict] = []
    history: list[dict] = []
    now, deaths = START, 0
    for number in range(1, iterations + 1):
        chars = rng.randrange(2_000, 16_000)
        started, now = now, now + 60
        dies = rng.random() < (above if chars >= 12_000 else below)
        entry = {
            "event": "iteration",
            "time": iso(started),
            "started": started,
            "host": host,
            "iteration": number,
            "item": f"item {number}",
            "prompt_chars": chars,
            "prompt_bytes": chars,
            "seconds": 60.0,
            "outcome": "done",
            "deaths": [],
        }
        if dies:
            deaths += 1
            kv = chars >= 12_000
            blocks = rng.randrange(10, 90)
            log = KV.format(n=blocks, m=blocks + 1) if kv else "INFO: GET /v1/models 200"
            records.append(
                {
                    "event": "death",
                    "death": deaths,
                    "time": iso(started + 30),
                    "host": host,
                    "iteration": number,
                    "item": {"text": f"item {number}"},
                    "phase": "during-step" if kv else "post-step",
                    "prompt_size": chars,
                    "probes": [
                        {
                            "name": "can generate",
                            "kind": "completion",
                            "ok": False,
                            "reason": "refused" if kv else "timeout",
                            "detail": "",
                        }
                    ],
                    "collectors": [
                        {
                            "name": "container log (last lines)",
                            "ok": True,
                            "output": f"(EngineCore pid={rng.randrange(100, 999)}) {log}\n",
                        }
                    ],
                }
            )
            records.append(
                {
                    "event": "recovery",
                    "death": deaths,
                    "time": iso(started + 40),
                    "attempts": 1,
                    "recovered": True,
                    "seconds": 5.0 + deaths % 10,
                }
            )
            entry.update(outcome="death", deaths=[deaths])
        history.append(entry)
    return records, history


def write_lines(path: Path, entries: list[dict[str, Any]], extra: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(e) + "\n" for e in entries) + extra)
    return path


def deaths(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ralph_runner", "deaths", *args],
        capture_output=True,
        text=True,
        env=python_env(),
        cwd=cwd,
        timeout=60,
    )


def answers(*args: str, cwd: Path | None = None) -> dict[str, Any]:
    done = deaths(*args, "--json", cwd=cwd)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_groups_by_signature_and_finds_where_deaths_cluster(tmp_path: Path) -> None:
    records, history = night("gpu-a", 1000, seed=1)
    write_lines(tmp_path / "work" / "logs" / "deaths.jsonl", records)
    write_lines(tmp_path / "work" / ".ralph" / "iterations.jsonl", history)
    found = answers(str(tmp_path / "work" / "logs" / "deaths.jsonl"))  # finds ../.ralph itself

    kv = sum(1 for r in records if r["event"] == "death" and r["phase"] == "during-step")
    first, second = found["by_signature"][:2]
    assert first["signature"] == "AssertionError: num_required_blocks <num> < len(req_blocks) <num>"
    assert first["deaths"] == kv and first["phases"] == {"during-step": kv}
    assert second["signature"] == "probe can generate: timeout"
    assert found["totals"]["iterations"] == 1000
    cluster = found["prompt_size"]["cluster"]
    assert cluster["above_chars"] == 12_000
    assert cluster["rate_above"] > 10 * cluster["rate_below"]
    assert found["recovery"]["max"] == 14.0 and found["recovery"]["too_little"] is None
    assert found["between_deaths"]["running_seconds_per_death"] == pytest.approx(
        60_000 / found["totals"]["deaths"]
    )

    text = deaths(str(tmp_path / "work")).stdout  # a workdir with no sources.json
    assert "no .ralph/sources.json" in text
    assert "deaths cluster above 12,000 chars" not in text  # no records named: history only


def test_an_even_death_rate_is_no_cluster(tmp_path: Path) -> None:
    records, history = night("gpu-a", 2000, seed=7, above=0.05, below=0.05)
    write_lines(tmp_path / "logs" / "deaths.jsonl", records)
    write_lines(tmp_path / ".ralph" / "iterations.jsonl", history)
    prompt = answers(str(tmp_path / "logs" / "deaths.jsonl"))["prompt_size"]
    assert prompt["cluster"] is None and prompt["too_little"] is None
    assert prompt["no_cluster"].startswith("deaths do not cluster by prompt size")


def test_the_text_view_answers_each_question(tmp_path: Path) -> None:
    records, history = night("gpu-a", 1000, seed=2)
    log = write_lines(tmp_path / "logs" / "deaths.jsonl", records)
    write_lines(tmp_path / ".ralph" / "iterations.jsonl", history)
    (tmp_path / ".ralph" / "sources.json").write_text(json.dumps({"records": str(log)}))
    done = deaths(str(tmp_path))
    assert done.returncode == 0, done.stderr
    out = done.stdout
    for expected in (
        "by signature",
        "AssertionError: num_required_blocks <num> < len(req_blocks) <num>",
        "by phase: during-step",
        "mean time between deaths:",
        "recovery: p50 ",
        "death rate by prompt size (chars)",
        "deaths cluster above 12,000 chars",
        "the last 30 deaths",
    ):
        assert expected in out, out


def test_torn_and_foreign_lines_are_read_around_and_counted(tmp_path: Path) -> None:
    records, _ = night("gpu-a", 200, seed=3)
    torn = '{"event": "death", "death": 99, "ti\n'
    foreign = '["not", "a record"]\n{"event": "something else"}\n'
    path = write_lines(tmp_path / "deaths.jsonl", records, extra=foreign + torn)
    found = answers(str(path))
    assert found["skipped"]["total"] == 3
    assert (found["skipped"]["torn"], found["skipped"]["foreign"]) == (1, 2)
    assert found["totals"]["deaths"] == sum(1 for r in records if r["event"] == "death")
    assert "skipped 3 lines (1 torn, 2 foreign)" in deaths(str(path)).stdout


def test_many_record_files_and_hosts(tmp_path: Path) -> None:
    a_records, a_history = night("gpu-a", 300, seed=4)
    b_records, b_history = night("gpu-b", 300, seed=5)
    a = write_lines(tmp_path / "a" / "deaths.jsonl", a_records)
    b = write_lines(tmp_path / "b" / "deaths.jsonl", b_records)
    write_lines(tmp_path / "a" / ".ralph" / "iterations.jsonl", a_history)
    write_lines(tmp_path / "b" / ".ralph" / "iterations.jsonl", b_history)
    found = answers(str(a), str(b), str(a))  # named twice: read once
    died = {
        h: sum(1 for r in rs if r["event"] == "death")
        for h, rs in (("gpu-a", a_records), ("gpu-b", b_records))
    }
    assert {h: v["deaths"] for h, v in found["by_host"].items()} == died
    assert {h: v["iterations"] for h, v in found["by_host"].items()} == {"gpu-a": 300, "gpu-b": 300}
    assert found["totals"]["hosts"] == ["gpu-a", "gpu-b"]
    assert len(found["files"]) == 4


def test_too_little_data_is_said(tmp_path: Path) -> None:
    one = [
        {
            "event": "death",
            "death": 1,
            "time": iso(START),
            "host": "h",
            "phase": "start",
            "prompt_size": 500,
            "probes": [{"name": "m", "ok": False, "reason": "refused"}],
        }
    ]
    found = answers(str(write_lines(tmp_path / "d.jsonl", one)))
    assert found["between_deaths"]["too_little"] == "needs 2 deaths on one host"
    assert found["recovery"]["too_little"] == "no recovery recorded"
    assert "no iteration history" in found["prompt_size"]["too_little"]
    text = deaths(str(tmp_path / "d.jsonl")).stdout
    assert text.count("too little data") >= 3, text
    empty = deaths(str(write_lines(tmp_path / "e.jsonl", [])))
    assert empty.returncode == 0 and "no deaths recorded" in empty.stdout


def test_a_runbook_names_its_records(tmp_path: Path) -> None:
    records, history = night("localhost", 100, seed=6)
    write_lines(tmp_path / "logs" / "vllm-deaths.jsonl", records)
    write_lines(tmp_path / ".ralph" / "iterations.jsonl", history)
    runbook = {"diagnostics": {"log": "logs/vllm-deaths.log"}, "loop": {"steps": []}}
    (tmp_path / "runbook.yaml").write_text(yaml.safe_dump(runbook))
    found = answers("runbook.yaml", cwd=tmp_path)
    assert found["totals"]["deaths"] == sum(1 for r in records if r["event"] == "death")
    assert found["totals"]["iterations"] == 100


def test_a_missing_target_is_a_clear_error(tmp_path: Path) -> None:
    done = deaths(str(tmp_path / "nope.jsonl"))
    assert done.returncode == 2
    assert (
        done.stderr.strip()
        == f"ralph-run: error: {tmp_path / 'nope.jsonl'}: no such file or directory"
    )
    assert "Traceback" not in done.stderr
