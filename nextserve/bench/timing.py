"""Kernel timings of the benchmarks/ scripts (CUDA): eager median, and replayed from a CUDA graph."""

from __future__ import annotations

import torch


def kernel_us(fn) -> float:
    """Median µs of fn by triton.testing.do_bench."""
    import triton.testing

    return triton.testing.do_bench(fn, return_mode="median") * 1e3


def graph_us(fn) -> float:
    """Median µs of one replay of a CUDA graph of fn (compiled and warmed up outside the capture)."""
    fn()  # compile outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return kernel_us(graph.replay)
