"""A stand-in for vLLM's OpenAI-compatible server that fails the ways vLLM fails, on cue.

ralph-run exists because vLLM's engine dies mid-run (and its API server then exits 0) or hangs
(and its API server keeps answering). The demo and the tests need a server that fails the same
ways, on demand, whose wire formats real agents read (SSE streams, tool calls, the Responses
API), and whose log and /metrics read like vLLM's (0.32, measured: issue 9's table).

`python -m ralph_runner.standin.server --port N --state-dir DIR` (this module: the command
line and the process's life) serves it through its parts:

  engine.py      the engine: a waiting line, a running batch of at most `--max-num-seqs`,
                 `--tokens-per-second` per sequence, statistics published at each step
  batching.py    `--batch-curve`: steps that lengthen with the batch as a measured GPU's
  faults.py      the faults (the table of what each imitates), set through `POST /admin/fail`
                 or STATE_DIR/control.json at any time
  api_server.py  the API server's state: the faults applied, the engine's deaths as vLLM's,
                 the stats log line, the state files (server.pid, exit.json)
  handler.py     the routes: /health, /v1/models, /metrics, the generations, /admin/fail
  generation.py  what a generation request asks: its prompt's size, its token limits
  metrics.py     /metrics: vLLM's series through a prometheus_client collector
  rot.py         a server that degrades without dying: slower decode with age, a memory
                 leak up to an OOM kill, preemptions (`--decode-halflife` and the rest)
  wire.py        the OpenAI wire formats, whole or streamed; vllm_log.py the log's lines
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
from pathlib import Path

from ralph_runner.standin.api_server import (
    DEFAULT_EXECUTE_MODEL_TIMEOUT,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_SHUTDOWN_DELAY,
    DEFAULT_TOKENS_PER_SECOND,
    ExitMarker,
    Options,
    StandInServer,
    write_exit_marker,
)
from ralph_runner.standin.batching import CURVES, parse_curve
from ralph_runner.standin.engine import KV_CACHE_TOKENS
from ralph_runner.standin.faults import FaultSettings, parse_faults
from ralph_runner.standin.handler import Handler
from ralph_runner.standin.rot import RotSettings
from ralph_runner.standin.vllm_log import VllmLog


def serve(options: Options) -> int:
    state_dir = options.state_dir
    state_dir.mkdir(parents=True, exist_ok=True)
    options.log.parent.mkdir(parents=True, exist_ok=True)
    (state_dir / "exit.json").unlink(missing_ok=True)
    log = VllmLog(options.log, os.getpid())
    try:
        server = StandInServer(options, log, Handler)
    except OSError as error:
        log.record(
            "ERROR",
            "api_server.py:1830",
            f"[Errno {error.errno}] {error.strerror}: port {options.port}",
        )
        write_exit_marker(state_dir, ExitMarker(pid=log.pid, code=1, reason=str(error)))
        return 1
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    (state_dir / "server.pid").write_text(f"{log.pid}\n", encoding="utf-8")
    log.startup(options.model, server.port, KV_CACHE_TOKENS, options.max_num_seqs)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    while not stop.wait(options.stats_interval):
        server.tick(options.stats_interval)
    log.shutdown()
    server.release()
    server.shutdown()
    server.server_close()
    server.finish(code=0, reason="SIGTERM")
    return 0


def _faults(text: str) -> FaultSettings:
    """`--faults`: a JSON object of FAULTS, checked as /admin/fail checks them."""
    try:
        return parse_faults(json.loads(text))
    except ValueError as error:  # JSONDecodeError is one
        raise argparse.ArgumentTypeError(str(error)) from error


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ralph_runner.standin.server", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--state-dir", type=Path, required=True)
    parser.add_argument("--model", default="stand-in")
    parser.add_argument("--log", type=Path, help="default: STATE_DIR/server.log")
    parser.add_argument(
        "--stats-interval", type=float, default=1.0, help="seconds between stats lines"
    )
    parser.add_argument(
        "--tokens-per-second",
        type=float,
        default=DEFAULT_TOKENS_PER_SECOND,
        help=f"generation speed per sequence (default {DEFAULT_TOKENS_PER_SECOND:g})",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=DEFAULT_MAX_NUM_SEQS,
        help=f"sequences generated at once; the others wait (default {DEFAULT_MAX_NUM_SEQS})",
    )
    parser.add_argument(
        "--execute-model-timeout",
        type=float,
        default=DEFAULT_EXECUTE_MODEL_TIMEOUT,
        help="seconds before worker_timeout kills the engine (VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS)",
    )
    parser.add_argument(
        "--shutdown-delay",
        type=float,
        default=DEFAULT_SHUTDOWN_DELAY,
        help="seconds the API server answers after its engine died, before it exits 0",
    )
    parser.add_argument(
        "--batch-curve",
        type=parse_curve,
        help="steps lengthen with the batch as a GPU's: "
        f"{', '.join(CURVES)} (measured) or BATCH:MS,... (default: every step alike)",
    )
    parser.add_argument(
        "--script", type=Path, help="what the scripted model answers (see scripted.py)"
    )
    parser.add_argument(
        "--faults",
        type=_faults,
        help="faults set at every start, a JSON object as /admin/fail takes them",
    )
    rot = parser.add_argument_group("rot (a server that degrades without dying; 0: off)")
    rot.add_argument(
        "--decode-halflife",
        type=float,
        default=0.0,
        metavar="S",
        help="decode tokens/s halves every S seconds of the server's age",
    )
    rot.add_argument(
        "--decode-floor",
        type=float,
        default=0.0,
        metavar="R",
        help="... but never below R tokens/s",
    )
    rot.add_argument(
        "--leak-kb-per-request",
        type=int,
        default=0,
        metavar="K",
        help="each generation keeps K KiB of resident memory",
    )
    rot.add_argument(
        "--memory-limit-mb",
        type=float,
        default=0.0,
        metavar="M",
        help="past M MiB resident: SIGKILL itself, as the OOM killer",
    )
    rot.add_argument(
        "--preemptions-per-request",
        type=int,
        default=0,
        metavar="N",
        help="each generation counts N preemptions",
    )
    args = parser.parse_args(argv)
    options = Options(
        port=args.port,
        state_dir=args.state_dir,
        model=args.model,
        log=args.log or args.state_dir / "server.log",
        stats_interval=args.stats_interval,
        tokens_per_second=args.tokens_per_second,
        max_num_seqs=args.max_num_seqs,
        execute_model_timeout=args.execute_model_timeout,
        shutdown_delay=args.shutdown_delay,
        script=args.script,
        batch_curve=args.batch_curve,
        faults=args.faults,
        rot=RotSettings(
            decode_halflife=args.decode_halflife,
            decode_floor=args.decode_floor,
            leak_kb_per_request=args.leak_kb_per_request,
            memory_limit_mb=args.memory_limit_mb,
            preemptions_per_request=args.preemptions_per_request,
        ),
    )
    return serve(options)


if __name__ == "__main__":
    raise SystemExit(main())
