"""The stand-in's engine: a scheduler that generates tokens at a rate, as vLLM's EngineCore does.

What ralph-run must tell apart is visible only in an engine's timing: a busy engine (requests
queued behind `--max-num-seqs`, long generations) keeps its token counters moving; a hung one
keeps its gauges and freezes its counters while every generation waits. So this engine has a
waiting line and a running batch, one thread that steps them (each running sequence gets its
tokens per step), and statistics published only by that thread, at each step, as vLLM's
EngineCore publishes them: when it stops, /metrics shows the last values, as vLLM's does.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field, replace

from ralph_runner.standin.batching import BatchCurve
from ralph_runner.standin.scripted import Reply, ToolCall

CHARS_PER_TOKEN = 4
BLOCK_TOKENS = 16
KV_CACHE_TOKENS = 32768
MIN_STEP_SECONDS = 0.01  # above 100 tokens/s a step generates several tokens per sequence


def tokens_of(chars: int) -> int:
    return math.ceil(chars / CHARS_PER_TOKEN)


def pieces_of(text: str) -> list[str]:
    """Text cut into token-sized pieces: what one generated token adds."""
    return [text[i : i + CHARS_PER_TOKEN] for i in range(0, len(text), CHARS_PER_TOKEN)]


@dataclass(frozen=True)
class Piece:
    """One generated token: a piece of text, or of tool call `call` (its first piece opens it)."""

    text: str
    call: int | None = None
    opens: ToolCall | None = None


def plan_of(reply: Reply, max_tokens: int, filler_tokens: int = 0) -> tuple[list[Piece], str]:
    """The tokens a reply takes, cut at `max_tokens`, and the finish reason vLLM would give.

    `filler_tokens`: generate at least this many (vLLM's `ignore_eos`/`min_tokens`): the text
    goes on with filler words, as a model that does not stop.
    """
    plan = [Piece(p) for p in pieces_of(reply.text)]
    for index, call in enumerate(reply.tool_calls):
        plan.append(Piece("", index, call))
        plan += [Piece(p, index) for p in pieces_of(call.arguments)]
    while len(plan) < filler_tokens and not reply.tool_calls:
        plan.append(Piece(" ok "))
    if len(plan) >= max_tokens:
        return plan[:max_tokens], "tool_calls" if reply.tool_calls else "length"
    return plan, "tool_calls" if reply.tool_calls else "stop"


class EngineDead(Exception):
    """The engine has died: every generation, the ones in flight included, fails with this."""


@dataclass(eq=False)
class Sequence:
    """One request in the engine: its prompt, the tokens it will generate, how far it has got."""

    prompt_tokens: int
    plan: list[Piece]
    finish_reason: str
    produced: int = 0
    done: bool = False
    aborted: bool = False
    prefilled: float = 0.0  # prompt tokens in the KV cache so far (chunked prefill)
    admitted: float = 0.0  # when the engine took it (monotonic): its prefill starts
    submitted: float = field(default_factory=time.monotonic)  # arrival: time to first token
    last_token: float = 0.0  # when its last tokens were made (monotonic): inter-token latency

    @property
    def kv_blocks(self) -> int:
        return math.ceil((min(self.prefilled, self.prompt_tokens) + self.produced) / BLOCK_TOKENS)


@dataclass
class Stats:
    """What the engine last published: /metrics and the stats log line read only this."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    finished: Counter[str] = field(default_factory=Counter)
    steps: int = 0  # engine steps that scheduled tokens (vllm:iteration_tokens_total's count)
    step_tokens: int = 0  # ... and their tokens (its sum)
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache (at admission)
    prefill_seconds: float = 0.0  # admission to the prompt read, summed (prefill_time's sum)
    prefills: int = 0  # ... over how many requests (its count)
    first_token_seconds: float = 0.0  # arrival to first token, summed (time_to_first_token)
    first_tokens: int = 0  # ... over how many requests
    inter_token_seconds: float = 0.0  # between a request's steps, summed (inter_token_latency)
    inter_tokens: int = 0  # ... over the tokens those steps made
    sleeping: bool = False  # vllm:engine_sleep_state


class Engine:
    """The waiting line, the running batch and the thread that steps them (the "EngineCore")."""

    def __init__(self, tokens_per_second: float, max_num_seqs: int) -> None:
        self.cond = threading.Condition()
        self.max_num_seqs = max_num_seqs
        self.set_rate(tokens_per_second)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.hung = False
        self.sleeping = False  # put to sleep (vLLM's sleep mode): serves nothing, as hung
        self.prefill_rate: float | None = None  # prompt tokens/s (chunked prefill); None: at once
        # Prompt tokens one step reads (vLLM's --max-num-batched-tokens), with prefill_rate: such
        # a step lasts chunk / rate s and publishes when it ends, as vLLM's; None: every step
        # lasts step_seconds and reads rate x step_seconds.
        self.prefill_chunk: int | None = None
        self.dead: str | None = None  # the error message, once dead
        # A GPU's step lengthens with the batch (batching.py); None: every step lasts the same.
        self.batch_curve: BatchCurve | None = None
        self._batch = 0  # sequences the last step generated for
        self._credit = 0.0
        self._step_started = time.monotonic()  # the step under way began (its admissions')
        self._totals = Stats()
        self.stats = Stats()  # published
        threading.Thread(target=self._run, name="EngineCore", daemon=True).start()

    def set_rate(self, tokens_per_second: float) -> None:
        """Tokens per second per running sequence (vLLM: one token per sequence per step)."""
        self.step_seconds = max(1.0 / tokens_per_second, MIN_STEP_SECONDS)
        self.tokens_per_step = tokens_per_second * self.step_seconds

    # what the API server calls

    def submit(self, sequence: Sequence) -> None:
        with self.cond:
            if self.dead:
                raise EngineDead(self.dead)
            self.waiting.append(sequence)
            self.cond.notify_all()

    def progress(self, sequence: Sequence, seen: int) -> tuple[list[Piece], bool]:
        """Blocks until `sequence` has tokens past `seen` or is done; the new ones, and done.

        Raises EngineDead when the engine dies meanwhile; blocks for ever while it hangs.
        """
        with self.cond:
            while not self.dead and sequence.produced <= seen and not sequence.done:
                self.cond.wait()
            if self.dead:
                raise EngineDead(self.dead)
            return sequence.plan[seen : sequence.produced], sequence.done

    def collect(self, sequence: Sequence) -> list[Piece]:
        """Blocks until `sequence` is done; all its tokens (EngineDead as `progress`)."""
        with self.cond:
            while not self.dead and not sequence.done:
                self.cond.wait()
            if self.dead:
                raise EngineDead(self.dead)
            return sequence.plan

    def abort(self, sequence: Sequence) -> None:
        """The client went away: the next step drops it (never while the engine hangs)."""
        with self.cond:
            sequence.aborted = True
            self.cond.notify_all()

    def hang(self) -> None:
        with self.cond:
            self.hung = True

    def resume(self) -> None:
        with self.cond:
            self.hung = False
            self.cond.notify_all()

    def sleep(self, asleep: bool) -> None:
        """vLLM's sleep mode: the engine frees the GPU and schedules nothing until woken."""
        with self.cond:
            self.sleeping = asleep
            self.stats = replace(self.stats, sleeping=asleep)
            self.cond.notify_all()

    def preempt(self, count: int) -> None:
        """`count` preemptions (the KV cache thrashing): vllm:num_preemptions_total rises."""
        with self.cond:
            self._totals.preemptions += count
            self.stats = replace(self.stats, preemptions=self._totals.preemptions)

    def die(self, message: str) -> None:
        with self.cond:
            self.dead = message
            self.cond.notify_all()

    # the EngineCore thread

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.dead and (self.hung or self.sleeping or self._idle()):
                    self.cond.wait()
                if self.dead:
                    return
                lasts = self._chunk_seconds()
                self._step_started = time.monotonic()
            if lasts is not None:  # a long step: nothing is published until it ends
                time.sleep(lasts)
            with self.cond:
                if self.dead or self.hung or self.sleeping:
                    continue  # it stopped mid-step: the step's work is never published
                self._step()
                self.cond.notify_all()
                lasts = self.step_seconds * self._stretch()
            time.sleep(lasts)

    def _stretch(self) -> float:
        """How much longer the last step took than one of a single sequence (batch_curve)."""
        curve = self.batch_curve
        return 1.0 if curve is None or self._batch <= 1 else curve.stretch(self._batch)

    def _chunk_seconds(self) -> float | None:
        """How long the next step lasts when it reads a prompt chunk (prefill_chunk set)."""
        if self.prefill_chunk is None or not self.prefill_rate:
            return None
        admitted = list(self.running) + list(self.waiting)[: self.max_num_seqs - len(self.running)]
        reading = [s for s in admitted if s.prefilled < s.prompt_tokens]
        if not reading:
            return None
        tokens = min(self.prefill_chunk, reading[0].prompt_tokens - reading[0].prefilled)
        return tokens / self.prefill_rate

    def _prefilled(self, sequence: Sequence) -> None:
        """Its prompt is read: the time since it was admitted joins the prefill histogram."""
        self._totals.prefill_seconds += time.monotonic() - sequence.admitted
        self._totals.prefills += 1

    def _timed(self, sequence: Sequence, made: int) -> None:
        """vLLM's latency histograms: a request's first token, then per token of each step."""
        if not made:
            return
        now, totals = time.monotonic(), self._totals
        if sequence.produced == 0:
            totals.first_token_seconds += now - sequence.submitted
            totals.first_tokens += 1
        else:
            totals.inter_token_seconds += now - sequence.last_token
            totals.inter_tokens += made
        sequence.last_token = now

    def _idle(self) -> bool:
        return not (self.waiting or self.running)

    def _step(self) -> None:
        """One engine step: admit waiting requests into the batch, a token for each, publish."""
        totals = self._totals
        for queue in (self.waiting, self.running):
            for sequence in [s for s in queue if s.aborted]:
                queue.remove(sequence)
                totals.finished["abort"] += 1
        while self.waiting and len(self.running) < self.max_num_seqs:
            sequence = self.waiting.popleft()
            self.running.append(sequence)
            sequence.admitted = self._step_started
            totals.prefix_queries += sequence.prompt_tokens
            if self.prefill_rate is None:
                sequence.prefilled = sequence.prompt_tokens
                totals.prompt_tokens += sequence.prompt_tokens  # prefill
                self._prefilled(sequence)
        self._credit += self.tokens_per_step
        tokens, self._credit = int(self._credit), self._credit - int(self._credit)
        scheduled = 0
        self._batch = len(self.running)
        for sequence in list(self.running):
            if sequence.prefilled < sequence.prompt_tokens:  # a chunk of a long prompt
                chunk = (self.prefill_rate or math.inf) * self.step_seconds
                if self.prefill_chunk is not None and self.prefill_rate:
                    chunk = self.prefill_chunk
                sequence.prefilled = min(sequence.prompt_tokens, sequence.prefilled + chunk)
                if sequence.prefilled < sequence.prompt_tokens:
                    continue  # as vLLM 0.32 (measured): no counter moves until the prompt is read
                totals.prompt_tokens += sequence.prompt_tokens
                self._prefilled(sequence)
                scheduled += sequence.prompt_tokens
            made = min(tokens, len(sequence.plan) - sequence.produced)
            self._timed(sequence, made)
            scheduled += made
            sequence.produced += made
            totals.generation_tokens += made
            if sequence.produced >= len(sequence.plan):
                sequence.done = True
                self.running.remove(sequence)
                totals.finished[sequence.finish_reason] += 1
        if scheduled:
            totals.steps += 1
            totals.step_tokens += scheduled
        blocks = sum(s.kv_blocks for s in self.running)
        self.stats = Stats(
            running=len(self.running),
            waiting=len(self.waiting),
            kv_cache_usage=min(1.0, blocks * BLOCK_TOKENS / KV_CACHE_TOKENS),
            prompt_tokens=totals.prompt_tokens,
            generation_tokens=totals.generation_tokens,
            preemptions=totals.preemptions,
            finished=Counter(totals.finished),
            steps=totals.steps,
            step_tokens=totals.step_tokens,
            prefix_queries=totals.prefix_queries,
            sleeping=self.sleeping,
            prefill_seconds=totals.prefill_seconds,
            prefills=totals.prefills,
            first_token_seconds=totals.first_token_seconds,
            first_tokens=totals.first_tokens,
            inter_token_seconds=totals.inter_token_seconds,
            inter_tokens=totals.inter_tokens,
        )
