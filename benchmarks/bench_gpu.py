"""The GPU baseline of issue 6 (same as `nextserve bench`): prefill and decode through the engine on
random Flash-Next weights drawn on the device, against transformers and the memory-bandwidth roofline.

Prints one JSON object (git revision, hardware, command). BENCHMARKS.md, "GPU baseline", records the runs.

    python benchmarks/bench_gpu.py                                  # flash-next preset (8 layers) on cuda
    python benchmarks/bench_gpu.py --prompt-lens 1024 8192 32768    # the longer prompts too
    python benchmarks/bench_gpu.py --device cpu --preset tiny       # a seconds-long check on the CPU
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nextserve.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(prog="benchmarks/bench_gpu.py"))
