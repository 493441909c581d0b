"""Train the embedded default model (`tools/train_default_model.py`): a small Flash-Next with every
layer type, and its MTP block trained jointly on the next-next token, on the stdlib (train/data.py)."""

from __future__ import annotations

import json
import math
import os
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ..config import GDN, QSA, ModelConfig
from ..model.presets import BASE_FIELDS, full_config
from ..model.tokenizer_build import ENDOFTEXT, IM_END, build_tokenizer
from . import data
from .checkpoint import write_checkpoint
from .model import FlashNextLM, init_weights, runtime_state

_ROPE = {
    "rope_type": "default",
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.5,
    "mrope_section": [3, 3, 2],
    "mrope_interleaved": True,
}

# Model text-config fields and training settings of each setting.
SETTINGS: dict[str, dict] = {
    # ~17M parameters (34 MB in bf16): 6 GDN + 2 QSA layers, PLE on GDN layer 2, 8 experts + shared,
    # QSA budget 64 tokens (16 blocks of 4), 4 hyper-connection streams, MTP.
    "default": {
        "model": BASE_FIELDS
        | {
            "vocab_size": 8192,
            "hidden_size": 256,
            "num_hidden_layers": 8,
            "layer_types": [QSA if i % 4 == 3 else GDN for i in range(8)],
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "rope_parameters": _ROPE,
            "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 64,
            "linear_value_head_dim": 64,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "max_position_embeddings": 65536,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 128,
            "shared_expert_intermediate_size": 256,
            "hc_count": 4,
            "hc_lowrank": 16,
            "ple_layer_ids": [2],
            "ple_embed_dim": 128,
            "heads_per_ngram": 4,
            "ngram_vocab_size_base": 4001,
            "make_ngram_vocab_size_divisible_by": 4,
            "split_ngram_parts": 1,
            "indexer_n_heads": 2,
            "indexer_head_dim": 64,
            "indexer_budget": 64,
            "indexer_compress_ratio": 4,
        },
        "seq_len": 512,
        "batch": 32,
        "lr": 2e-3,
        "warmup": 100,
        "tokenizer_chars": 6_000_000,
        "max_files": None,
        "val_windows": 64,
    },
    # The same layer kinds at toy size, for a CPU in a couple of minutes.
    "smoke": {
        "model": BASE_FIELDS
        | {
            "vocab_size": 1024,
            "hidden_size": 64,
            "num_hidden_layers": 4,
            "layer_types": [GDN, GDN, GDN, QSA],
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "rope_parameters": _ROPE,
            "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "max_position_embeddings": 4096,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 64,
            "hc_count": 4,
            "hc_lowrank": 8,
            "ple_layer_ids": [2],
            "ple_embed_dim": 32,
            "heads_per_ngram": 2,
            "ngram_vocab_size_base": 1009,
            "make_ngram_vocab_size_divisible_by": 4,
            "split_ngram_parts": 1,
            "indexer_n_heads": 2,
            "indexer_head_dim": 16,
            "indexer_budget": 16,
            "indexer_compress_ratio": 4,
        },
        "seq_len": 128,
        "batch": 8,
        "lr": 3e-3,
        "warmup": 20,
        "tokenizer_chars": 300_000,
        "max_files": 150,
        "val_windows": 8,
    },
}

MTP_WEIGHT = 0.3
BALANCE_WEIGHT = 0.01
INDEXER_WEIGHT = 0.1
CHAT_FRACTION = 0.3
CALIBRATE_STEPS = 20  # with steps "auto", the step count is fixed after this many (all inside warmup)


def _log(msg: str) -> None:
    print(msg, flush=True)


class Batches:
    """Deterministic windows of seq_len+1 tokens: code windows at random offsets of the file stream,
    chat windows starting at a conversation's first token."""

    def __init__(self, code: torch.Tensor, chat: torch.Tensor, chat_starts: torch.Tensor, T: int, seed: int):
        self.code, self.chat, self.chat_starts, self.T = code, chat, chat_starts, T
        self.gen = torch.Generator().manual_seed(seed)

    def next(self, B: int) -> torch.Tensor:
        T = self.T + 1
        is_chat = torch.rand(B, generator=self.gen) < CHAT_FRACTION
        code_off = torch.randint(0, self.code.numel() - T, (B,), generator=self.gen)
        pick = torch.randint(0, self.chat_starts.numel(), (B,), generator=self.gen)
        chat_off = self.chat_starts[pick].clamp_max(self.chat.numel() - T)
        rows = []
        for b in range(B):
            src, off = (self.chat, chat_off[b]) if is_chat[b] else (self.code, code_off[b])
            rows.append(src[off : off + T])
        return torch.stack(rows)


