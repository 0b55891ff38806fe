"""Liveness decisions with a fake clock: no sleeps, hours pass instantly."""

from common.clock import FakeClock
from daemon.liveness import LivenessTracker


def make(timeout_s: float = 5.0) -> tuple[FakeClock, LivenessTracker]:
    clock = FakeClock(start=100.0)
    return clock, LivenessTracker(clock, timeout_s)


def test_heartbeats_keep_a_node_alive_indefinitely() -> None:
    clock, tracker = make()
    tracker.connected("a")
    for _ in range(10_000):
        clock.advance(1.0)
        tracker.heard_from("a")
        assert tracker.overdue() == []


def test_silent_node_is_overdue_only_after_the_timeout() -> None:
    clock, tracker = make(timeout_s=5.0)
    tracker.connected("a")
    clock.advance(5.0)
    assert tracker.overdue() == []
    clock.advance(0.01)
    assert tracker.overdue() == ["a"]
    assert tracker.age("a") == 5.01 or abs(tracker.age("a") - 5.01) < 1e-9


def test_broken_session_gets_the_window_to_reconnect() -> None:
    clock, tracker = make(timeout_s=5.0)
    tracker.connected("a")
    clock.advance(1.0)
    tracker.disconnected("a")
    assert not tracker.is_connected("a")
    clock.advance(3.0)
    tracker.connected("a")  # came back within the window
    clock.advance(4.0)
    assert tracker.overdue() == []
    assert tracker.is_connected("a")


def test_broken_session_that_does_not_return_is_overdue() -> None:
    clock, tracker = make(timeout_s=5.0)
    tracker.connected("a")
    tracker.disconnected("a")
    clock.advance(5.5)
    assert tracker.overdue() == ["a"]


def test_new_leader_gives_known_nodes_one_window() -> None:
    clock, tracker = make(timeout_s=5.0)
    tracker.adopt(["a", "b"])
    clock.advance(4.0)
    tracker.connected("a")
    assert tracker.overdue() == []
    clock.advance(1.5)
    assert tracker.overdue() == ["b"]


def test_adopt_does_not_reset_a_node_already_heard() -> None:
    clock, tracker = make(timeout_s=5.0)
    tracker.connected("a")
    clock.advance(4.0)
    tracker.adopt(["a"])
    clock.advance(1.5)
    assert tracker.overdue() == ["a"]


def test_unknown_node_has_no_age() -> None:
    clock, tracker = make()
    assert tracker.age("ghost") is None
    assert not tracker.is_connected("ghost")


def test_broken_session_is_overdue_after_the_grace_not_the_timeout() -> None:
    clock = FakeClock(start=100.0)
    tracker = LivenessTracker(clock, timeout_s=5.0, grace_s=2.0)
    tracker.connected("a")
    tracker.connected("b")
    clock.advance(0.5)
    tracker.disconnected("a")
    clock.advance(2.0)
    tracker.heard_from("b")
    assert tracker.overdue() == []
    clock.advance(0.01)
    assert tracker.overdue() == ["a"]


def test_adopted_nodes_get_the_timeout_not_the_grace() -> None:
    clock = FakeClock(start=100.0)
    tracker = LivenessTracker(clock, timeout_s=5.0, grace_s=1.0)
    tracker.adopt(["a"])
    clock.advance(4.9)
    assert tracker.overdue() == []
    clock.advance(0.2)
    assert tracker.overdue() == ["a"]


def test_the_coordinators_own_stall_is_excused() -> None:
    clock, tracker = make(timeout_s=5.0)
    tracker.connected("a")
    tracker.connected("b")
    tracker.disconnected("b")  # 5 s to come back
    clock.advance(4.0)
    clock.advance(3.0)  # the coordinator's loop ran 3 s late: nothing was read in that time
    tracker.excuse(3.0)
    assert tracker.overdue() == []
    assert tracker.age("a") == 4.0
    clock.advance(1.01)  # the deadlines moved by the stall, no further
    assert tracker.overdue() == ["a", "b"]


def test_an_excuse_never_puts_last_seen_in_the_future() -> None:
    clock, tracker = make(timeout_s=5.0)
    tracker.connected("a")
    clock.advance(1.0)
    tracker.excuse(30.0)
    assert tracker.age("a") == 0.0
    clock.advance(5.01)
    assert tracker.overdue() == ["a"]


