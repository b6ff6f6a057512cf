"""Fixtures of the fault-tolerance tests."""

from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture
def store() -> dist.TCPStore:
    """A quorum store hosted by the test on a free loopback port."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
