"""Shared fixtures: random Flash-Next checkpoints written once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# NOTE: without a GPU the Triton kernels run in Triton's interpreter (numpy on the CPU), so CI checks
# them against their references too. Set before any kernel module is imported (`triton.jit` reads it).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _topk_ties_to_lower_index(self, k, dim=-1, largest=True, sorted=True):
    order = torch.sort(self, dim=dim, descending=largest, stable=True).indices.narrow(dim, 0, k)
    return torch.return_types.topk((self.gather(dim, order), order))


# NOTE: transformers picks the indexer's top blocks with `Tensor.topk`, whose order among equal
# scores is implementation-defined (FLASH_NEXT.md), and relu makes exact-zero ties common in small
# random models. nextserve breaks such ties toward the lower block on every device; the oracle runs
# with the same rule, so a tie is not reported as a logits mismatch. Only the method form is patched:
# no nextserve code calls `Tensor.topk` (its MoE router and sampler call `torch.topk`).
torch.Tensor.topk = _topk_ties_to_lower_index

from cpu_flags import CPU_FLAGS  # noqa: E402

from nextserve.model.make_model import make_model  # noqa: E402


@pytest.fixture
def one_torch_thread():
    """torch on one thread for the test; stage processes take the driver's count, so outputs still
    compare with one process's (C1). On CI's 2 cores a driver and 3 stage processes at 2 OpenMP threads
    each ran the small model's 3-stage generate in 3.4 s, at one thread each in 2.0 s."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny preset, text layout, per-expert experts, one safetensors file, with MTP weights."""
    return make_model("tiny", tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="session")
def small_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small preset (8 layers, 2 QSA, 16 experts), text layout, one file, with MTP weights."""
    return make_model("small", tmp_path_factory.mktemp("small"), seed=0)


# ---- engine tests (tests/cache, tests/engine) --------------------------------------------------
@pytest.fixture(scope="session")
def oracle_config():
    """nextserve's ModelConfig of hf_oracle.TINY (pool and slot shapes for the cache tests)."""
    from hf_oracle import TINY

    from nextserve.config import ModelConfig

    return ModelConfig.from_dict({**TINY, "model_type": "qwen4_exp_text"})


@pytest.fixture(scope="session")
def oracle_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """transformers' reference model on hf_oracle.TINY (seed 0, token ids only, eos 1), saved as a model
    directory; lm_head scaled by 30 so greedy decoding is not decided by near-ties."""
    from hf_oracle import TINY, save_hf_model

    return save_hf_model(TINY, 0, tmp_path_factory.mktemp("oracle_tiny"))


MAX_ENGINE_STEPS = 5000
ORACLE_ENGINE_FLAGS = CPU_FLAGS | dict(kv_capacity=512, prefill_chunk=16, max_context=256)


@pytest.fixture(scope="session")
def oracle_llm(oracle_model_dir):
    """A factory of fresh LLMs on the oracle model: oracle_llm(**engine_flags) (defaults above)."""
    from nextserve import LLM

    def make(**flags):
        llm = LLM(str(oracle_model_dir), **(ORACLE_ENGINE_FLAGS | flags))
        # NOTE: a request that can never be admitted (leaked pages) would make generate() spin
        # forever; a step budget turns that hang into a failure.
        step, steps = llm.engine.step, [0]

        def bounded_step():
            steps[0] += 1
            if steps[0] > MAX_ENGINE_STEPS:
                raise AssertionError(f"no end after {MAX_ENGINE_STEPS} engine steps: {llm.stats()}")
            return step()

        llm.engine.step = bounded_step
        return llm

    return make


@pytest.fixture(scope="session")
def solo_run(oracle_llm):
    """The serial reference: solo_run(prompt_ids, params, **flags) runs one request alone on a fresh
    one-at-a-time, synchronous engine (max_concurrency 1, no async scheduling) and returns its
    RequestOutput."""

    def run(prompt, params, **flags):
        llm = oracle_llm(**(flags | {"max_concurrency": 1, "async_scheduling": False}))
        (out,) = llm.generate([list(prompt)], params)
        stats = llm.stats()
        assert stats["kv_pages_free"] + stats["kv_pages_in_images"] == stats["kv_pages_total"]
        assert stats["state_slots_free"] == stats["state_slots_total"]
        return out

    return run
