"""The process's programmatic-dependent-launch switch (ops/triton/common.py says what PDL is and the
contract its kernels keep). It lives apart from the kernels so that the engine, which sets it around every
step, imports no Triton: a CPU install without Triton runs the same engine code."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

_PDL = [False]  # on inside an engine's steps with EngineConfig.pdl (ModelRunner); off for direct op calls


def set_pdl(on: bool) -> None:
    """Launch this process's kernels with programmatic dependent launch (where supported)."""
    _PDL[0] = bool(on)


def pdl_on() -> bool:
    return _PDL[0]


@contextlib.contextmanager
def pdl_mode(on: bool) -> Iterator[None]:
    """PDL on or off for the kernels launched inside, then as before (one engine's setting never leaks
    into another's steps or into direct op calls)."""
    prev = _PDL[0]
    _PDL[0] = bool(on)
    try:
        yield
    finally:
        _PDL[0] = prev
