from __future__ import annotations

import pytest

from tests.store.backends import Backend, EtcdBackend, MemoryBackend


@pytest.fixture(params=["memory", "etcd"])
def backend(request: pytest.FixtureRequest) -> Backend:
    """Each contract test runs once on the in-memory fake and once on a real etcd."""
    if request.param == "memory":
        return MemoryBackend()
    return EtcdBackend(request.getfixturevalue("etcd_server"))
