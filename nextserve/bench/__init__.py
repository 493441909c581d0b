"""`nextserve bench`: prefill and decode speed, memory, energy and the roofline of random Flash-Next weights.

One run, one JSON object (git revision, hardware, command):
- prefill tok/s and TTFT at each prompt length (one request through the engine: chunked prefill, then the
  first token), and decode tok/s at each concurrency (random-token prompts, greedy, ignore_eos), both
  through the engine's scheduler and runner, i.e. what `LLM.generate` runs;
- peak memory (torch.cuda.max_memory_allocated) and J/token from NVML's energy counter;
- the memory-bandwidth roofline: the bytes one decode step must move (counted from the config, see
  `decode_step_bytes`) over the device copy bandwidth measured in the same run;
- the same workload through transformers' Qwen4ExpForCausalLM with the same weights, when it imports and
  runs (otherwise the JSON says why);
- a short profile of one decode step at concurrency 1 (time per module kind, top ops, launches).

The model's weights are drawn on the device (`random_flash_next`): no checkpoint is read or written.

The package, one role a file: model (config, random weights, engine), meters (sync, energy, windows, peak
memory, copy bandwidth), roofline (bytes a decode step moves), workload (nextserve prefill and decode),
profile (one decode step), hf (the transformers side), report (ratios, summary), provenance (git revision
and hardware, shared with benchmarks/), run (command line and the run itself).
"""

from .meters import EnergyMeter, Window, copy_bandwidth
from .model import bench_config, engine_for_model, random_flash_next
from .provenance import git_info, hardware
from .report import ratios, summary
from .roofline import decode_step_bytes, expected_distinct_experts
from .run import add_arguments, main, run_from_args

__all__ = [
    "EnergyMeter",
    "Window",
    "add_arguments",
    "bench_config",
    "copy_bandwidth",
    "decode_step_bytes",
    "engine_for_model",
    "expected_distinct_experts",
    "git_info",
    "hardware",
    "main",
    "random_flash_next",
    "ratios",
    "run_from_args",
    "summary",
]
