"""Claude Code and Codex themselves, installed from npm, each pointed at `nextserve serve` with its own
documented settings for a custom endpoint, run one non-interactive task: each must end with the client's own
success event, and the server's log must hold no 4xx or 5xx.

Network: installing the clients reaches the npm registry (once: they are kept in ~/.cache/nextserve/); the
clients then talk only to the server on 127.0.0.1 (their telemetry and updates are turned off). The test
skips where npm is not installed. By hand, the same: README, "Agent clients".

The served model is the embedded default model with one change to its generation_config.json: every token
holding a newline is an end token, so each answer is one line (this 17M model otherwise writes thousands of
tokens of Python before it stops, minutes on a CPU). The clients' prompts are the real ones: Claude Code's
about 25,700 tokens, Codex's about 11,800."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from live_server import wait_healthy
from tokenizers import Tokenizer

from nextserve.engine_config import DEFAULT_MODEL

pytestmark = pytest.mark.slow

CLIENTS = {"@anthropic-ai/claude-code": "2.1.197", "@openai/codex": "0.171.0"}
CACHE = Path.home() / ".cache" / "nextserve" / "agent-clients"
NAME = "nextserve-default"


@pytest.fixture(scope="module")
def clients() -> Path:
    """The clients' node_modules/.bin, installed once into the cache."""
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed: the agent clients come from the npm registry")
    tag = "-".join(f"{name.split('/')[-1]}{version}" for name, version in CLIENTS.items())
    root = CACHE / tag
    bin_dir = root / "node_modules" / ".bin"
    if not (bin_dir / "claude").exists() or not (bin_dir / "codex").exists():
        root.mkdir(parents=True, exist_ok=True)
        specs = [f"{name}@{version}" for name, version in CLIENTS.items()]
        done = subprocess.run([npm, "install", "--prefix", str(root), "--no-audit", "--no-fund", *specs],
                              capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
    return bin_dir


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> dict:
    """`nextserve serve` as a user starts it, on the default model whose answers end at a newline."""
    model = tmp_path_factory.mktemp("agents") / "model"
    shutil.copytree(DEFAULT_MODEL, model)
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    lines = [i for i in range(tok.get_vocab_size()) if "\n" in tok.decode([i])]
    gen = json.loads((model / "generation_config.json").read_text())
    gen["eos_token_id"] = [gen["eos_token_id"], *lines]
    (model / "generation_config.json").write_text(json.dumps(gen))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = model.parent / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "nextserve.cli", "serve", "--model", str(model),
             "--served-model-name", NAME, "--port", str(port), "--log-level", "info"],
            stdout=out, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        try:
            wait_healthy(proc, port)
            yield {"port": port, "log": log, "home": model.parent}
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def _statuses(log: Path) -> list[int]:
    out = []
    for line in log.read_text().splitlines():
        if "nextserve.requests" in line and '"event": "request"' in line:
            out.append(json.loads(line[line.index("{") :])["status"])
    return out


def _run(argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "TERM")}
    return subprocess.run(argv, env=base | env, cwd=cwd, capture_output=True, text=True, timeout=900,
                          stdin=subprocess.DEVNULL, check=False)  # fmt: skip


def test_claude_code_prints_a_successful_result(clients, served) -> None:
    home = served["home"] / "claude-home"
    home.mkdir(exist_ok=True)
    env = {"HOME": str(home), "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{served['port']}",
           "ANTHROPIC_API_KEY": "local", "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1",
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}  # fmt: skip
    done = _run(
        [str(clients / "claude"), "-p", "Say hi", "--output-format", "stream-json", "--verbose"], env, home
    )
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert events, done.stderr[-3000:]
    result = events[-1]
    assert result["type"] == "result" and result["subtype"] == "success", result
    assert result["is_error"] is False, result
    statuses = _statuses(served["log"])
    assert statuses and all(s < 400 for s in statuses), statuses


def test_codex_completes_its_turn(clients, served) -> None:
    home = served["home"] / "codex-home"
    home.mkdir(exist_ok=True)
    (home / "config.toml").write_text(
        f'model = "{NAME}"\nmodel_provider = "nextserve"\n\n[model_providers.nextserve]\nname = "nextserve"\n'
        f'base_url = "http://127.0.0.1:{served["port"]}/v1"\nwire_api = "responses"\n'
    )
    env = {"HOME": str(home), "CODEX_HOME": str(home)}
    done = _run([str(clients / "codex"), "exec", "--skip-git-repo-check", "--json", "Say hi"], env, home)
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    kinds = [e["type"] for e in events]
    assert done.returncode == 0 and "turn.completed" in kinds and "turn.failed" not in kinds, (
        kinds, done.stderr[-3000:])  # fmt: skip
    statuses = _statuses(served["log"])
    assert statuses and all(s < 400 for s in statuses), statuses
