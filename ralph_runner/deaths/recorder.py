"""The flight recorder: what the server did in the minutes before it died, kept on disk.

While the loop runs, a sampler thread reads the runbook's metrics from the server's `/metrics`
and the GPUs' memory through NVML every `period` seconds, and a follower thread reads the server
log as it grows (`follow:` a command run through the host's connection, like any collector, or
`file:` a path). Everything goes into a ring of JSONL segments under `.ralph/recorder/`: at most
SEGMENTS files of `max_mb / SEGMENTS` each, the oldest deleted when a new one starts, so the ring
never holds more than `max_mb` (a log line longer than MAX_LINE characters is cut). Each entry is
one `write(2)` (jsonl.py): a kill -9 loses nothing written, a torn last line is read around, and
the next run appends to the same ring, so a death right after a restart still sees what came
before it. At a death, `window()` reads the last `window` seconds back for the death record.

A metric the server does not expose is reported once. A follow command that exits (the
container stopped, docker restarted) is started again after 1 s, doubling to 60 s while it
keeps exiting, never in a tight loop.
"""

from __future__ import annotations

import codecs
import contextlib
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Final

import httpx

from ralph_runner.actions import nvml
from ralph_runner.durable import jsonl
from ralph_runner.durable.redaction import Redactor
from ralph_runner.plugins import network_errors, prometheus_text
from ralph_runner.plugins.bounded_http import fetch
from ralph_runner.process.connection import Connection

DIRECTORY = "recorder"  # under the state directory
SEGMENTS = 8
SEGMENT_GLOB = "segment-*.jsonl"
MAX_LINE = 4096  # characters of one log line kept
FOLLOW_OUTPUT = 1024  # bytes execute keeps of the follow command's output (we stream it)
BACKOFF_FIRST, BACKOFF_MOST = 1.0, 60.0  # seconds before a follow command is started again
STEADY = 60.0  # a follow command that ran this long had been working: back to the first wait
FILE_POLL = 0.5  # seconds between looks at a followed file
READ_SIZE = 1 << 20  # bytes per read of a followed file
SCRAPE_TIMEOUT = 2.0  # seconds for one GET of /metrics
PROMPT_TOKENS = "vllm:prompt_tokens_total"
GPU_FIELDS: Final = ("index", "memory_used_mib", "memory_total_mib", "utilization_percent")
COUNTER_SUFFIXES = ("_total", "_count", "_sum", "_bucket")


@dataclass
class Settings:
    """A runbook's `recorder:` with its templates rendered, for one host."""

    url: str | None
    metrics: list[str]
    period: float
    gpu: bool
    follow: str | None
    file: Path | None
    window: float
    max_lines: int
    max_bytes: int
    connection: Connection

    @property
    def log_source(self) -> str | None:
        if self.follow:
            return f"follow: {self.follow}"
        return f"file: {self.file}" if self.file else None


