"""The stand-in's faults: what each imitates of vLLM 0.32, what it does, and their settings.

FAULTS (set at any time, without restarting, through `POST /admin/fail` or the control file
`STATE_DIR/control.json`, read, applied and removed on every request and every stats tick;
both take `{KEY: VALUE, ...}`, `/admin/fail` also `{"mode": KEY, "value": V}`; a fault lasts
until the process ends or it is set to false; a restarted server starts healthy):

key (value)            imitates (vLLM 0.32)     what the stand-in does
---------------------- ------------------------ ----------------------------------------------------
engine_death           kill -9 of               logs MPClient `engine core exited unexpectedly`,
                       VLLM::EngineCore         `AsyncLLM output_handler failed`, EngineDeadError;
                                                generation (in flight too) answers 500 `{"error":
                                                {"message": "EngineCore encountered an issue. See
                                                stack trace (above) for the root cause.", ...}}`; a
                                                chat/completions stream in flight gets that error as
                                                a data frame, then `data: [DONE]`; a responses
                                                stream is cut (no last chunk); /health, /v1/models
                                                and /metrics answer 200 for --shutdown-delay (0.3
                                                s), then `Shutting down`, exit 0
die_on_prompt_chars N  the seed's KV-cache      a generation whose prompt has more than N
                       AssertionError           characters: AssertionError lines, then as
                                                engine_death
engine_hang            SIGSTOP of               /health, /v1/models, /metrics 200; gauges keep their
                       VLLM::EngineCore (vLLM   last values, counters freeze; generation blocks for
                       #39863)                  ever, streams in flight just stop (connection open);
                                                nothing logged
worker_timeout [S]     SIGSTOP of VLLM::Worker  as engine_hang; after S s (true: --execute-model-
                                                timeout, 300) `TimeoutError: RPC call to
                                                execute_model timed out.`, then as engine_death
resume                 SIGCONT                  the hang ends: what waited goes on at once
busy N                 load, not a fault        every generation makes at least N tokens (as a
                                                request's `ignore_eos` or `min_tokens`): with --max-
                                                num-seqs and --tokens-per-second, a full batch, a
                                                waiting line, counters moving
tokens_per_second R    a slower or faster       R tokens/s per sequence from now (with batch_curve:
                       engine                   of a sequence alone)
batch_curve C          a GPU's batching: its    each step lasts step(batch) / step(1) times a lone
                       decode step lengthens    sequence's, by the curve C (`h100-llama8b`,
                       with the batch           measured, or `BATCH:MS,...`; batching.py): the
                                                total tokens/s rises with concurrency, then
                                                flattens (true: the shipped curve; false: off)
prefill_tokens_per_    a long prompt read in    prompts are prefilled at R tokens/s from now (false:
second R               chunks                   at once): the KV-cache gauge grows each step, no
                                                token counter moves until the prompt is read
prefill_chunk N        vLLM's chunked prefill   with prefill_tokens_per_second: a step reads N
                       (--max-num-batched-      prompt tokens and lasts N / R s; its gauges and
                       tokens)                  counters are published when it ends (a long first
                                                step looks idle), as vLLM's
sleep                  POST /sleep (sleep mode) vllm:engine_sleep_state 1, generation waits (as
                                                engine_hang) until `sleep: false`
die                    (the stand-in's first    the request answers 500, exit 0 at once
                       death)
die_at_request N       (as die)                 on the N-th API request from now (admin requests do
                                                not count)
die_at_generation N    an engine that dies      the N-th generation from now kills the engine (as
                       whatever the prompt      die_on_prompt_chars, whatever its prompt)
hang                   a wedged API server      every endpoint, /health too, never answers (until
                                                resume)
dead_503               a dead engine behind an  every API route answers 503, the process stays up
                       API server that stays up
slow_once S            one slow answer          the next API request answers after S s
rate_limit S           a provider's limit (a    every generation answers 429 with `retry-after` (the
                       proxy before vLLM, or    seconds left) for the next S s: /v1/messages in
                       Anthropic's API)         Anthropic's shape (`rate_limit_error`), the others
                                                in vLLM's (`{"error": {..., "code": 429}}`)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict, cast

from ralph_runner.standin.batching import parse_curve

FAULTS: dict[str, tuple[type, str]] = {  # key -> (value type, one line; the table above says more)
    "engine_death": (bool, "EngineCore dies: 500s, /health 200 for a moment, exit 0"),
    "die_on_prompt_chars": (int, "a generation with a prompt over N characters kills the engine"),
    "engine_hang": (bool, "EngineCore stops: health/models/metrics 200, generation blocks"),
    "worker_timeout": (float, "a hang that kills the engine after S s (true: the option)"),
    "resume": (bool, "the hang ends: what waited goes on"),
    "busy": (int, "every generation makes at least N tokens"),
    "tokens_per_second": (float, "the engine's speed from now, per sequence"),
    "batch_curve": (str, "steps lengthen with the batch by this curve (name or BATCH:MS,...)"),
    "prefill_tokens_per_second": (float, "prompts are read in chunks at R tokens/s"),
    "prefill_chunk": (int, "a step reads N prompt tokens, N / R s long, published at its end"),
    "sleep": (bool, "the engine sleeps (sleep mode): engine_sleep_state 1, nothing served"),
    "die": (bool, "die at once: the request answers 500, the process exits 0"),
    "die_at_request": (int, "as die, on the N-th API request from now"),
    "die_at_generation": (int, "the N-th generation from now kills the engine, any prompt"),
    "hang": (bool, "accept connections but never answer an API request, /health included"),
    "dead_503": (bool, "the engine is dead: every API route answers 503, the process stays up"),
    "slow_once": (float, "the next API request answers after this many seconds"),
    "rate_limit": (float, "generations answer 429 rate_limit_error with retry-after for S s"),
}


class FaultSettings(TypedDict, total=False):
    """Faults to apply, checked and converted (`parse_faults`): FAULTS' keys and types; any of
    them may be false (off), and `worker_timeout: true` means `--execute-model-timeout`."""

    engine_death: bool
    die_on_prompt_chars: int
    engine_hang: bool
    worker_timeout: float | bool
    resume: bool
    busy: int
    tokens_per_second: float
    batch_curve: str | bool
    prefill_tokens_per_second: float
    prefill_chunk: int
    sleep: bool
    die: bool
    die_at_request: int
    die_at_generation: int
    hang: bool
    dead_503: bool
    slow_once: float
    rate_limit: float


@dataclass
class Faults:
    """The API server's own faults (the engine's are in the engine); changed under a lock."""

    die_now: bool = False
    die_countdown: int = 0  # 0 = off
    die_on_prompt_chars: int = 0  # 0 = off
    generations_to_death: int = 0  # die_at_generation's countdown; 0 = off
    hang: bool = False
    dead: bool = False
    slow_once: float = 0.0
    rate_limited_until: float = 0.0  # time.monotonic() until which generations answer 429
    busy: int = 0


def parse_faults(settings: object) -> FaultSettings:
    """Checks and converts a fault object (`{KEY: VALUE, ...}` or `{"mode": KEY, "value": V}`);
    raises ValueError naming what is wrong."""
    if not isinstance(settings, dict):
        raise ValueError("expected a JSON object")
    if "mode" in settings:
        settings = {settings["mode"]: settings.get("value", True)}
    unknown = sorted(set(settings) - set(FAULTS))
    if unknown:
        raise ValueError(
            f"unknown fault {', '.join(map(str, unknown))}; known: {', '.join(FAULTS)}"
        )
    try:
        converted = {key: convert(key, value) for key, value in settings.items()}
    except (TypeError, ValueError) as error:
        raise ValueError(f"bad fault value: {error}") from None
    return cast(FaultSettings, converted)  # every key known, every value of its type: checked


def convert(key: str, value: object) -> bool | int | float | str:
    """`value` as FAULTS says `key` takes it; a boolean stays one (false: off; worker_timeout's
    true: the option's seconds)."""
    kind = FAULTS[key][0]
    if kind is bool or isinstance(value, bool):
        return bool(value)
    converted: int | float | str = kind(value)
    if key == "batch_curve":
        parse_curve(str(converted))  # a bad curve is refused here, not in the engine
    return converted
