"""Kernel micro-benchmarks, one module a kernel family, each run as `bench_kernels.py NAME`."""

import argparse


def parse_no_flags(doc: str) -> None:
    """The command line of a benchmark that takes no flags: --help prints `doc`, anything else is refused."""
    argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()