class Ring:
    """Bounded JSONL segments in one directory; thread-safe appends."""

    def __init__(
        self,
        directory: Path,
        max_bytes: int,
        segments: int = SEGMENTS,
        redactor: Redactor | None = None,
    ) -> None:
        self.directory = directory
        self.redactor = redactor or Redactor([])  # a server log may quote a prompt, a key
        self.segments = segments
        self.segment_bytes = max_bytes // segments
        self.dropped = 0  # entries lost to a write error (a full disk)
        self.error: str | None = None
        self._lock = threading.Lock()
        directory.mkdir(parents=True, exist_ok=True)
        self._drop_oldest(budget=max_bytes)
        existing = self.files()
        self.number = _number(existing[-1]) if existing else 1
        if existing and _size(existing[-1]) >= self.segment_bytes:
            self.number += 1
        self._current = jsonl.Appender(self._path(self.number))

    def files(self) -> list[Path]:
        """The segments, oldest first."""
        return sorted(self.directory.glob(SEGMENT_GLOB), key=_number)

    def append(self, entries: list[dict[str, Any]]) -> None:
        """Write entries; a write error (a full disk) drops them, counted, and never raises:
        the recorder runs on threads the loop does not watch."""
        lines = [jsonl.dumps(self.redactor.data(entry)) for entry in entries]
        with self._lock:
            try:
                self._append(lines)
            except OSError as exc:
                self.dropped += len(lines)
                self.error = str(exc)

    def _append(self, lines: list[str]) -> None:
        batch: list[str] = []
        size = self._current.size
        for line in lines:
            length = len(line.encode("utf-8")) + 2  # newline, and one for a torn line's
            if size + length > self.segment_bytes and (batch or size):
                self._current.write(batch)
                batch = []
                self._rotate()
                size = 0
            batch.append(line)
            size += length
        if batch:
            self._current.write(batch)

    def read_since(self, since: float, skipped: jsonl.Skipped) -> list[dict[str, Any]]:
        """Entries with `t` >= since, oldest first, reading the newest segments only."""
        found: list[list[dict[str, Any]]] = []
        for path in reversed(self.files()):
            timed = [(t, e) for _, e in jsonl.read(path, skipped) if (t := _time(e)) is not None]
            found.append([e for t, e in timed if t >= since])
            if timed and timed[0][0] < since:
                break
        return [entry for segment in reversed(found) for entry in segment]

    def close(self) -> None:
        with self._lock:
            self._current.close()

    def _rotate(self) -> None:
        self._current.close()
        self.number += 1
        self._current = jsonl.Appender(self._path(self.number))
        self._drop_oldest()

    def _drop_oldest(self, budget: int | None = None) -> None:
        """Keep the newest `segments` files (and, at start, no more than `budget` bytes: the
        bound may have been lowered since the ring was written)."""
        files = self.files()
        drop = files[: max(0, len(files) - self.segments)]
        if budget is not None:
            kept = files[len(drop) :]
            while kept and sum(_size(path) for path in kept) > budget:
                drop.append(kept.pop(0))
        for path in drop:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def _path(self, number: int) -> Path:
        return self.directory / f"segment-{number:08d}.jsonl"


def _number(path: Path) -> int:
    try:
        return int(path.stem.rsplit("-", 1)[1])
    except (IndexError, ValueError):
        return 0


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _stat(path: Path) -> os.stat_result | None:
    try:
        return path.stat()
    except OSError:
        return None


def _time(entry: dict[str, Any]) -> float | None:
    t = entry.get("t")
    return t if isinstance(t, int | float) else None


def parse_metrics(text: str, wanted: set[str]) -> dict[str, float]:
    """The wanted metrics of a Prometheus text page. Several series of one name (engines,
    models): a counter's are added up, a gauge's largest is kept."""
    values: dict[str, float] = {}
    for sample in prometheus_text.samples(text, wanted):
        name, value = sample.name, float(sample.value)
        if not math.isfinite(value):
            continue  # NaN / Inf: JSON cannot hold it, and it says nothing
        if name in values:
            counter = name.endswith(COUNTER_SUFFIXES)
            value = values[name] + value if counter else max(values[name], value)
        values[name] = value
    return values


class Gpus:
    """NVML kept open for the recorder's lifetime; `why` says why there is nothing to read."""

    def __init__(self) -> None:
        self.pynvml: Any = None
        self.count = 0
        self.why: str | None = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self.count = pynvml.nvmlDeviceGetCount()
            self.pynvml = pynvml
        except Exception as exc:  # ImportError, pynvml.NVMLError: no library, driver or device
            self.why = f"no NVIDIA driver: {exc}"

    def read(self) -> list[dict[str, Any]]:
        found = []
        for index in range(self.count):
            try:
                facts = nvml.gpu_facts(self.pynvml, index)
            except self.pynvml.NVMLError as exc:
                found.append({"index": index, "error": str(exc)})
                continue
            found.append({key: facts[key] for key in GPU_FIELDS})
        return found

    def close(self) -> None:
        if self.pynvml is not None:
            with contextlib.suppress(Exception):
                self.pynvml.nvmlShutdown()
            self.pynvml = None


