"""Death signatures: one kind of death reads the same whatever its numbers, ids and paths."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.standin import StandIn, wait_for

from ralph_runner.deaths import signatures

pytestmark = pytest.mark.timeout(60)

SEED = "AssertionError: num_required_blocks 25 < len(req_blocks) 26"
MASKED = "AssertionError: num_required_blocks <num> < len(req_blocks) <num>"


def log_collector(output: str, name: str = "container log (last lines)") -> dict:
    return {"name": name, "ok": True, "output": output}


def death(collectors=(), probes=(), **fields) -> dict:
    return {"event": "death", "collectors": list(collectors), "probes": list(probes), **fields}


def test_the_seed_assertion_groups_whatever_its_numbers() -> None:
    other = "AssertionError: num_required_blocks 7 < len(req_blocks) 8"
    assert signatures.mask(SEED) == signatures.mask(other) == MASKED
    assert signatures.mask("AssertionError: something else 25") != MASKED


@pytest.mark.parametrize(
    ("line", "masked"),
    [
        (
            "KeyError: 'req-3f9a0c1e22b4' at 2026-12-01T07:46:27.123Z",
            "KeyError: 'req-<hex>' at <time>",
        ),
        (
            "RuntimeError: bad access at 0x7f3a2b in /usr/lib/x.so",
            "RuntimeError: bad access at <hex> in <path>",
        ),
        (
            "OSError: worker pid=4242 died at 05-04 01:46:37",
            "OSError: worker pid=<pid> died at <time>",
        ),
        (
            "ValueError: id 3e0f5a2c-1b2d-4c3e-9f8a-7b6c5d4e3f2a, 2.5 GiB",
            "ValueError: id <id>, <num> GiB",
        ),
    ],
)
def test_masks_hex_ids_pids_paths_and_timestamps(line: str, masked: str) -> None:
    assert signatures.mask(line) == masked


def test_the_root_cause_wins_over_the_error_that_points_at_it(tmp_path: Path) -> None:
    """The stand-in's log of an engine death, as vLLM writes it: the KV-cache assertion, then
    `EngineDeadError: ... See stack trace (above) for the root cause.`"""
    with StandIn(tmp_path / "vllm") as server:
        server.start(HEALTH_TIMEOUT="1")
        pid = server.pid
        server.trigger(die=True)
        server.wait_dead(pid)
        log = wait_for(lambda: "EngineDeadError" in server.log() and server.log(), what="log")
    found = signatures.of_record(death([log_collector(log, "server log (last 60 lines)")]))
    assert found["signature"].startswith("AssertionError: num_required_blocks <num> < len(")
    assert found["signature_from"]["source"] == "server log (last 60 lines)"
    assert found["signature_from"]["line"].startswith("AssertionError: num_required_blocks ")


def test_no_exception_in_the_log_signs_the_death_by_its_probe() -> None:
    probes = [
        {"name": "models endpoint", "kind": "http", "ok": True, "reason": None},
        {
            "name": "can generate",
            "kind": "completion",
            "ok": False,
            "reason": "status",
            "detail": "HTTP 503: engine dead",
        },
    ]
    record = death([log_collector("INFO: all quiet\n")], probes)
    assert signatures.of_record(record)["signature"] == "probe can generate: status 503"
    stalled = [{"name": "tokens", "kind": "http", "ok": False, "reason": "stalled", "detail": ""}]
    assert signatures.of_record(death(probes=stalled))["signature"] == "probe tokens: stalled"
    assert signatures.of_record(death())["signature"] == "unknown"


def test_only_collectors_that_hold_a_log_are_read() -> None:
    """A checklist item may quote an error; that is no death of the server."""
    checklist = {"name": "CHECKLIST", "ok": True, "output": "- [ ] fix TypeError: x is None\n"}
    refused = [{"name": "models", "kind": "http", "ok": False, "reason": "refused"}]
    assert signatures.of_record(death([checklist], refused))["signature"] == "probe models: refused"


def test_the_recorder_log_since_the_last_recovery_decides() -> None:
    """An exception an earlier death left in the followed log does not sign the next death."""
    recorder = {
        "log_source": "follow: docker logs -f vllm",
        "since_recovery": 200.0,
        "log": [[100.0, SEED], [150.0, "INFO restarted"], [250.0, "INFO: GET /v1/models 200"]],
    }
    hang = [{"name": "can generate", "kind": "completion", "ok": False, "reason": "timeout"}]
    old_tail = log_collector(f"{SEED}\nINFO restarted\n")  # docker's tail still shows it
    record = death([old_tail], hang, recorder=recorder)
    assert signatures.of_record(record)["signature"] == "probe can generate: timeout"
    recorder["log"].append([260.0, "torch.OutOfMemoryError: CUDA out of memory. Tried 2.00 GiB"])
    found = signatures.of_record(record)
    assert found["signature"] == "torch.OutOfMemoryError: CUDA out of memory. Tried <num> GiB"
    assert found["signature_from"]["source"] == "recorder log"


def test_a_record_written_before_signatures_gets_one_computed(tmp_path: Path) -> None:
    old = death([log_collector(f"(EngineCore pid=1) ERROR 05-04 01:46:37 [core.py:1] {SEED}")])
    path = tmp_path / "deaths.jsonl"
    path.write_text(json.dumps(old) + "\n")
    (read,) = [json.loads(line) for line in path.read_text().splitlines()]
    assert "signature" not in read
    assert signatures.signature(read) == MASKED
    assert signatures.signature({**read, "signature": "stored one"}) == "stored one"
