"""`ralph-run report` in a real browser: the demo's night as one offline page, no console error."""

from __future__ import annotations

import html
import json
import subprocess
import sys
from pathlib import Path

import pytest
from browser_helpers import available, opened
from support.standin import ROOT, python_env

from ralph_runner.durable import jsonl

pytestmark = pytest.mark.timeout(240)
SCREENSHOTS = ROOT / ".cache" / "artifacts"


def ralph_run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ralph_runner", *args],
        capture_output=True,
        text=True,
        env=python_env(),
        cwd=cwd,
        timeout=200,
    )


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`ralph-run demo`: two deaths on the stand-in, recovered; it ends by writing its report."""
    workspace = tmp_path_factory.mktemp("demo") / "workspace"
    done = ralph_run("demo", "--dir", str(workspace))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"\nreport: {workspace / 'report.html'}\n" in done.stdout, done.stdout[-3000:]
    return workspace


def deaths_of(workspace: Path) -> list[dict]:
    records = jsonl.read(workspace / "logs" / "vllm-deaths.jsonl", jsonl.Skipped())
    return [r for _, r in records if r["event"] == "death"]


def test_the_demo_report_loads_offline_with_no_console_error(demo: Path, tmp_path: Path) -> None:
    if not available():
        pytest.skip("no /usr/bin/chromium (apt-get install chromium): the browser test needs it")
    report = demo / "report.html"
    deaths = deaths_of(demo)
    assert len(deaths) == 2
    with opened(report.as_uri(), tmp_path / "profile") as page:
        roots = page.poll(
            "window.Bokeh && Bokeh.documents.length > 0 && "
            "document.querySelectorAll('.bk-Column, .bk-Figure, .bk-Row').length"
        )
        shot = page.screenshot(SCREENSHOTS / "report-demo.png")
        rows = page.evaluate(
            "[...document.querySelectorAll('#deaths tr.death')].map("
            "r => [r.dataset.death, r.querySelector('.signature').textContent])"
        )
        signatures = page.evaluate(
            "[...document.querySelectorAll('#signatures .signature')].map(s => s.textContent)"
        )
        errors, requests = page.errors(), page.requests()
    assert errors == []
    assert [url for url in requests if not url.startswith(("file:", "data:", "blob:"))] == []
    assert roots >= 1
    assert rows == [[str(d["death"]), d["signature"]] for d in deaths]
    assert "AssertionError: num_required_blocks <num> < len(req_blocks) <num>" in signatures
    assert sorted(signatures) == sorted({d["signature"] for d in deaths})
    assert shot.stat().st_size > 10_000
    print(f"screenshot: {shot}")


def test_report_of_records_with_torn_lines_says_what_it_skipped(demo: Path, tmp_path: Path) -> None:
    records = tmp_path / "deaths.jsonl"
    text = (demo / "logs" / "vllm-deaths.jsonl").read_text()
    records.write_text(text + '["foreign"]\n{"event": "death", "de')
    out = tmp_path / "out" / "r.html"
    done = ralph_run("report", str(records), str(demo / "runbook-less"), "-o", str(out))
    assert done.returncode == 2 and "no such file or directory" in done.stderr
    done = ralph_run("report", str(records), "-o", str(out))
    assert done.returncode == 0 and done.stderr == "", done.stderr  # bokeh validates quietly
    assert "skipped 2 lines (1 torn, 1 foreign)" in done.stdout
    page = out.read_text()
    assert "skipped 2 lines (1 torn, 1 foreign)" in page
    assert "<script src=" not in page and "<link" not in page  # nothing to fetch
    for death in deaths_of(demo):
        assert f'data-death="{death["death"]}"' in page


def test_the_deaths_json_matches_the_page(demo: Path) -> None:
    answers = json.loads(ralph_run("deaths", str(demo), "--json").stdout)
    page = (demo / "report.html").read_text()
    assert answers["totals"]["deaths"] == 2
    for row in answers["by_signature"]:
        assert f'<code class="signature">{html.escape(row["signature"])}</code>' in page