class FileTail:
    """A log file read as it grows, like `tail -F`: from where it ended when the recorder
    started (earlier lines are in the ring already, or belong to an older run), and from the
    start of a file that appears later, is rotated (a new inode) or truncated. `poll` reads
    what is new; the follower thread calls it every FILE_POLL s, a death at once."""

    def __init__(self, path: Path, on_text: Callable[[str], None]) -> None:
        self.path, self.on_text = path, on_text
        self._lock = threading.Lock()
        self._handle: BinaryIO | None = None
        self._inode: int | None = None
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        stat = _stat(path)
        self._resume = (stat.st_ino, stat.st_size) if stat else None  # where the start was

    def poll(self) -> None:
        with self._lock:
            stat = _stat(self.path)
            if stat is not None and stat.st_ino != self._inode:
                if self._handle is not None:  # rotated: the rest of the old file, then the new
                    self._drain()
                    self._handle.close()
                self._handle, self._inode = self.path.open("rb"), stat.st_ino
                if self._resume and self._resume[0] == stat.st_ino:
                    self._handle.seek(min(self._resume[1], stat.st_size))
                self._resume = None
            if self._handle is not None:
                if stat is not None and stat.st_size < self._handle.tell():
                    self._handle.seek(0)  # truncated
                self._drain()

    def _drain(self) -> None:
        assert self._handle is not None
        while chunk := self._handle.read(READ_SIZE):
            self.on_text(self._decoder.decode(chunk))

    def close(self) -> None:
        with self._lock:
            if self._handle is not None:
                self._handle.close()
                self._handle = None