def losses(lm: FlashNextLM, ids: torch.Tensor, aux: dict | None) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [B, T+1] -> (next-token CE over T rows, MTP next-next-token CE over T-1 rows)."""
    x, y = ids[:, :-1], ids[:, 1:]
    logits, mtp_logits = lm(x, aux)
    V = logits.shape[-1]
    main = F.cross_entropy(logits.float().reshape(-1, V), y.reshape(-1))
    mtp = F.cross_entropy(mtp_logits.float().reshape(-1, V), ids[:, 2:].reshape(-1))
    return main, mtp


@torch.no_grad()
def evaluate(lm: FlashNextLM, val: torch.Tensor, T: int, windows: int, B: int, amp) -> dict[str, float]:
    lm.eval()
    n = min(windows, (val.numel() - 1) // T)
    tot_main = tot_mtp = 0.0
    for s in range(0, n, B):
        rows = torch.stack([val[i * T : i * T + T + 1] for i in range(s, min(n, s + B))])
        with amp():
            main, mtp = losses(lm, rows, None)
        tot_main += main.item() * rows.shape[0]
        tot_mtp += mtp.item() * rows.shape[0]
    lm.train()
    return {"val_loss": tot_main / n, "val_mtp_loss": tot_mtp / n, "val_windows": n}


def train(
    out_dir: Path,
    setting: str = "default",
    device: str = "cpu",
    seed: int = 0,
    steps: int | None = None,
    minutes: float = 9.0,
) -> dict:
    """Train and write a model directory to out_dir. steps=None: fix the step count after
    CALIBRATE_STEPS so training takes about `minutes`; the count used is logged, and passing it as
    `steps` reproduces the run (same seed, same hardware and software)."""
    t_start = time.time()
    st = SETTINGS[setting]
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    random.seed(seed)
    torch.manual_seed(seed)
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    train_files, val_files = data.split_files()
    if st["max_files"]:
        train_files = train_files[:: max(1, len(train_files) // st["max_files"])][: st["max_files"]]
        val_files = val_files[:4]
    _log(f"files: {len(train_files)} train, {len(val_files)} held out")
    build_tokenizer(
        data.tokenizer_texts(train_files, st["tokenizer_chars"]), st["model"]["vocab_size"], out_dir
    )
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
    eot = tok.token_to_id(ENDOFTEXT)
    code, _ = data.encode_stream(tok, [t for _, t in train_files], eot)
    chats = data.chat_examples(train_files, seed)
    chat, chat_starts = data.encode_stream(tok, chats, None)
    val, _ = data.encode_stream(tok, [t for _, t in val_files], eot)
    _log(f"tokens: code {len(code)}, chat {len(chat)} ({len(chats)} conversations), val {len(val)}")
    t_data = time.time() - t_start

    text = dict(st["model"]) | {"eos_token_id": tok.token_to_id(IM_END)}
    cfg = ModelConfig.from_dict(full_config(text, "text", torch.float32))
    lm = FlashNextLM(cfg)
    init_weights(lm, seed)
    lm.to(dev)
    n_params = sum(p.numel() for p in lm.parameters())
    _log(f"parameters: {n_params} ({n_params * 2 / 2**20:.1f} MiB in bf16)")
    decay = [p for n, p in lm.named_parameters() if p.dim() >= 2 and "embed" not in n and "ngram" not in n]
    no_decay = [
        p for n, p in lm.named_parameters() if not (p.dim() >= 2 and "embed" not in n and "ngram" not in n)
    ]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=st["lr"],
        betas=(0.9, 0.95),
        eps=1e-8,
    )

    def amp():
        if dev.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return torch.autocast("cpu", enabled=False)

    batches = Batches(
        torch.tensor(code).to(dev), torch.tensor(chat).to(dev), torch.tensor(chat_starts), st["seq_len"], seed
    )
    val_t = torch.tensor(val).to(dev)
    total = steps
    warm = st["warmup"]
    history = []
    t_train = time.time()
    step = 0
    t_cal = None
    while total is None or step < total:
        if total is None and step == 3:
            t_cal = time.time()
        if total is None and step == CALIBRATE_STEPS:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            per = (time.time() - t_cal) / (CALIBRATE_STEPS - 3)
            total = max(warm + 1, int((minutes * 60 - (time.time() - t_train)) / per) + step)
            _log(f"calibrated: {per * 1000:.0f} ms/step -> {total} steps")
        lr_scale = (step + 1) / warm if step < warm else None
        if lr_scale is None:
            prog = (step - warm) / max(1, total - warm)
            lr_scale = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, prog)))
        for group in opt.param_groups:
            group["lr"] = st["lr"] * lr_scale
        ids = batches.next(st["batch"])
        aux: dict = {}
        with amp():
            main, mtp = losses(lm, ids, aux)
            loss = main + MTP_WEIGHT * mtp + BALANCE_WEIGHT * aux["balance"] + INDEXER_WEIGHT * aux["indexer"]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(lm.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 50 == 0 or step == 1 or step == total:
            rec = {
                "step": step,
                "loss": round(main.item(), 4),
                "mtp_loss": round(mtp.item(), 4),
                "balance": round(float(aux["balance"]), 4),
                "indexer_kl": round(float(aux["indexer"]), 4),
                "lr": opt.param_groups[0]["lr"],
                "elapsed_s": round(time.time() - t_train, 1),
            }
            history.append(rec)
            _log(json.dumps(rec))
    if dev.type == "cuda":
        torch.cuda.synchronize()
    train_s = time.time() - t_train
    ev = evaluate(lm, val_t, st["seq_len"], st["val_windows"], st["batch"], amp)
    _log(json.dumps(ev))
    lm.cpu()
    write_checkpoint(runtime_state(lm), text, out_dir, torch.bfloat16)
    summary = {
        "setting": setting,
        "seed": seed,
        "steps": total,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "python_stdlib": data.sysconfig.get_paths()["stdlib"],
        "parameters": n_params,
        "tokens_per_step": st["batch"] * st["seq_len"],
        "data_prep_s": round(t_data, 1),
        "train_s": round(train_s, 1),
        "train_tokens": {"code": len(code), "chat": len(chat), "val": len(val)},
        "final": history[-1] if history else None,
        **ev,
        "history": history,
    }
    (out_dir / "training_log.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
