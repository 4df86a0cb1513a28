from __future__ import annotations

import pytest

from tests.services import RedisProcess


@pytest.fixture
def redis_proc():
    """A fresh redis-server on a free port, stopped after the test."""
    r = RedisProcess().start()
    yield r
    r.stop(kill=True)


@pytest.fixture(scope="module")
def redis_cluster():
    """A 3-master Redis Cluster on free ports, shared by the tests of one module."""
    from tests.services import RedisCluster

    c = RedisCluster(masters=3).start()
    yield c
    c.stop()