class Recorder:
    """Samples, follows and writes the ring until `stop()`; `window()` at a death."""

    def __init__(
        self,
        settings: Settings,
        directory: Path,
        warn: Callable[[str], None] | None = None,
        redactor: Redactor | None = None,
    ) -> None:
        self.settings = settings
        self.ring = Ring(directory, settings.max_bytes, redactor=redactor)
        self.warn = warn or (lambda message: None)
        self.missing: set[str] = set()
        self.latest: dict[str, float] = {}
        self.scrape_error: str | None = None
        self._stop = threading.Event()
        self._scrape_lock = threading.Lock()
        self._client = httpx.Client(timeout=SCRAPE_TIMEOUT) if settings.url else None
        self._gpus: Gpus | None = None
        self._partial = ""
        self._tail: FileTail | None = None
        self._threads: list[threading.Thread] = []

    # -- life ------------------------------------------------------------------
    def start(self) -> None:
        if self.settings.gpu:
            self._gpus = Gpus()
            if self._gpus.why:
                self._note(f"GPU memory not sampled: {self._gpus.why}")
        if self.settings.url or (self._gpus and self._gpus.count):
            self._spawn("recorder: sampler", self._sample_loop)
        if self.settings.follow:
            self._spawn("recorder: follow", self._follow_command)
        elif self.settings.file:
            self._tail = FileTail(self.settings.file, self._on_text)
            self._spawn("recorder: file", self._follow_file)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=10)
        self._flush_partial()
        if self._client is not None:
            self._client.close()
        if self._gpus is not None:
            self._gpus.close()
        self.ring.close()

    def _spawn(self, name: str, target: Callable[[], None]) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    # -- samples ---------------------------------------------------------------
    def _sample_loop(self) -> None:
        failed = False
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.sample_now()
            except Exception as exc:  # an odd page or an NVML fault: say so once, go on
                if not failed:
                    self._note(f"sample failed: {exc!r}")
                failed = True
            self._stop.wait(max(0.0, self.settings.period - (time.monotonic() - started)))

    def sample_now(self) -> dict[str, Any]:
        """Take one sample now (also called at iteration boundaries) and write it to the ring."""
        with self._scrape_lock:
            sample: dict[str, Any] = {}
            if self._client is not None:
                metrics, error = self._scrape()
                sample["metrics"] = metrics
                if error:
                    sample["error"] = error
            if self._gpus is not None and self._gpus.count:
                sample["gpu"] = self._gpus.read()
            self.ring.append([{"t": round(time.time(), 3), "sample": sample}])
            return sample

    def _scrape(self) -> tuple[dict[str, float], str | None]:
        assert self._client is not None and self.settings.url is not None
        try:
            response = fetch(self._client, "GET", self.settings.url, timeout=SCRAPE_TIMEOUT)
        except httpx.HTTPError as exc:
            return {}, network_errors.classify(exc)[0]  # refused, timeout or error, as a probe says
        if response.status_code != 200:
            return {}, f"status {response.status_code}"
        metrics = parse_metrics(response.text, set(self.settings.metrics))
        self.latest = metrics
        for name in self.settings.metrics:
            if name not in metrics and name not in self.missing:
                self.missing.add(name)
                message = f"the server at {self.settings.url} exposes no {name}: not sampled"
                self._note(message)
                self.warn(f"recorder: {message}")
        return metrics, None

    def prompt_tokens(self) -> tuple[float | None, str | None]:
        """The server's prompt-token counter now, or why it cannot be read (the history's
        prompt tokens are its change over an iteration)."""
        if PROMPT_TOKENS not in self.settings.metrics:
            return None, f"{PROMPT_TOKENS} is not among recorder.metrics"
        if PROMPT_TOKENS in self.missing:
            return None, f"the server exposes no {PROMPT_TOKENS}"
        sample = self.sample_now()
        if PROMPT_TOKENS in sample.get("metrics", {}):
            return sample["metrics"][PROMPT_TOKENS], None
        return None, f"/metrics: {sample.get('error') or f'no {PROMPT_TOKENS}'}"

    # -- the log ---------------------------------------------------------------
    def _follow_command(self) -> None:
        """Run the follow command for as long as the recorder runs, restarting it with backoff."""
        assert self.settings.follow is not None
        wait = BACKOFF_FIRST
        while not self._stop.is_set():
            started = time.monotonic()
            result = self.settings.connection.shell(
                self.settings.follow,
                cancel=self._stop,
                max_output=FOLLOW_OUTPUT,
                on_output=self._on_text,
            )
            self._flush_partial()
            if self._stop.is_set() or result.cancelled:
                return  # stopped by us, or by ralph-run's shutdown (kill_all)
            ran = time.monotonic() - started
            wait = BACKOFF_FIRST if ran >= STEADY else wait
            why = "could not start" if result.exit_code == 127 else f"exit {result.exit_code}"
            message = f"log follow command ended ({why}) after {ran:.1f} s; again in {wait:g} s"
            self._note(message + (f": {result.output.strip()[-200:]}" if ran < 1 else ""))
            if self._stop.wait(wait):
                return
            wait = min(wait * 2, BACKOFF_MOST)

    def _follow_file(self) -> None:
        assert self._tail is not None
        try:
            while not self._stop.is_set():
                self._tail.poll()
                self._stop.wait(FILE_POLL)
        finally:
            self._tail.close()

    def _on_text(self, text: str) -> None:
        """Output of the followed log, in arbitrary chunks: whole lines go into the ring."""
        if not text:
            return
        *lines, self._partial = (self._partial + text).split("\n")
        if len(self._partial) > MAX_LINE:
            lines.append(self._partial)
            self._partial = ""
        if lines:
            now = round(time.time(), 3)
            self.ring.append([{"t": now, "log": line.rstrip("\r")[:MAX_LINE]} for line in lines])

    def _flush_partial(self) -> None:
        if self._partial:
            self._on_text("\n")

    # -- notes and deaths ------------------------------------------------------
    def _note(self, text: str) -> None:
        self.ring.append([{"t": round(time.time(), 3), "note": text}])

    def mark_recovery(self, death: Any) -> None:
        """A recovery finished: log lines from now on belong to the next death, if any."""
        self.ring.append([{"t": round(time.time(), 3), "recovered": death}])

    def window(self) -> dict[str, Any]:
        """The last `window` seconds, for a death record."""
        settings = self.settings
        if self._tail is not None and not self._stop.is_set():
            self._tail.poll()  # what the server wrote since the last look, its last words
        now = time.time()
        skipped = jsonl.Skipped()
        entries = self.ring.read_since(now - settings.window, skipped)
        log = [[e["t"], e["log"]] for e in entries if isinstance(e.get("log"), str)]
        recoveries = [e["t"] for e in entries if "recovered" in e]
        return {
            "window": settings.window,
            "from": round(now - settings.window, 3),
            "to": round(now, 3),
            "period": settings.period,
            "metrics_url": settings.url,
            "metrics": settings.metrics,
            "missing": sorted(self.missing),
            "log_source": settings.log_source,
            "since_recovery": recoveries[-1] if recoveries else None,
            "samples": [{"t": e["t"], **e["sample"]} for e in entries if "sample" in e],
            "log": log[-settings.max_lines :],
            "log_lines_cut": max(0, len(log) - settings.max_lines),
            "notes": [[e["t"], e["note"]] for e in entries if "note" in e],
            "skipped_lines": skipped.total,
            "dropped_entries": self.ring.dropped,
            "ring_error": self.ring.error,
        }
