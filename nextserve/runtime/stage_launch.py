"""How the pipeline's stage processes start (runtime/pipeline.py): as children of the server process
(`python -m nextserve.runtime.stage_main`, one machine), or as the ranks torchrun started, one stage per
rank on any number of machines, rank 0 the server and driver:

    torchrun --nnodes 2 --nproc-per-node 1 --node-rank R --master-addr HOST0 --master-port 29500 \\
        -m nextserve.cli serve --model DIR --pipeline-stages 2

Every rank runs the same command; rank 0 sends each other rank its stage's setup (the model directory
must be at the same path on every machine), and the stages then run as spawned ones do.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config import DTYPES, ConfigError, ModelConfig
from .shm_channel import ShmChannel
from .stage_channel import TIMEOUT, StageChannel
from .stage_codec import wire_type


@dataclass(frozen=True)
class StageSetup:
    """What a stage process needs to build itself (picklable)."""

    model_dir: str
    cfg: ModelConfig
    layers: range
    dtype: torch.dtype
    num_slots: int
    num_pages: int
    page_size: int
    rank: int
    world: int
    port: int
    threads: int  # the driver's torch threads: a CPU GEMM's reduction order may follow the thread count
    device: str  # this stage's: "cpu" or "cuda:N"
    transport: str  # "nccl", "host" or "shm" (stage_transport.py)
    pdl: bool
    max_context: int  # the engine's: the positions a stage's rotary table covers
    cuda_graph: bool  # decode steps and verify windows replay CUDA graphs (on a CUDA device)
    window_steps: int  # keep slots per state slot: the speculative tokens per window (0: no speculation)
    quantization: str  # EngineConfig.quantization
    mtp_tokens: int = 0  # the last stage's MTP block drafts up to this many a window (0: no MTP)
    head_embedding: str = "device"  # where that block's token embeddings live (EngineConfig)
    host_arena_mib: int = 0  # pinned host memory locked at start for its share of host images (0: none)
    memory_gib: float | None = None  # this stage's GPU memory cap (--stage-memory-gib; None: none)
    experts_host: bool = False  # its routed experts in pinned host memory (--experts host)
    expert_cache_gib: float = 0.0  # its device cache of them (--expert-cache-gib; 0: none)
    kv_dtype: str = "auto"  # its KV planes' form (--kv-dtype)


@wire_type
@dataclass(frozen=True)
class RankSetup:
    """A StageSetup as it travels to a torchrun rank (wire values only: stage_codec.py); the rank reads the
    model's config from the directory and takes its own local GPU."""

    model_dir: str
    first_layer: int
    end_layer: int
    dtype: str
    num_slots: int
    num_pages: int
    page_size: int
    threads: int
    device_type: str
    transport: str
    pdl: bool
    max_context: int
    cuda_graph: bool
    window_steps: int
    quantization: str
    mtp_tokens: int
    head_embedding: str
    host_arena_mib: int
    memory_gib: float | None = None
    experts_host: bool = False
    expert_cache_gib: float = 0.0
    kv_dtype: str = "auto"

    @classmethod
    def of(cls, s: StageSetup) -> RankSetup:
        dtype = next(name for name, dt in DTYPES.items() if dt == s.dtype)
        return cls(os.path.abspath(s.model_dir), s.layers.start, s.layers.stop, dtype, s.num_slots,
                   s.num_pages, s.page_size, s.threads, torch.device(s.device).type, s.transport, s.pdl,
                   s.max_context, s.cuda_graph, s.window_steps, s.quantization, s.mtp_tokens,
                   s.head_embedding, s.host_arena_mib, s.memory_gib, s.experts_host,
                   float(s.expert_cache_gib), s.kv_dtype)  # fmt: skip

    def stage_setup(self, rank: int, world: int, local_rank: int) -> StageSetup:
        device = f"cuda:{local_rank}" if self.device_type == "cuda" else "cpu"
        return StageSetup(
            self.model_dir, ModelConfig.from_dir(self.model_dir), range(self.first_layer, self.end_layer),
            DTYPES[self.dtype], self.num_slots, self.num_pages, self.page_size, rank, world, 0, self.threads,
            device, self.transport, self.pdl, self.max_context, self.cuda_graph, self.window_steps,
            self.quantization, self.mtp_tokens, self.head_embedding, self.host_arena_mib, self.memory_gib,
            self.experts_host, self.expert_cache_gib, self.kv_dtype,
        )  # fmt: skip


def torchrun_rank() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when torchrun started this process in a world of 2 or more."""
    env = os.environ
    if "TORCHELASTIC_RUN_ID" not in env or int(env.get("WORLD_SIZE", "1")) < 2:
        return None
    return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", "0"))


def rendezvous_channel(rank: int, world: int) -> StageChannel:
    """This rank's channel over torchrun's store (MASTER_ADDR:MASTER_PORT: the agent's, or rank 0's when
    torchrun hosts none), as init_process_group's env:// finds it."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(host, port, world, rank == 0 and not agent, timeout=TIMEOUT)
    return StageChannel(rank, world, store=dist.PrefixStore("nextserve", store))


def open_channel(transport: str, rank: int, world: int, port: int) -> StageChannel:
    """Stage `rank`'s channel over stage 0's store on the local `port`: through shared memory for the
    `shm` transport (shm_channel.py), else over Gloo."""
    return (ShmChannel if transport == "shm" else StageChannel)(rank, world, port)


def start_stages(setups: list[StageSetup], port: int) -> tuple[StageChannel, list[subprocess.Popen]]:
    """Stage 0's channel and the stage processes it started (none under torchrun: the ranks are there
    already and get their setups over the channel)."""
    world = len(setups) + 1
    run = torchrun_rank()
    if run is not None:
        rank, ranks, _ = run
        if setups and setups[0].transport == "shm":
            raise ConfigError("--stage-transport shm runs the stages on one machine: not under torchrun")
        if rank != 0 or ranks != world:
            raise ConfigError(
                f"under torchrun, rank 0 serves and each rank runs one stage: --pipeline-stages {world} "
                f"needs {world} ranks, this is rank {rank} of {ranks}"
            )
        channel = rendezvous_channel(0, world)
        channel.broadcast([None] + [RankSetup.of(s) for s in setups])
        return channel, []
    procs: list[subprocess.Popen] = []
    # NOTE: `python -m` children, not multiprocessing's spawn, which would re-run the user's main module in
    # every stage; each in a session of its own, so a terminal's Ctrl-C or a supervisor's signal to the
    # process group reaches the driver only, which then stops the stages in order (PipelineRunner.close).
    for setup in setups:
        argv = [sys.executable, "-m", "nextserve.runtime.stage_main"]
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, start_new_session=True)
        proc.stdin.write(pickle.dumps(setup))  # NOTE: a pipe only this process writes: safe to pickle
        proc.stdin.close()
        procs.append(proc)
    try:
        return open_channel(setups[0].transport, 0, world, port), procs
    except BaseException:  # no stage is left waiting for a driver that is not coming
        for proc in procs:
            proc.kill()
        raise
