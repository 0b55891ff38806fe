"""The per-certificate quota of open calls (common/stream_quota.py), as pure logic."""

from __future__ import annotations

import pytest

from common.stream_quota import QuotaExceeded, StreamQuota


def test_an_identity_holds_at_most_its_share_and_others_are_not_refused_for_it() -> None:
    quota = StreamQuota(2)
    with quota.held("a", "node a"), quota.held("a", "node a"):
        with pytest.raises(QuotaExceeded, match="^node a already has 2 calls open here, the most one "
                                                "certificate may; retry when one has ended$"):
            with quota.held("a", "node a"):
                pass
        with quota.held("b", "node b"):
            assert quota.open_calls("b") == 1
        assert quota.open_calls("a") == 2
    with quota.held("a", "node a"):  # its calls ended: it may open again
        assert quota.open_calls("a") == 1


def test_a_call_that_fails_gives_its_place_back_and_no_entry_is_kept_for_an_identity_with_none_open() -> None:
    quota = StreamQuota(1)
    for identity in range(1000):
        with pytest.raises(RuntimeError):
            with quota.held(identity, f"node {identity}"):
                raise RuntimeError("the call failed")
    assert quota.identities == 0
    with quota.held(0, "node 0"):
        assert quota.identities == 1


def test_a_quota_that_admits_nobody_is_refused() -> None:
    with pytest.raises(ValueError):
        StreamQuota(0)
