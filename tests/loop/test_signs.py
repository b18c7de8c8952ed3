"""The signs of a rotting server (loop/signs.py), fed scrapes as a server would give them:
when each sign fires, and what never fires (an idle server, a warm-up, a new server). The
same signs on a real stand-in and a real loop: tests/loop/test_rejuvenation.py."""

from __future__ import annotations

from ralph_runner.loop.signs import MIB, Scrape, Signs, Thresholds, parse
from ralph_runner.standin.engine import Stats
from ralph_runner.standin.metrics import exposition

LIMITS = Thresholds(
    decode_drop=0.3, sustained_for=60, warmup=30, baseline=60, window=30, min_tokens=100
)


class Server:
    """A server's counters, advanced look by look: `rate` decode tokens/s while busy."""

    def __init__(self, started: float = 1000.0) -> None:
        self.at, self.started = 0.0, started
        self.itl_sum = self.itl_count = self.ttft_sum = self.ttft_count = 0.0
        self.preemptions, self.rss = 0.0, 500 * MIB

    def advance(self, seconds: float, rate: float, ttft: float = 0.1, leak_mb: float = 0) -> Scrape:
        self.at += seconds
        if rate:
            self.itl_count += rate * seconds
            self.itl_sum += seconds
            self.ttft_sum += ttft * seconds
            self.ttft_count += seconds
        self.rss += leak_mb * MIB
        return self.scrape()

    def scrape(self) -> Scrape:
        return Scrape(
            at=self.at,
            inter_token_seconds=self.itl_sum,
            inter_tokens=self.itl_count,
            first_token_seconds=self.ttft_sum,
            first_tokens=self.ttft_count,
            preemptions=self.preemptions,
            resident_bytes=self.rss,
            started=self.started,
        )


def run(signs: Signs, server: Server, seconds: float, every: float = 5, **how: float) -> list:
    """Looks every `every` s for `seconds`; the first findings (or [])."""
    for _ in range(int(seconds / every)):
        found = signs.look(server.advance(every, **how))  # type: ignore[arg-type]
        if found:
            return found
    return []


def test_a_decode_drop_fires_after_it_held_for_sustained_for() -> None:
    signs, server = Signs(LIMITS), Server()
    assert run(signs, server, 120, rate=80) == []
    assert signs.decode_baseline is not None and abs(signs.decode_baseline - 80) < 1e-6
    assert run(signs, server, 55, rate=50) == []  # 37% down, not yet for 60 s
    found = run(signs, server, 30, rate=50)
    assert [f.sign for f in found] == ["decode_drop"]
    assert found[0].baseline == 80 and abs(found[0].now - 50) < 1e-6
    assert "below its baseline 80.0" in found[0].text


def test_a_drop_under_the_threshold_never_fires() -> None:
    signs, server = Signs(LIMITS), Server()
    run(signs, server, 120, rate=80)
    assert run(signs, server, 600, rate=60) == []  # 25% down: under 30%


def test_a_recovery_of_speed_ends_the_breach() -> None:
    signs, server = Signs(LIMITS), Server()
    run(signs, server, 120, rate=80)
    run(signs, server, 40, rate=40)
    assert "decode_drop" in signs.breaches
    run(signs, server, 40, rate=80)
    assert "decode_drop" not in signs.breaches
    assert run(signs, server, 40, rate=40) == []  # a new breach counts from its own start


def test_an_idle_server_says_nothing() -> None:
    """No tokens in the window: no reading, no breach begun or ended."""
    signs, server = Signs(LIMITS), Server()
    run(signs, server, 120, rate=80)
    assert run(signs, server, 600, rate=0) == []
    assert signs.reading.decode is None and signs.breaches == {}


def test_the_warmup_is_not_the_baseline() -> None:
    """A server slow at its start (its caches cold) does not set a low baseline."""
    signs, server = Signs(LIMITS), Server()
    run(signs, server, 25, rate=20)
    run(signs, server, 95, rate=80)
    assert signs.decode_baseline is not None and signs.decode_baseline > 70


def test_a_new_server_starts_the_signs_over() -> None:
    signs, server = Signs(LIMITS), Server()
    run(signs, server, 120, rate=80)
    run(signs, server, 40, rate=40)
    fresh = Server(started=2000.0)
    fresh.at = server.at
    signs.look(fresh.advance(5, rate=40))
    assert signs.decode_baseline is None and signs.breaches == {}


def test_a_memory_slope_that_reaches_the_limit_within_the_horizon_fires() -> None:
    limits = Thresholds(memory_limit_mb=2000, memory_horizon=600, sustained_for=20, warmup=10)
    signs, server = Signs(limits), Server()
    assert run(signs, server, 60, rate=50, leak_mb=1) == []  # 12 MiB/min: 2 h to the limit
    found = run(signs, server, 300, rate=50, leak_mb=20)  # 240 MiB/min: minutes
    assert [f.sign for f in found] == ["memory"]
    assert found[0].baseline == 2000 and "MiB/h" in found[0].text


def test_flat_memory_never_fires() -> None:
    limits = Thresholds(memory_limit_mb=600, memory_horizon=7200, sustained_for=20, warmup=10)
    assert run(Signs(limits), Server(), 3600, rate=50, leak_mb=0) == []


def test_preemptions_over_the_rate_fire() -> None:
    limits = Thresholds(preemptions_per_minute=10, sustained_for=20, warmup=10, window=30)
    signs, server = Signs(limits), Server()
    assert run(signs, server, 60, rate=50) == []
    found: list = []
    for _ in range(20):
        server.preemptions += 5  # every 5 s: 60 a minute
        found = signs.look(server.advance(5, rate=50))
        if found:
            break
    assert [f.sign for f in found] == ["preemptions"]


def test_first_token_rise_fires_on_the_mean_not_one_request() -> None:
    limits = Thresholds(first_token_rise=1.0, sustained_for=30, warmup=10, baseline=30,
                        window=30, min_tokens=10)  # fmt: skip
    signs, server = Signs(limits), Server()
    run(signs, server, 60, rate=50, ttft=0.2)
    assert run(signs, server, 60, rate=50, ttft=0.3) == []  # 1.5x: under 2x
    assert [f.sign for f in run(signs, server, 120, rate=50, ttft=0.5)] == ["first_token_rise"]


def test_the_stand_ins_metrics_parse_into_a_scrape() -> None:
    stats = Stats(preemptions=3)
    stats.inter_token_seconds, stats.inter_tokens = 2.5, 100
    stats.first_token_seconds, stats.first_tokens = 0.75, 3
    scrape = parse(exposition(stats, "m", 1234.5, 99 * MIB), at=7.0)
    assert scrape == Scrape(7.0, 2.5, 100, 0.75, 3, 3, 99 * MIB, 1234.5)
