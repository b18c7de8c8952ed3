"""`workers: auto`'s rules (loop/governor.Policy), fed looks at a server's numbers: when it
admits, when it sheds, and what it will not do. The governor's thread and a real server:
tests/loop/test_governor.py."""

from __future__ import annotations

from ralph_runner.loop.governor import RECALL, Look, Policy


def policy(max_workers: int = 8) -> Policy:
    return Policy(max_workers=max_workers, kv_cache_max=0.9, settle=10.0)


def look(at: float, waiting: float = 0, kv: float | None = 0.2, pre: float | None = 0) -> Look:
    return Look(at=at, waiting=waiting, kv_cache=kv, preemptions=pre)


def calm(p: Policy, start: float, until: float, busy: int | None = None) -> list[int]:
    """Looks every 5 s with headroom, every admitted worker busy (or `busy`): the levels."""
    levels = []
    t = start
    while t <= until:
        decision = p.look(look(t), p.admitted if busy is None else busy)
        if decision is not None:
            levels.append(decision.workers)
        t += 5
    return levels


def test_headroom_doubles_the_workers_up_to_the_bound() -> None:
    p = policy(max_workers=6)
    assert calm(p, 0, 100) == [2, 4, 6]


def test_nothing_is_admitted_while_an_admitted_worker_is_idle() -> None:
    p = policy()
    assert calm(p, 0, 100, busy=0) == []
    assert p.admitted == 1


def test_a_level_is_held_for_settle_seconds_of_headroom_first() -> None:
    p = policy()
    assert p.look(look(0), 1) is None  # headroom from now
    assert p.look(look(9.9), 1) is None
    decision = p.look(look(10), 1)
    assert decision is not None and (decision.was, decision.workers) == (1, 2)
    assert "nothing waiting" in decision.reason
    assert p.look(look(15), 2) is None  # the new level must settle too
    assert p.look(look(20), 2) is not None


def test_one_look_with_requests_waiting_is_a_moment_two_shed_one() -> None:
    p = policy()
    calm(p, 0, 20)  # 2 at 10 s, 4 at 20 s
    assert p.admitted == 4
    assert p.look(look(40, waiting=3), 4) is None
    shed = p.look(look(45, waiting=2), 4)
    assert shed is not None and (shed.was, shed.workers) == (4, 3)
    assert "waiting" in shed.reason


def test_waiting_interrupts_the_headroom_that_admits() -> None:
    p = policy()
    assert p.look(look(0), 1) is None
    assert p.look(look(5, waiting=1), 1) is None
    assert p.look(look(10), 1) is None  # headroom again from 10
    assert p.look(look(19), 1) is None
    assert p.look(look(20), 1) is not None


def test_preemptions_that_rose_shed_one_then_it_grows_one_at_a_time() -> None:
    p = policy()
    calm(p, 0, 20)
    assert p.admitted == 4
    shed = p.look(look(35, pre=2), 4)
    assert shed is not None and shed.workers == 3 and "preemptions rose by 2" in shed.reason
    assert p.look(look(40, pre=2), 3) is None  # the counter stays: no new preemption
    assert calm(p, 45, 60) == [], "4 was shed from: barred for RECALL s"
    assert p.admitted == 3


def test_a_barred_level_comes_back_after_recall() -> None:
    p = policy()
    calm(p, 0, 20)
    p.look(look(35, pre=1), 4)
    assert p.admitted == 3
    assert calm(p, 40, 35 + RECALL - 5) == []
    assert calm(p, 35 + RECALL, 35 + RECALL + 5) == [4], "additive after a shed, not doubling"


def test_the_kv_cache_at_its_bound_sheds_one() -> None:
    p = policy()
    calm(p, 0, 15)
    assert p.admitted == 2
    shed = p.look(look(20, kv=0.95), 2)
    assert shed is not None and shed.workers == 1 and "KV cache at 95%" in shed.reason


def test_never_below_one_worker() -> None:
    p = policy()
    assert p.shed(0, "a death") is None
    assert p.look(look(5, waiting=4), 1) is None
    assert p.look(look(10, waiting=4), 1) is None
    assert p.admitted == 1


def test_a_server_without_kv_or_preemption_numbers_is_judged_by_its_queue() -> None:
    p = policy(max_workers=4)
    levels = []
    for t in range(0, 40, 5):
        if (d := p.look(look(t, kv=None, pre=None), p.admitted)) is not None:
            levels.append(d.workers)
    assert levels == [2, 4]
    assert p.look(look(45, waiting=1, kv=None, pre=None), 4) is None
    assert p.look(look(50, waiting=1, kv=None, pre=None), 4) is not None
