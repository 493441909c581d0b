"""Kernel micro-benchmarks at Flash-Next's real widths, one per kernel family (CUDA; each prints one JSON
object with the revision, the hardware and the command):

    python benchmarks/bench_kernels.py NAME [its flags ...]
    python benchmarks/bench_kernels.py NAME --help

NAME is a module of benchmarks/kernels/:
    small_m_gemm        the row-invariant small-M GEMM (16-bit decode projections) against cuBLAS, --sweep
    fp8_gemv            the same GEMV on block-wise FP8 weights, --sweep of its configurations
    fp8_prefill         a prefill chunk's FP8 projections: dequantize + cuBLAS, W8A8 Triton, torch scaled_mm
    int4                the int4 (W4A16) GEMV and grouped decode experts against their bf16 and FP8 twins
    decode_blocks       one hyper-connection mix and one MoE block as a decode step runs them
    moe_decode          the routed experts at decode rows against the per-row reference
    moe_grouped_decode  per-(row, expert) GEMVs against the grouped kernel at 1-32 rows
    moe_prefill         the grouped prefill experts (bf16 or --fp8), block sizes swept
    moe_together        several prefill chunks' experts in one call against one call a chunk
    qsa_decode          paged QSA decode ops (scores, selection, attention) at B = 1, 8, 32
    qsa_prefill         QSA prefill of one 4,096-token chunk near position 61K
    qsa_select          the QSA block selection's launch configuration, searched and compared
    gdn_chunk           the prefill GDN recurrence of one chunk
    prefill_pointwise   the memory-bound prefill kernels against their bytes, --sweep of constants
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

KERNELS = sorted(p.stem for p in (HERE / "kernels").glob("*.py") if p.stem != "__init__")


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in KERNELS:
        print(f"unknown kernel benchmark {name!r}; one of: {', '.join(KERNELS)}", file=sys.stderr)
        return 2
    # NOTE: each module reads its flags from sys.argv (argparse), so it sees its own name as the program
    sys.argv = [f"bench_kernels.py {name}", *rest]
    importlib.import_module(f"kernels.{name}").main()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