def test_the_coordinators_read_lag_extends_the_timeout_and_the_grace_while_it_lasts() -> None:
    clock = FakeClock(start=100.0)
    tracker = LivenessTracker(clock, timeout_s=5.0, grace_s=2.0)
    tracker.connected("silent")
    tracker.connected("broken")
    clock.advance(1.0)
    tracker.disconnected("broken")
    clock.advance(4.5)  # silent for 5.5 s, broken for 4.5 s
    assert tracker.overdue(read_lag_s=3.0) == []  # their heartbeats and Hellos may be waiting unread
    assert tracker.overdue(read_lag_s=0.0) == ["broken", "silent"]


def test_a_session_ended_before_its_welcome_was_confirmed_gets_the_agents_next_welcome_wait_as_well() -> None:
    """Its agent most likely gave up as it was welcomed, and its next Hello waits in the coordinator's queue:
    neither the grace nor the timeout ends it before that wait is over too."""
    clock = FakeClock(start=100.0)
    tracker = LivenessTracker(clock, timeout_s=5.0, grace_s=2.0)
    tracker.connected("unconfirmed")
    tracker.connected("confirmed")
    tracker.disconnected("unconfirmed", unconfirmed_s=20.0)
    tracker.disconnected("confirmed")
    clock.advance(2.01)
    assert tracker.overdue() == ["confirmed"]
    clock.advance(19.98)  # silent for 21.99 s, well past the timeout
    assert tracker.overdue() == ["confirmed"]
    clock.advance(0.02)
    assert tracker.overdue() == ["confirmed", "unconfirmed"]
    tracker.connected("unconfirmed")  # back: the next session ends like any other
    tracker.disconnected("unconfirmed")
    clock.advance(2.01)
    assert "unconfirmed" in tracker.overdue()


def test_the_deadline_of_an_unconfirmed_session_is_fixed_when_it_ends_and_moves_only_with_a_stall() -> None:
    """A faster pace later (a shorter grace) must not shorten the time the node was given."""
    clock = FakeClock(start=100.0)
    tracker = LivenessTracker(clock, timeout_s=10.0, grace_s=8.0)
    tracker.connected("a")
    tracker.disconnected("a", unconfirmed_s=20.0)  # back by 128
    tracker.grace_s, tracker.timeout_s = 4.0, 5.0  # the burst's reserve dropped
    clock.advance(27.9)
    assert tracker.overdue() == []
    tracker.excuse(1.0)  # the coordinator's own loop stalled: back by 129
    clock.advance(1.0)
    assert tracker.overdue() == []
    clock.advance(0.2)
    assert tracker.overdue() == ["a"]


def test_a_node_whose_hello_was_deferred_is_not_overdue_before_its_turn_whatever_its_session_did() -> None:
    """Its agent waits for the turn the coordinator gave it: neither the grace of its ended session nor the
    timeout ends it before then. A stall moves that moment too, a new session ends it, and a deferral
    never shortens what the node already had."""
    clock = FakeClock(start=100.0)
    tracker = LivenessTracker(clock, timeout_s=5.0, grace_s=2.0)
    for node in ("waiting", "gone"):
        tracker.connected(node)
    tracker.at_the_door("waiting", 30.0)  # deferred while its old session was still open: until 130
    tracker.at_the_door("waiting", 1.0)  # a shorter turn later does not shorten it
    tracker.at_the_door("unknown", 30.0)  # never tracked: nothing to do
    tracker.disconnected("waiting")
    tracker.disconnected("gone")
    clock.advance(2.01)
    assert tracker.overdue() == ["gone"]
    clock.advance(27.98)  # 29.99 s: past the grace and the timeout
    assert tracker.overdue() == ["gone"]
    tracker.excuse(1.0)  # the coordinator's own loop stalled: until 131
    clock.advance(1.0)
    assert tracker.overdue() == ["gone"]
    clock.advance(0.02)
    assert tracker.overdue() == ["gone", "waiting"]

    tracker.at_the_door("waiting", 30.0)
    tracker.welcomed("waiting")  # let in: from now its heartbeats count as anyone's
    clock.advance(5.01)
    assert "waiting" in tracker.overdue()
