"""The rule that tells a death an item causes from one the server has (loop/blame.py)."""

from __future__ import annotations

from ralph_runner.loop.blame import Blame


def blame(after: int = 2) -> Blame:
    return Blame(after, {}, [])


def test_an_item_alone_in_flight_at_two_deaths_in_a_row_is_the_cause() -> None:
    rule = blame()
    first = rule.death(["poison"])
    assert first == {"in_flight": ["poison"], "item": "poison", "deaths": 1, "set_aside": False}
    assert not rule.guilty("poison") and rule.deaths_of("poison") == 1
    second = rule.death(["poison"])
    assert second is not None and second["set_aside"] and rule.guilty("poison")


def test_a_death_with_no_item_in_flight_starts_every_count_again() -> None:
    rule = blame()
    rule.death(["poison"])
    assert rule.death([]) is None  # the server died on its own (between items)
    rule.death(["poison"])
    assert not rule.guilty("poison") and rule.deaths_of("poison") == 1


def test_a_death_with_another_item_breaks_the_row() -> None:
    rule = blame()
    rule.death(["a"])
    rule.death(["b"])
    rule.death(["a"])
    assert not rule.guilty("a") and rule.deaths_of("a") == 1 and rule.deaths_of("b") == 0


def test_an_attempt_with_no_death_clears_its_item() -> None:
    rule = blame()
    rule.death(["a"])
    rule.cleared("a")
    rule.death(["a"])
    assert not rule.guilty("a")


def test_a_death_with_several_in_flight_blames_none_and_makes_them_suspects() -> None:
    rule = blame()
    said = rule.death(["a", "b", "c"])
    assert said == {"in_flight": ["a", "b", "c"], "item": None, "deaths": 0, "set_aside": False}
    assert rule.suspects == ["a", "b", "c"] and rule.counts == {}
    rule.cleared("a")  # ran alone, no death
    assert rule.suspects == ["b", "c"]
    rule.death(["b"])
    rule.death(["b"])
    assert rule.guilty("b")
    rule.set_aside("b")
    assert rule.suspects == ["c"] and rule.this_run == 1 and not rule.guilty("b")


def test_set_aside_after_0_never_sets_anything_aside() -> None:
    rule = blame(after=0)
    for _ in range(5):
        said = rule.death(["poison"])
        assert said is not None and not said["set_aside"]
    assert not rule.guilty("poison") and rule.deaths_of("poison") == 5
