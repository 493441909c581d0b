"""A grammar compile tried first in a process of its own, bounded in memory (--grammar-memory-mib) and killed
at --grammar-timeout: only a grammar that compiled there within both is compiled in the server (where it is
then kept by its source: grammar.py). A compile inside xgrammar cannot be interrupted, so one that ran long
in the server's own threads kept running after its request's 400 and held later constrained requests up,
and one that grew took the machine's memory; a worker process can be killed, and is replaced when it is.

The worker imports xgrammar only, and gets the tokenizer's table as xgrammar's own serialization.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import threading
from typing import Any

log = logging.getLogger("nextserve.grammar")

Source = tuple[str, str, dict[str, Any]]  # (kind, text, options): what to compile


class CompileTimeout(Exception):
    """The compile ran past its time; its worker was killed."""


class CompileTooLarge(ValueError):
    """The compile needed more memory than its worker may take (or the worker died of it)."""


def _compile(compiler: Any, source: Source) -> None:
    kind, text, opts = source
    if kind == "json":
        compiler.compile_json_schema(text, **opts)
    elif kind == "regex":
        compiler.compile_regex(text)
    elif kind == "ebnf":
        compiler.compile_grammar(text)
    elif kind == "structural_tag":
        compiler.compile_structural_tag(text)
    else:
        raise ValueError(f"unknown grammar kind {kind!r}")


def _serve(conn: Any, tokenizer_info: str, memory_bytes: int) -> None:
    """The worker: compiles what it is sent, answers (True, None), or (False, why) when memory ran out."""
    import resource

    import xgrammar as xgr

    # (one thread: an address-space bound counts every thread's stack)
    info = xgr.TokenizerInfo.deserialize_json(tokenizer_info)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    with open("/proc/self/statm") as f:
        used = int(f.read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (used + memory_bytes, used + memory_bytes))
    conn.send((True, "ready"))
    while True:
        try:
            source = conn.recv()
        except EOFError:
            return
        try:
            _compile(compiler, source)
            conn.send((True, None))
        except MemoryError:
            conn.send((False, "memory"))
        except Exception as exc:  # noqa: BLE001 - a bad schema: the server's own compile says what is wrong
            conn.send((False, "memory" if "bad_alloc" in str(exc) else None))


class GrammarProbe:
    """One worker process, started on first use and after each kill; one compile at a time."""

    def __init__(self, tokenizer_info: str, memory_mib: float, timeout_s: float) -> None:
        self.tokenizer_info, self.memory_mib, self.timeout_s = tokenizer_info, memory_mib, timeout_s
        self._lock = threading.Lock()
        self._proc: Any = None
        self._conn: Any = None

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        memory = int(self.memory_mib * 2**20)
        self._proc = ctx.Process(target=_serve, args=(child, self.tokenizer_info, memory), daemon=True)
        self._proc.start()
        child.close()
        self._conn = parent
        # NOTE: the start (importing xgrammar, reading the tokenizer table: seconds) is not a compile's time
        if not parent.poll(STARTUP_S):
            self._kill()
            raise CompileTimeout("the grammar worker did not start")
        parent.recv()

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(5)
        if self._conn is not None:
            self._conn.close()
        self._proc = self._conn = None

    def check(self, source: Source) -> None:
        """Returns when `source` compiles within the time and memory; raises CompileTimeout or
        CompileTooLarge otherwise (a bad source passes: the server's compile names what is wrong)."""
        with self._lock:
            if self._proc is None or not self._proc.is_alive():
                self._kill()
                self._start()
            try:
                self._conn.send(source)
                if not self._conn.poll(self.timeout_s):
                    self._kill()
                    raise CompileTimeout
                ok, why = self._conn.recv()
            except (EOFError, OSError, BrokenPipeError):
                self._kill()
                raise CompileTooLarge(self._too_large()) from None
        if not ok and why == "memory":
            self._kill()  # (a worker past its memory may be in any state)
            raise CompileTooLarge(self._too_large())

    def _too_large(self) -> str:
        return f"compiling it needs more than {self.memory_mib:g} MiB (--grammar-memory-mib)"

    def close(self) -> None:
        with self._lock:
            self._kill()


STARTUP_S = 60.0  # the most a worker's start may take (it imports xgrammar and reads the tokenizer table)
