"""The engine's flags (EngineConfig) and the model served when none is named (DEFAULT_MODEL)."""

from __future__ import annotations

from dataclasses import dataclass
from importlib.resources import files

import torch

from .config import DTYPES, ConfigError
from .ops.kv8 import KV_DTYPES

# --prefill-batch-chunks auto in one process: chunks up to this many tokens a forward (vLLM's prefill step;
# 4 chunks at the default 4,096: BENCHMARKS.md, Long prefill)
AUTO_PREFILL_BATCH_TOKENS = 16384


# The small Flash-Next that ships inside the package (tools/train_default_model.py trained it).
DEFAULT_MODEL = str(files("nextserve") / "assets" / "default_model")
DEFAULT_MODEL_NAME = "nextserve-default"


@dataclass(frozen=True)
class EngineConfig:
    """Every engine mode; each field is a `nextserve serve` flag of the same name (C3)."""

    model: str = DEFAULT_MODEL
    dtype: str = "auto"  # auto: bfloat16 on cuda, float32 on cpu
    device: str = "auto"  # auto: cuda when available
    prefill_chunk: int = 4096  # BENCHMARKS.md, Long prefill: 62.7K cold TTFT 1.13 s against 1.94 at 1024
    max_concurrency: int | str = "auto"  # sequences at once; auto: from the memory (engine/concurrency.py)
    kv_capacity: int | str = "auto"  # tokens in the pool, or "auto"
    max_context: int | None = None  # per sequence; default: the model's max_position_embeddings
    page_size: int = 64
    max_pending: int = 256
    memory_headroom_mib: int = 2048
    gpu_memory_gib: float | None = None  # act as if the GPU had this many GiB (runtime/device_memory.py)
    cpu_kv_budget_mib: int = 1024
    seed: int = 0
    prefix_cache: bool = True  # prefix reuse (--no-prefix-cache: off)
    prefix_cache_images: int | str = "auto"  # grid images kept for prefix reuse; auto: sized with the pool
    prefix_anchor_chunks: int = 0  # also keep an image every N chunks of long prompts (0: none)
    cuda_graph: bool = True  # replay decode steps and verify windows as CUDA graphs (GPU only)
    pdl: bool = True  # programmatic dependent launch of the Triton kernels (sm_90+ GPUs only)
    async_scheduling: bool = True  # launch a greedy decode step before reading the previous one's tokens
    speculative_method: str = "off"  # "ngram" (prompt lookup) or "mtp" (the MTP block): drafts to verify
    speculative_tokens: int = 4  # draft tokens per verify window at most
    pipeline_stages: int = 1  # processes the layers are split across, one device each
    pipeline_devices: str | None = None  # CUDA index per stage, "0,1" (default: consecutive from --device's)
    stage_layers: str | None = None  # decoder layers per stage, "8,8,8,8,16" or auto (default: even)
    stage_memory_gib: str | None = None  # each stage's GPU memory cap, "24,12,12,12,12" (default: none)
    decode_groups: int = 1  # pipeline decode rows as this many groups in flight across the stages
    pipeline_prefill_chunks: int | str = "auto"  # a prompt's chunks a step sends in (auto: one per stage)
    # one process: prompt chunks one forward runs, each as it runs alone, their routed experts in one call
    # (auto: 16,384 tokens a forward in one process, 4 chunks at the default chunk; BENCHMARKS.md, Long
    # prefill: a cold 62.7K prompt 1.14x, four 16K prompts 1.20x, 1K prompts 1.40x; with pipeline stages one)
    prefill_batch_chunks: int | str = "auto"
    # prompt chunks a step runs while it also decodes (auto: one in one process; with stages all of a step's)
    prefill_chunks_beside_decodes: int | str = "auto"
    stage_transport: str = "auto"  # between stages: nccl, host (pinned memory + Gloo), shm, auto
    head_embedding: str = "device"  # the last stage's MTP token embeddings: a device copy, or host (pinned)
    pipeline_windows: bool = False  # front stages run the MTP-guessed next window while the last verifies
    host_state_slots: int | str = "auto"  # prefix images kept in host memory (0: off; auto: on if room)
    host_kv_mib: int = 4096  # host memory for the host image store and preempted sequences
    skip_tokenizer: bool = False  # token ids in and out, no text (a model directory without a tokenizer)
    quantization: str = "auto"  # auto: as the checkpoint is; fp8: quantize its projections on load; none
    kv_dtype: str = "auto"  # the KV pool's planes: auto / bf16 (the model dtype), int8 or fp8 (ops/kv8.py)
    ple_table: str = "auto"  # where the n-gram table lives: device, host (pinned), auto (host if no room)
    experts: str = "device"  # where the routed experts live: device, host (pinned), auto (host if no room)
    expert_cache_gib: float | str = "auto"  # device cache of host-held experts (runtime/expert_cache.py)
    warm_up: bool = True  # compile every kernel specialisation at start, before serving (GPU only)
    compile_cache_dir: str | None = None  # Triton's compile cache (a restart then compiles nothing)

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be auto or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        ints = ("prefill_chunk", "max_concurrency", "page_size", "max_pending", "pipeline_stages")
        ints += ("decode_groups",)
        for name in ints:
            if name == "max_concurrency" and self.max_concurrency == "auto":
                continue
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                auto = " or 'auto'" if name == "max_concurrency" else ""
                raise ConfigError(f"{name} must be a positive integer{auto}, got {getattr(self, name)!r}")
        if self.kv_capacity != "auto" and (not isinstance(self.kv_capacity, int) or self.kv_capacity <= 0):
            raise ConfigError(f"kv_capacity must be a positive integer or 'auto', got {self.kv_capacity!r}")
        if self.max_context is not None and (not isinstance(self.max_context, int) or self.max_context <= 0):
            raise ConfigError(f"max_context must be a positive integer, got {self.max_context!r}")
        counts = ("prefix_cache_images", "prefix_anchor_chunks", "seed", "host_state_slots", "host_kv_mib")
        for name in counts:
            value = getattr(self, name)
            if value == "auto" and name in ("prefix_cache_images", "host_state_slots"):
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                auto = " or 'auto'" if name in ("prefix_cache_images", "host_state_slots") else ""
                raise ConfigError(f"{name} must be a non-negative integer{auto}, got {value!r}")
        if not isinstance(self.prefix_cache, bool):
            raise ConfigError(f"prefix_cache must be true or false, got {self.prefix_cache!r}")
        images = self.prefix_cache_images if self.prefix_cache else 0
        if self.host_state_slots not in (0, "auto") and images == 0:
            raise ConfigError(
                "host_state_slots needs prefix reuse on (prefix_cache_images > 0 or auto): it keeps "
                "device spills"
            )
        if self.ple_table not in ("auto", "device", "host"):
            raise ConfigError(f"ple_table must be auto, device or host, got {self.ple_table!r}")
        if self.experts not in ("auto", "device", "host"):
            raise ConfigError(f"experts must be auto, device or host, got {self.experts!r}")
        if self.experts == "auto" and self.pipeline_stages > 1:
            raise ConfigError(
                "experts auto places one process's routed experts by its memory plan; with pipeline stages "
                "say experts host (every stage's in host memory) or device"
            )
        self._check_expert_cache()
        if self.quantization not in ("auto", "fp8", "int4", "none"):
            raise ConfigError(f"quantization must be auto, fp8, int4 or none, got {self.quantization!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise ConfigError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")
        if self.speculative_method not in ("off", "ngram", "mtp"):
            raise ConfigError(
                f"speculative_method must be off, ngram or mtp, got {self.speculative_method!r}"
            )
        if not isinstance(self.speculative_tokens, int) or not 1 <= self.speculative_tokens <= 32:
            raise ConfigError(f"speculative_tokens must be in 1..32, got {self.speculative_tokens!r}")
        if self.compile_cache_dir is not None and (
            not isinstance(self.compile_cache_dir, str) or not self.compile_cache_dir
        ):
            raise ConfigError(f"compile_cache_dir must be a directory path, got {self.compile_cache_dir!r}")
        bools = ("cuda_graph", "pdl", "async_scheduling", "skip_tokenizer", "warm_up", "pipeline_windows")
        for name in bools:
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.memory_headroom_mib < 0 or self.cpu_kv_budget_mib <= 0:
            raise ConfigError("memory_headroom_mib must be >= 0 and cpu_kv_budget_mib > 0")
        cap = self.gpu_memory_gib
        if cap is not None:
            if isinstance(cap, bool) or not isinstance(cap, int | float) or not 0 < cap < 1e6:
                raise ConfigError(f"gpu_memory_gib must be a positive number of GiB, got {cap!r}")
            if self.device == "cpu":
                raise ConfigError("gpu_memory_gib caps a GPU's memory; the CPU backend has cpu_kv_budget_mib")
            if self.pipeline_stages > 1:
                raise ConfigError(
                    "gpu_memory_gib caps one process's GPU; pipeline stages would each need their own cap, "
                    "which is not there yet"
                )
        self._check_stage_flags()

    def _check_expert_cache(self) -> None:
        gib = self.expert_cache_gib
        if gib == "auto":
            return
        if isinstance(gib, bool) or not isinstance(gib, int | float) or not 0 <= gib < 1e6:
            raise ConfigError(f"expert_cache_gib must be auto or a number of GiB >= 0, got {gib!r}")
        if gib > 0 and self.experts == "device":
            raise ConfigError(
                "expert_cache_gib caches routed experts held in host memory: it needs experts host or auto"
            )

    def _check_stage_flags(self) -> None:
        """stage_transport and pipeline_devices (normalised to "i,j,..." when given as a list of ints)."""
        if self.decode_groups > 1 and self.pipeline_stages < 2:
            raise ConfigError("decode_groups > 1 keeps pipeline stages busy: it needs pipeline_stages > 1")
        if self.decode_groups > 64:
            raise ConfigError(f"decode_groups must be at most 64, got {self.decode_groups!r}")
        chunks = self.pipeline_prefill_chunks
        if chunks != "auto":
            if not isinstance(chunks, int) or isinstance(chunks, bool) or not 1 <= chunks <= 64:
                raise ConfigError(f"pipeline_prefill_chunks must be 'auto' or in 1..64, got {chunks!r}")
            if chunks > 1 and self.pipeline_stages < 2:
                raise ConfigError(
                    "pipeline_prefill_chunks > 1 keeps pipeline stages busy: it needs pipeline_stages > 1"
                )
        batch = self.prefill_batch_chunks
        if batch != "auto" and (
            not isinstance(batch, int) or isinstance(batch, bool) or not 1 <= batch <= 64
        ):
            raise ConfigError(f"prefill_batch_chunks must be 'auto' or in 1..64, got {batch!r}")
        if batch != "auto" and batch > 1 and self.pipeline_stages > 1:
            raise ConfigError(
                "prefill_batch_chunks > 1 runs several prompt chunks in one forward of one process; with "
                "pipeline stages a step's chunks overlap across the stages (--pipeline-prefill-chunks)"
            )
        beside = self.prefill_chunks_beside_decodes
        if beside != "auto" and (
            not isinstance(beside, int) or isinstance(beside, bool) or not 1 <= beside <= 64
        ):
            raise ConfigError(f"prefill_chunks_beside_decodes must be 'auto' or in 1..64, got {beside!r}")
        if self.stage_transport not in ("auto", "nccl", "host", "shm"):
            raise ConfigError(
                f"stage_transport must be auto, nccl, host or shm, got {self.stage_transport!r}"
            )
        self._check_stage_layers()
        if self.stage_transport == "shm" and self.pipeline_stages > 1:
            _check_shm(self.pipeline_stages)
        if self.head_embedding not in ("device", "host"):
            raise ConfigError(f"head_embedding must be device or host, got {self.head_embedding!r}")
        if self.head_embedding == "host" and (self.pipeline_stages < 2 or self.speculative_method != "mtp"):
            raise ConfigError(
                "head_embedding host is where the last pipeline stage's MTP block reads its token "
                "embeddings: it needs pipeline_stages > 1 and speculative_method mtp (one process reads "
                "the model's own table)"
            )
        if self.pipeline_windows and (self.pipeline_stages < 2 or self.speculative_method != "mtp"):
            raise ConfigError(
                "pipeline_windows runs the MTP block's guess of the next verify window on the front stages "
                "while the last stage verifies: it needs pipeline_stages > 1 and speculative_method mtp"
            )
        if self.device == "cpu" and self.stage_transport == "nccl":
            raise ConfigError(
                "stage_transport nccl needs CUDA devices; CPU stages pass activations over Gloo (host)"
            )
        devices = self.pipeline_devices
        if devices is None:
            return
        indices = _comma_list(devices, int)
        if indices is None or min(indices) < 0:
            raise ConfigError(
                f"pipeline_devices must be comma-separated CUDA device indices such as 0,1, got {devices!r}"
            )
        # NOTE: NCCL runs one rank per GPU; through host memory several stages may share a GPU (one GPU
        # then runs the stage processes, as tests/gpu/test_pipeline_cuda.py does on a single H200).
        if len(set(indices)) != len(indices) and self.stage_transport == "nccl":
            raise ConfigError(
                f"pipeline_devices names a GPU twice, which needs --stage-transport host or shm (NCCL runs "
                f"one stage per GPU), got {devices!r}"
            )
        if self.pipeline_stages < 2 or len(indices) != self.pipeline_stages:
            raise ConfigError(
                f"pipeline_devices names {len(indices)} devices: give one per stage, with pipeline_stages "
                f"> 1 (pipeline_stages is {self.pipeline_stages}; one device is --device cuda:N)"
            )
        if self.device == "cpu":
            raise ConfigError("pipeline_devices are CUDA devices; it does not go with device cpu")
        object.__setattr__(self, "pipeline_devices", ",".join(map(str, indices)))

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dev = torch.device(self.device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device cuda was asked for but no CUDA device is available")
        return dev

    @property
    def state_slots(self) -> int:
        """State slots to allocate: one per sequence, and with pipeline_windows the shadow slot the guessed
        windows run on (runtime/pipeline.py). Only once max_concurrency is a number (the engine resolves
        auto: engine/concurrency.py)."""
        assert self.max_concurrency != "auto", "max_concurrency auto is resolved by the engine"
        return self.max_concurrency + int(self.pipeline_windows)

    def prefill_chunks_per_step(self) -> int:
        """Prompt chunks one step runs at most: one process, prefill_batch_chunks (in one forward); with
        pipeline stages, those a step sends in (auto: one per stage)."""
        if self.pipeline_stages == 1:
            batch = self.prefill_batch_chunks
            if batch == "auto":
                return max(1, min(64, AUTO_PREFILL_BATCH_TOKENS // self.prefill_chunk))
            return batch
        chunks = self.pipeline_prefill_chunks
        return self.pipeline_stages if chunks == "auto" else chunks

    def stage_expert_cache_gib(self) -> float:
        """Each pipeline stage's device expert cache: expert_cache_gib with experts host (auto: none, a
        stage's memory being the stage's own), else 0."""
        gib = self.expert_cache_gib
        return float(gib) if self.experts == "host" and gib != "auto" else 0.0

    def prefill_chunks_with_decodes(self) -> int:
        """Prompt chunks a step that also decodes runs at most: prefill_chunks_beside_decodes (auto: one in
        one process, where a step is one forward; with pipeline stages a step's chunks keep the stages
        busy, so all of them), never more than `prefill_chunks_per_step`."""
        beside = self.prefill_chunks_beside_decodes
        if beside == "auto":
            beside = 1 if self.pipeline_stages == 1 else self.prefill_chunks_per_step()
        return min(beside, self.prefill_chunks_per_step())

    def prefill_forward_chunks(self) -> int:
        """Prompt chunks one forward may run together (FlashNext.forward_chunks): a step's chunks in one
        process; one with pipeline stages, whose stages run a step's chunks one after another."""
        return self.prefill_chunks_per_step() if self.pipeline_stages == 1 else 1

    def stage_devices(self) -> list[torch.device]:
        """Each pipeline stage's device: pipeline_devices, else consecutive CUDA indices from --device's
        (cuda: 0, 1, ...; cuda:2: 2, 3, ...); every stage on the CPU backend is the CPU."""
        dev = self.torch_device()
        if dev.type != "cuda":
            return [dev] * self.pipeline_stages
        if self.pipeline_devices is not None:
            return [torch.device("cuda", int(i)) for i in self.pipeline_devices.split(",")]
        return [torch.device("cuda", (dev.index or 0) + i) for i in range(self.pipeline_stages)]

    def _check_stage_layers(self) -> None:
        """stage_layers: positive counts, one per stage (normalised to "a,b,..." from a list of ints), or
        auto (by stage_memory_gib); the model's layer count is checked against their sum when the model is
        known (engine/setup.py). stage_memory_gib: positive GiB, one per stage, on CUDA."""
        self._check_stage_memory()
        layers = self.stage_layers
        if layers == "auto" and self.stage_memory_gib is None:
            raise ConfigError(
                "stage_layers auto splits the layers by each stage's stage_memory_gib: give those"
            )
        if layers is None or layers == "auto":
            return
        counts = _comma_list(layers, int)
        if counts is None:
            raise ConfigError(
                f"stage_layers must be comma-separated layer counts such as 8,8,16, got {layers!r}"
            )
        if min(counts) < 1:
            raise ConfigError(f"stage_layers gives a stage no layers: {layers!r} (every stage needs one)")
        if len(counts) != self.pipeline_stages:
            raise ConfigError(
                f"stage_layers names {len(counts)} stages, pipeline_stages is {self.pipeline_stages}: give "
                "one count per stage"
            )
        object.__setattr__(self, "stage_layers", ",".join(map(str, counts)))

    def _check_stage_memory(self) -> None:
        caps = self.stage_memory_gib
        if caps is None:
            return
        values = _comma_list(caps, float)
        if values is None or not all(0 < v < 1e6 for v in values):
            raise ConfigError(
                f"stage_memory_gib must be comma-separated positive GiB such as 24,12, got {caps!r}"
            )
        if len(values) != self.pipeline_stages or self.pipeline_stages < 2:
            raise ConfigError(
                f"stage_memory_gib names {len(values)} stages, pipeline_stages is {self.pipeline_stages}: "
                "give one cap per stage of a pipeline"
            )
        if self.device == "cpu":
            raise ConfigError(
                "stage_memory_gib caps the stages' GPU memory; the CPU backend has cpu_kv_budget_mib"
            )
        object.__setattr__(self, "stage_memory_gib", ",".join(f"{v:g}" for v in values))

    def stage_memory_caps(self) -> list[float] | None:
        """stage_memory_gib as numbers (None: no caps)."""
        caps = self.stage_memory_gib
        return None if caps is None else [float(c) for c in caps.split(",")]

    def stage_layer_counts(self, num_layers: int | None = None) -> list[int] | None:
        """stage_layers as integers (None: split evenly); auto needs the model's `num_layers`: each stage's
        share of the layers in proportion to its memory cap (largest remainders; at least one each)."""
        if self.stage_layers is None:
            return None
        if self.stage_layers != "auto":
            return [int(n) for n in self.stage_layers.split(",")]
        caps = self.stage_memory_caps()
        assert caps is not None and num_layers is not None
        if num_layers < len(caps):
            raise ConfigError(f"stage_layers auto: {len(caps)} stages for {num_layers} layers")
        shares = [num_layers * c / sum(caps) for c in caps]
        counts = [max(1, int(s)) for s in shares]
        while sum(counts) > num_layers:  # (a stage raised to one layer)
            i = max((i for i in range(len(counts)) if counts[i] > 1), key=lambda i: counts[i] - shares[i])
            counts[i] -= 1
        for i in sorted(range(len(caps)), key=lambda i: counts[i] - shares[i])[: num_layers - sum(counts)]:
            counts[i] += 1
        return counts

    def stage_transport_kind(self) -> str:
        """stage_transport with auto resolved: nccl on CUDA with a GPU per stage; where stages share a GPU
        (NCCL cannot), shm where this machine allows it, else host; host on the CPU.

        # NOTE: shm for a shared GPU because its pipeline decoded one request at 1.45x Gloo's speed (H100,
        # BENCHMARKS.md, Pipeline stages); on the CPU auto stays host: shm is opt-in there."""
        if self.stage_transport != "auto":
            return self.stage_transport
        if self.torch_device().type != "cuda":
            return "host"
        devices = [d.index for d in self.stage_devices()]
        if len(set(devices)) == len(devices):
            return "nccl"
        try:
            _check_shm(self.pipeline_stages)
        except ConfigError:
            return "host"
        return "shm"

    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device().type == "cuda" else torch.float32
        return DTYPES[self.dtype]


def _comma_list(value, kind: type) -> list | None:
    """A list flag's values of `kind` (int: non-negative integers; float: any number), given as "a,b,..."
    or as a list of them; None when it is neither."""
    if isinstance(value, list | tuple) and all(
        type(v) is int or (kind is float and type(v) is float) for v in value
    ):
        return [kind(v) for v in value]
    if not isinstance(value, str):
        return None
    parts = [p.strip() for p in value.split(",")]
    if kind is int:
        return [int(p) for p in parts] if all(p.isascii() and p.isdigit() for p in parts) else None
    try:
        return [float(p) for p in parts]
    except ValueError:
        return None


def _check_shm(stages: int) -> None:
    """What `--stage-transport shm` needs of this machine (runtime/shm_ring.py's NOTE): x86-64 memory
    ordering, and room in /dev/shm for every ring of `stages` stages."""
    import os
    import platform

    from .runtime.shm_channel import SHM_DIR, ShmChannel

    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise ConfigError(
            f"stage_transport shm relies on x86-64 memory ordering; this machine is {platform.machine()}: "
            "use --stage-transport host"
        )
    if not os.path.isdir(SHM_DIR):
        raise ConfigError(f"stage_transport shm needs {SHM_DIR}: use --stage-transport host")
    st = os.statvfs(SHM_DIR)
    need, free = ShmChannel.bytes_needed(stages), st.f_bavail * st.f_frsize
    if free < need:
        raise ConfigError(
            f"stage_transport shm needs {need >> 20} MiB in {SHM_DIR} for {stages} stages, {free >> 20} MiB "
            "are free (a container's --shm-size): use --stage-transport host"
        )
