"""The routing core (rollout/routing.py): least-loaded placement of new groups, sticky later turns within the
overload bound, restart invalidation, and the load metrics."""

from __future__ import annotations

from grpo_cli.rollout.routing import Router, fill, least_loaded, overloaded, runs


def test_least_loaded_and_fill_follow_load_not_turns():
    assert least_loaded([3, 1, 1]) == 1
    # a busy server gets nothing until the others catch up; groups on one server come out contiguous
    assert fill([8, 0, 0], 4, 2) == [1, 1, 2, 2]
    assert fill([0, 0, 0], 3, 2) == [0, 1, 2]
    assert fill([0, 5], 3, 2) == [0, 0, 0]
    assert runs([1, 1, 2, 0, 0]) == [(1, slice(0, 2)), (2, slice(2, 3)), (0, slice(3, 5))]
    assert runs([]) == []


def test_later_turns_stick_then_move_when_overloaded_or_restarted():
    r = Router(3, max_excess=2)
    first = r.place_new([("c", 0), ("c", 1), ("c", 2)], 1)
    assert first == [0, 1, 2]
    for s in first:
        r.done(s, 1)
    # the turns go where their first turn went, in any order
    assert r.place_turns([("c", 2), ("c", 0), ("c", 1)], 1) == [2, 0, 1]
    assert r.place_new([("d", 0)], 3) == [0]  # loads [4, 1, 1]
    assert overloaded(r.loads, 0, max_excess=2) and not overloaded(r.loads, 0, max_excess=3)
    # server 0 holds 3 more than the least loaded, past the bound: group 0's turn leaves it for the least loaded...
    assert r.place_turns([("c", 0)], 1) == [1]
    # ... and sticks to its new server afterwards (loads [4, 2, 1]: within the bound)
    assert r.place_turns([("c", 0)], 1) == [1]
    r.forget(1)  # server 1 restarted: what stuck to it is placed by load again
    assert r.place_turns([("c", 0)], 1) == [2]
    assert r.take_metrics()["rollout/sticky_kept"] == 4 / 6
    # an unknown trajectory (first turn never seen) goes by load and counts as neither
    assert r.place_turns([("zz", 0)], 1) == [least_loaded([4, 3, 2])] == [2]


def test_restart_drops_stickiness_and_metrics_report_peaks():
    r = Router(2, max_excess=100)
    r.place_new([("a", 0)], 4)  # server 0
    r.place_new([("b", 0)], 1)  # server 1 (least loaded)
    assert r.place_turns([("a", 0)], 1) == [0]  # load 5 vs 1: within the bound, stays
    r.forget(0)
    assert r.place_turns([("a", 0)], 1) == [1]  # its server restarted: by load
    m = r.take_metrics()
    assert m["rollout/server_load/0"] == 5.0 and m["rollout/server_load/1"] == 2.0
    assert m["rollout/server_load/max"] == 5.0 and m["rollout/server_load/mean"] == 3.5
    assert m["rollout/sticky_kept"] == 0.5
    for s, w in ((0, 4), (1, 1), (0, 1), (1, 1)):
        r.done(s, w)
    assert r.loads == [0, 0]
    # peaks start afresh from what was in flight at the take (5 then), then from nothing
    assert r.take_metrics()["rollout/server_load/max"] == 5.0
    assert r.take_metrics()["rollout/server_load/max"] == 0.0
