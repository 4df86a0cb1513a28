from __future__ import annotations

import pytest

from tests.services import RedisProcess


@pytest.fixture
def redis_proc():
    """A fresh redis-server on a free port, stopped after the test."""
    r = RedisProcess().start()
    yield r
    r.stop(kill=True)
