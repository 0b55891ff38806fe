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
