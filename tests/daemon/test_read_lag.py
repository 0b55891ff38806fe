"""The coordinator's read lag: how late it handles heartbeats, whatever the agents' clocks say."""

from daemon.read_lag import ReadLag


class Session:
    def __init__(self) -> None:
        self.clock_offset: float | None = None


def test_agents_clock_offsets_are_not_lag_but_a_backlog_read_late_is() -> None:
    lag, ahead, behind = ReadLag(), Session(), Session()
    for _ in range(10):  # one agent's clock runs 40 s ahead of ours, the other's 7 s behind; no backlog
        lag.observe(ahead, -40.0 + 0.002)
        lag.observe(behind, 7.0 + 0.002)
    assert lag.take() == 0.0
    for _ in range(10):  # now every heartbeat is handled 1.5 s after it was sent
        lag.observe(ahead, -40.0 + 1.502)
        lag.observe(behind, 7.0 + 1.502)
    assert abs(lag.take() - 1.5) < 1e-9
    assert abs(lag.take() - 1.5) < 1e-9  # a window with no heartbeats keeps the one before's allowance
    assert lag.take() == 0.0


def test_one_node_on_a_slow_link_does_not_delay_the_verdict_on_the_others() -> None:
    lag, sessions = ReadLag(), [Session() for _ in range(5)]
    for s in sessions:
        lag.observe(s, 0.001)
    lag.take()
    for s in sessions[:4]:
        lag.observe(s, 0.001)
    lag.observe(sessions[4], 3.0)  # its heartbeats were delayed on the way, not by us
    assert lag.take() == 0.0
