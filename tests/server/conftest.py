"""Fixtures of the server tests: a live server shared by the session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from live_server import LiveServer, live_server


@pytest.fixture(scope="module")
def server(tiny_model_dir) -> Iterator[LiveServer]:
    """The server of a test module: 4 slots, a 4096-token pool in 16-token pages, max_context 1024."""
    with live_server(tiny_model_dir) as srv:
        yield srv
