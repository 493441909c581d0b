"""Engine flags the CPU test engines share (each fixture adds its pool and context sizes)."""

CPU_FLAGS = dict(dtype="float32", device="cpu", max_concurrency=4, page_size=16)
