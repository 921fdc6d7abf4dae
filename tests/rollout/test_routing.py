"""The routing core (rollout/routing.py): least-loaded placement of new groups, sticky later turns within the
overload bound, restart invalidation, and the load metrics."""

from __future__ import annotations

from grpo_cli.rollout.routing import (CacheMeter, Router, fill, least_loaded, overloaded, prefix_cache_counters,
                                     runs)


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


EXPOSITION = """# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 60.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 40.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 20.0
vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e9
"""


def test_prefix_cache_hit_rate_from_vllm_counters_between_readings():
    assert prefix_cache_counters(EXPOSITION) == (160.0, 60.0)
    assert prefix_cache_counters("# a server without them\nother_total 3\n") is None
    meter = CacheMeter(2)
    assert meter.take_metrics([(160.0, 60.0), None]) == {"rollout/prefix_cache_hit_rate/0": 60 / 160,
                                                         "rollout/prefix_cache_hit_rate": 60 / 160}
    # since the last reading: 40 tokens looked up, 30 found; server 1 reports for the first time
    m = meter.take_metrics([(200.0, 90.0), (10.0, 5.0)])
    assert m["rollout/prefix_cache_hit_rate/0"] == 0.75 and m["rollout/prefix_cache_hit_rate/1"] == 0.5
    assert m["rollout/prefix_cache_hit_rate"] == 35 / 50
    # server 0 restarted (its counter went down): counted from 0
    assert meter.take_metrics([(8.0, 2.0), (10.0, 5.0)]) == {"rollout/prefix_cache_hit_rate/0": 0.25,
                                                              "rollout/prefix_cache_hit_rate": 0.25}
