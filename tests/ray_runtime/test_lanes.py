"""ray_runtime/lanes.py on its own: the turns, the spacing that keeps a lane's step from
running right behind its own, and the shares."""
from types import SimpleNamespace as R

from ray_runtime.lanes import LaneTurns


def test_turns_go_round_and_skip_a_lane_just_planned_while_others_run():
    t = LaneTurns(4, max_num_seqs=16)
    running = [R(lane=k, num_inflight_steps=1) for k in range(4)]
    assert list(t.candidates(running)) == [0, 1, 2, 3]
    t.planned(0)
    assert list(t.candidates(running)) == [1, 2, 3]  # 0 is the latest plan, 3 others run
    t.planned(1), t.planned(2)
    assert list(t.candidates(running)) == [3]  # 0, 1, 2 are the latest three
    t.planned(3)
    assert list(t.candidates(running)) == [0]


def test_spacing_counts_only_lanes_that_run_and_vanishes_with_nothing_in_flight():
    t = LaneTurns(4, max_num_seqs=16)
    t.planned(2)
    only_two = [R(lane=2, num_inflight_steps=1), R(lane=3, num_inflight_steps=1)]
    assert list(t.candidates(only_two)) == [3, 0, 1]  # 2 must wait for one other plan
    t.planned(3)
    assert list(t.candidates(only_two)) == [0, 1, 2]  # one plan (3) since 2's: its turn again
    alone = [R(lane=3, num_inflight_steps=1)]
    assert 3 in list(t.candidates(alone)), "a lane alone runs back to back"
    idle = [R(lane=k, num_inflight_steps=0) for k in range(4)]
    assert list(t.candidates(idle)) == [0, 1, 2, 3], "nothing in flight: nothing to wait behind"


def test_a_lane_s_share_is_of_what_can_run():
    t = LaneTurns(4, max_num_seqs=16)
    running = [R(lane=0, num_inflight_steps=0)] * 3
    assert t.share(0, running, num_waiting=100) == (3, 4)  # 16 can run: 4 a lane
    assert t.share(1, running, num_waiting=3) == (0, 2)  # 6 can run: 2 a lane
    assert t.max_lane_size == 4
