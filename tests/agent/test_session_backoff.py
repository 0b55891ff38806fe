"""Reconnect pacing and the persisted resume token."""

import random
from pathlib import Path

from agent.session import BACKOFF_CAP_S, IdentityFile, backoff_delay


def test_backoff_grows_is_capped_and_jittered() -> None:
    rng = random.Random(7)
    first = [backoff_delay(0, rng) for _ in range(200)]
    late = [backoff_delay(20, rng) for _ in range(200)]
    assert max(first) <= 0.2 and min(first) >= 0.1
    assert max(late) <= BACKOFF_CAP_S and min(late) >= BACKOFF_CAP_S / 2
    assert len(set(late)) > 150  # agents do not come back in lockstep


def test_identity_token_round_trip_and_node_mismatch(tmp_path: Path) -> None:
    identity = IdentityFile(tmp_path / "identity.json")
    assert identity.load_token("n1") == ""
    identity.save_token("n1", "abc")
    assert identity.load_token("n1") == "abc"
    assert identity.load_token("n2") == ""  # a renamed node does not reuse another's token
    (tmp_path / "identity.json").write_text("{not json")
    assert identity.load_token("n1") == ""


def test_a_deferred_hello_comes_back_no_earlier_than_the_hint_and_spread_over_half_as_long_again() -> None:
    rng = random.Random(7)
    delays = [backoff_delay(0, rng, cap_s=1.0, retry_after_s=2.0) for _ in range(2000)]
    assert 2.0 <= min(delays) < 2.05 and 2.95 < max(delays) <= 3.0
    assert all(backoff_delay(a, rng, cap_s=1.0) <= 1.0 for a in range(10))  # no hint: the usual cap
