"""The `nextserve` command line. Subcommands: serve (others are added beside it).

Every EngineConfig field is a `nextserve serve` flag of the same name with dashes for underscores (C3);
the flags are generated from the dataclass, so a new engine field is a new flag without a change here.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from collections.abc import Callable

from .config import ConfigError
from .engine_config import DEFAULT_MODEL, DEFAULT_MODEL_NAME, EngineConfig

# Help for engine flags; a field missing here still gets a flag, with a generic help line.
ENGINE_FLAG_HELP: dict[str, str] = {
    "model": "model directory (Hugging Face layout: config.json, *.safetensors, tokenizer); "
    "default: the small Flash-Next embedded in the package",
    "dtype": "weights and activations: auto (bfloat16 on cuda, float32 on cpu), bfloat16, float16, float32 "
    "or float64",
    "device": "auto, cpu, cuda or cuda:N",
    "prefill_chunk": "prompt tokens per prefill step; prefix-cache snapshots lie on this grid",
    "max_concurrency": "most sequences running at once (recurrent-state slots); auto: on a GPU as many as "
    "the state slots can take in half the memory left after the weights and one sequence of KV, at most 64 "
    "(the start-up memory table names the count); 16 on the CPU and with pipeline stages",
    "kv_capacity": "tokens in the shared paged KV pool, or auto (from free memory)",
    "max_context": "most tokens (prompt + output) per sequence; default: the model's max_position_embeddings",
    "page_size": "tokens per KV page",
    "max_pending": "most requests waiting for admission; more are answered 503 with Retry-After",
    "memory_headroom_mib": "GPU memory left free when sizing the KV pool automatically",
    "cpu_kv_budget_mib": "KV pool size on the CPU when kv_capacity is auto",
    "seed": "engine seed for requests that give none",
    "prefix_cache": "prefix reuse: a prompt resumes from the longest stored prefix image (--no-prefix-cache: "
    "every prompt is prefilled from its first token)",
    "prefix_cache_images": "sequence images kept for prefix reuse (0: off; auto: as many as 1/8 of the KV "
    "pool's memory holds, at most 64, taken out of the pool): a prompt resumes from the longest stored "
    "prefix on the --prefill-chunk grid (each prompt's last boundary, and the boundary before its last "
    "message), exactly as a cold run; unused images give way when pages run short",
    "prefix_anchor_chunks": "with --prefix-cache-images: also keep an image every N chunks of long prompts "
    "(0: none)",
    "quantization": "auto: weights as the checkpoint stores them (block-wise FP8 ones stay FP8, read by the "
    "FP8 kernels; W4A16 ones stay int4); fp8: also quantize a plain checkpoint's projections and experts "
    "block-wise on load; int4: quantize them to 4 bits on load (round-to-nearest, symmetric, groups of 128); "
    "none: dequantize a quantized checkpoint to --dtype on load",
    "kv_dtype": "the KV cache's form: auto or bf16 (the model dtype), int8 or fp8 (a byte a value, an "
    "integer or an E4M3 value, and a float32 scale per token and head, and per indexer block: half the KV "
    "memory of bf16; outputs are exact among modes of one KV dtype, not equal to 16-bit KV's; fp8 needs a "
    "GPU of sm_89 or newer, or the CPU)",
    "ple_table": "where the PLE n-gram table lives (51B parameters in the released model): device, host "
    "(pinned host memory, its rows read by a kernel over the bus, so decode steps stay CUDA graphs), or auto "
    "(host when the device has no room for it)",
    "skip_tokenizer": "serve without a tokenizer: prompts are token ids, answers carry token ids and no text "
    "(a model directory without a tokenizer needs this flag)",
    "host_state_slots": "prefix images kept in host memory when the device keeps no more (0: off; auto: 64 "
    "when prefix reuse is on and the host has twice --host-kv-mib available); a prompt resumes from them "
    "as from device images (the copies run beside the engine: a copy stream moves the bytes into host "
    "memory locked once at start)",
    "warm_up": "compile every kernel specialisation a request can meet at start (prefill chunks from "
    "position 0 and from an image, of each length class), before /health says ready; GPU only "
    "(--no-warm-up: skip)",
    "compile_cache_dir": "directory for Triton's compiled kernels (default: Triton's own, ~/.triton/cache): "
    "a restart with the same directory compiles nothing",
    "host_kv_mib": "host memory (MiB) for the host image store and the copies of preempted sequences "
    "(these first: images give way to them); on a GPU it is page-locked once at start when the host has "
    "twice that available",
    "cuda_graph": "replay each decode step (and, when speculating, each step's verify windows) as a "
    "CUDA graph per batch-size bucket (GPU only; --no-cuda-graph runs the same kernels eagerly)",
    "speculative_method": "off; ngram: propose draft tokens by looking the last 3 (then 2) tokens up "
    "earlier in the sequence; mtp: draft with the model's MTP block (needs mtp.* weights). Drafts are "
    "checked by one verify window (outputs unchanged)",
    "speculative_tokens": "most draft tokens per verify window (1..32)",
    "pipeline_stages": "split the layers into this many contiguous ranges, one process each (on CUDA, one "
    "GPU each), activations passed stage to stage bit for bit (with mtp speculation the MTP block runs on "
    "the last stage)",
    "pipeline_devices": "CUDA device indices of the stages, comma-separated, one per stage (e.g. 1,0); "
    "default: consecutive from --device's index (cuda: 0,1,...)",
    "experts": "where the routed experts live: device, host (pinned host memory the GPU kernels read over "
    "the bus, for cards too small for them; the same outputs), or auto (host when the memory plan says they "
    "do not fit on the device)",
    "expert_cache_gib": "device memory (GiB) for a cache of the routed experts held in host memory, filled "
    "with the experts the routing uses most (the same outputs); 0: none; auto: what the device has left "
    "after the weights, the state slots, the headroom and one sequence of --max-context tokens of KV, up to "
    "every expert (none on the CPU)",
    "gpu_memory_gib": "act as if the GPU had this many GiB: the memory plan and the KV pool are sized from "
    "it and torch's allocator is capped at it (to reproduce a smaller card's run on a bigger one; one "
    "process); default: the GPU's own memory",
    "stage_layers": "decoder layers of each stage, comma-separated, one count per stage, adding up to the "
    "model's layers (e.g. 8,8,8,8,16 for a big card last), or auto (in proportion to --stage-memory-gib); "
    "default: as even as can be",
    "stage_memory_gib": "each stage's GPU memory cap in GiB, comma-separated, one per stage (e.g. "
    "24,12,12,12,12 to play a rig of unequal cards on one GPU): each stage process's allocator is capped at "
    "it and the KV pool is sized to fit the tightest; default: no caps",
    "decode_groups": "with pipeline stages: split each step's decoding requests into this many round-robin "
    "groups that circulate through the stages, each group's next token sent in as soon as it is sampled, "
    "up to this many tokens a step, so every stage works (outputs unchanged)",
    "pipeline_prefill_chunks": "with pipeline stages: a prompt's chunks one step sends in, each passed on as "
    "soon as a stage is done with it, so chunk i+1 runs on stage 0 while chunk i is on stage 1 (auto: one "
    "per stage; 1: the stages take turns); outputs unchanged",
    "prefill_chunks_beside_decodes": "prompt chunks a step runs at most while it also decodes, so running "
    "decodes wait one chunk's forward for a long prompt, not a whole batch of chunks (the prompt's outputs "
    "are the same; its TTFT grows); auto: 1 in one process, with pipeline stages all of a step's",
    "prefill_batch_chunks": "one process: prompt chunks one step runs in one forward, of one prompt or of "
    "several (a prompt's run stops at its next prefix image point; chunks of equal length go together): "
    "each chunk computed exactly as alone, except that their routed experts run as one grouped call, so each "
    "expert's weights are read once for all of them (outputs unchanged; a longer step delays the decodes "
    "beside it)",
    "head_embedding": "with pipeline stages and mtp speculation: where the last stage's MTP block reads the "
    "token embeddings (stage 0 holds the model's table): device, a second copy in the last stage's GPU "
    "memory; host, one pinned host copy read over the bus by a kernel (zero-copy), saving that GPU the "
    "table (vocab x hidden)",
    "pipeline_windows": "with pipeline stages and mtp speculation: while the last stage verifies a request "
    "decoding alone, the front stages run the window the MTP block guesses comes next (its chain then 2k+1 "
    "long) on a shadow copy of their state; committed when the whole window held and its next token is the "
    "guessed one, else dropped (outputs unchanged; counts in stats and /metrics)",
    "stage_transport": "how activations cross stages: nccl (GPU to GPU), host (through pinned host memory "
    "over Gloo, for GPUs without peer access), shm (every message between stages through rings in "
    "/dev/shm, no socket: stages on one machine, x86-64), or auto (nccl on CUDA with a GPU per stage, shm "
    "where stages share a GPU, host on the CPU)",
    "pdl": "launch the Triton kernels with programmatic dependent launch, so each one's start overlaps "
    "the previous one's end (sm_90+ GPUs; same outputs either way; --no-pdl turns it off)",
    "async_scheduling": "launch each step of greedy decodes (no logprobs, no grammar, not speculating, one "
    "process) before reading the previous step's tokens, which stay on the device, so the GPU never "
    "waits for the host between steps (same outputs either way; --no-async-scheduling turns it off)",
}


def _scalar(kind: str) -> Callable[[str], object]:
    def parse(text: str) -> object:
        if kind == "int":
            return int(text)
        if kind == "float":
            return float(text)
        return text

    return parse


def _engine_flag_parser(hint: object, default: object) -> dict:
    """argparse keyword arguments for one EngineConfig field of type `hint`."""
    args = typing.get_args(hint)
    kinds = {a for a in args if a is not type(None)} if args else {hint}
    if kinds == {bool}:
        return {"action": argparse.BooleanOptionalAction}
    if kinds == {int}:
        return {"type": int, "metavar": "N"}
    if kinds == {float}:
        return {"type": float, "metavar": "X"}
    if kinds == {str}:
        return {"type": str}
    if kinds == {int, str}:
        # An integer, or a keyword such as "auto".
        def int_or_word(text: str) -> int | str:
            try:
                return int(text)
            except ValueError:
                return text

        return {"type": int_or_word, "metavar": f"N|{default}" if isinstance(default, str) else "N|WORD"}
    if kinds == {float, str}:
        # A number, or a keyword such as "auto".
        def number_or_word(text: str) -> float | str:
            try:
                return float(text)
            except ValueError:
                return text

        return {"type": number_or_word, "metavar": f"X|{default}" if isinstance(default, str) else "X|WORD"}
    return {"type": str}


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field; unset flags keep the dataclass defaults."""
    hints = typing.get_type_hints(EngineConfig)
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineConfig):
        default = None if f.default is dataclasses.MISSING else f.default
        kwargs = _engine_flag_parser(hints[f.name], default)
        help_text = ENGINE_FLAG_HELP.get(f.name, f"engine setting {f.name}")
        if default is not None and f.name != "model":
            help_text += f" (default: {default})"
        group.add_argument(
            "--" + f.name.replace("_", "-"),
            dest=f.name,
            default=argparse.SUPPRESS,
            help=help_text,
            **kwargs,
        )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    given = {k: v for k, v in vars(args).items() if k in names}
    return EngineConfig(**given)


def _serve_parser(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model over the OpenAI API",
        description="Serve a model over the OpenAI-compatible HTTP API (/v1/chat/completions, "
        "/v1/completions, /v1/models, /health, /metrics).",
    )
    server = p.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    server.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    server.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on /v1 routes (default: none; a key on the command line "
        "is visible in `ps`: prefer --api-key-file)",
    )
    server.add_argument(
        "--reasoning",
        choices=("on", "off"),
        default="on",
        help="on: the model thinks where its chat template lets it, and <think> content is returned apart "
        "(reasoning_content, thinking blocks); off: the template's enable_thinking is false unless a request "
        "sets chat_template_kwargs.enable_thinking (default: on)",
    )
    server.add_argument(
        "--tool-call-format",
        choices=("auto", "json", "xml"),
        default="auto",
        help="the form a tool call is constrained to (tool_choice required or named): json, "
        '`<tool_call>{"name": ..., "arguments": ...}</tool_call>`; xml, Qwen3-Coder\'s '
        "`<tool_call><function=NAME><parameter=ARG>...`; auto: the form the chat template renders (xml "
        "when it writes <function=). Answers are parsed in both forms either way (default: auto)",
    )
    server.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help="read the API keys from PATH, one a line; each key is a tenant with a prefix cache of its own "
        "(default: none)",
    )
    server.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients send (default: the --model value; nextserve-default for the "
        "embedded model)",
    )
    server.add_argument(
        "--keepalive-interval",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds of quiet (a long prefill) after which a stream gets a `: keep-alive` comment "
        "(default: 5)",
    )
    server.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="on SIGINT/SIGTERM, seconds in-flight requests may take to finish before they are aborted "
        "(default: 30)",
    )
    server.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log level (default: info: one JSON line per request)",
    )
    _add_limit_flags(p)
    add_engine_flags(p)
    p.set_defaults(func=_run_serve)


# (flag, ServerLimits field, type, metavar, help): `nextserve serve`'s request limits
_LIMIT_FLAGS = (
    ("--max-request-mib", "max_request_mib", float, "MIB",
     "request bodies larger than this are answered 413"),
    ("--max-schema-depth", "max_schema_depth", int, "N",
     "deepest nesting of a JSON schema's objects and arrays"),
    ("--max-schema-nodes", "max_schema_nodes", int, "N",
     "most compile-cost nodes (objects, arrays, properties, enum values, $ref expansions) in the JSON "
     "schemas one request compiles into a grammar (guided_json, response_format, forced tools)"),
    ("--max-grammar-bytes", "max_grammar_bytes", int, "N",
     "largest guided_regex, guided_grammar or guided_choice list"),
    ("--grammar-timeout", "grammar_timeout_s", float, "S",
     "a grammar compile that runs longer is answered 400 (and its worker process killed)"),
    ("--grammar-memory-mib", "grammar_memory_mib", float, "MIB",
     "the most memory a grammar compile may take (it is tried first in a worker process of that bound)"),
)  # fmt: skip


def _add_limit_flags(p: argparse.ArgumentParser) -> None:
    from .server.limits import DEFAULT_LIMITS

    limits = p.add_argument_group("request limits")
    for flag, name, kind, metavar, text in _LIMIT_FLAGS:
        default = getattr(DEFAULT_LIMITS, name)
        help_text = f"{text} (default: {default:g})"
        limits.add_argument(flag, type=kind, default=default, metavar=metavar, dest=name, help=help_text)


def _api_key(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str | tuple[str, ...] | None:
    """--api-key, or the keys of --api-key-file: one a line, each a tenant (its own prefix cache)."""
    if args.api_key_file is None:
        return args.api_key
    if args.api_key is not None:
        parser.error("give --api-key or --api-key-file, not both")
    try:
        with open(args.api_key_file, encoding="utf-8") as f:
            keys = tuple(line.strip() for line in f)
    except OSError as exc:
        parser.error(f"--api-key-file: {exc}")
    if not keys or not keys[0]:
        parser.error(f"--api-key-file {args.api_key_file}: the first line is empty")
    return tuple(k for k in keys if k)


def _run_serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .server.limits import ServerLimits

    if args.port < 0 or args.port > 65535:
        parser.error(f"--port must be in 0..65535, got {args.port}")
    if args.keepalive_interval <= 0 or args.shutdown_timeout < 0:
        parser.error("--keepalive-interval must be > 0 and --shutdown-timeout >= 0")
    api_key = _api_key(args, parser)
    try:
        config = engine_config_from_args(args)
        limits = ServerLimits(**{name: getattr(args, name) for _, name, *_ in _LIMIT_FLAGS})
    except (ConfigError, TypeError, ValueError) as exc:
        parser.error(str(exc))
    from .server.lifecycle import serve

    try:
        code = serve(
            config,
            host=args.host,
            port=args.port,
            api_key=api_key,
            served_model_name=args.served_model_name
            or (DEFAULT_MODEL_NAME if config.model == DEFAULT_MODEL else None),
            keepalive_s=args.keepalive_interval,
            shutdown_timeout_s=args.shutdown_timeout,
            log_level=args.log_level,
            limits=limits,
            reasoning=args.reasoning == "on",
            tool_call_format=args.tool_call_format,
        )
    except ConfigError as exc:
        print(f"nextserve serve: error: {exc}", file=sys.stderr)
        return 2
    return code


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate from one prompt and stream the text to stdout")
    add_engine_flags(p)
    p.add_argument("--prompt", required=True, help="the prompt text (a user message with --chat)")
    p.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate (default: 128)")
    p.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy (default: 0)"
    )
    p.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus sampling: keep this much probability (default: 1)"
    )
    p.add_argument(
        "--top-k", type=int, default=-1, help="sample among the k likeliest tokens; -1: all (default: -1)"
    )
    p.add_argument(
        "--chat", action="store_true", help="wrap the prompt in the model's chat template (default: off)"
    )
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .engine.engine import LLMEngine
    from .engine.sampling import SamplingParams

    engine = None
    try:
        engine = LLMEngine(engine_config_from_args(args))
        prompt = args.prompt
        if args.chat:
            tok = engine.tokenizer
            if tok is None or not getattr(tok, "chat_template", None):
                parser.error("--chat: this model directory has no chat template")
            msgs = [{"role": "user", "content": prompt}]
            prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
            top_k=args.top_k, seed=getattr(args, "seed", None),  # --seed is the engine flag
        )  # fmt: skip
        engine.add_request(prompt, params, "cli")
    except (ConfigError, ValueError) as exc:
        if engine is not None:
            engine.close()
        print(f"nextserve generate: {exc}", file=sys.stderr)
        return 2
    shown = ""
    try:
        while engine.has_unfinished():
            for out in engine.step():
                sys.stdout.write(out.text[len(shown) :])
                sys.stdout.flush()
                shown = out.text
                if out.finished and out.finish_reason == "error":
                    print(f"\nnextserve generate: {out.error}", file=sys.stderr)
                    return 1
        sys.stdout.write("\n")
        return 0
    finally:
        engine.close()  # pipeline stages stopped in order, not left to see a closed socket


def _make_model_parser(sub) -> None:
    from .model.presets import PRESETS

    p = sub.add_parser("make-model", help="write a random checkpoint in Hugging Face layout")
    p.add_argument(
        "--preset", required=True, choices=sorted(PRESETS),
        help="tiny (446K parameters), small, or flash-next (the released widths)",
    )  # fmt: skip
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: 0)")
    p.add_argument(
        "--layout", choices=["text", "multimodal"], default="text",
        help="text: transformers' Qwen4ExpForCausalLM names (model.*); multimodal: the released layout "
        "(model.language_model.*, a tiny vision tower) (default: text)",
    )  # fmt: skip
    p.add_argument("--no-mtp", action="store_true", help="leave out the mtp.* weights (default: written)")
    p.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
        help="dtype of the written tensors; bfloat16 halves a flash-next checkpoint (default: float32)",
    )  # fmt: skip
    p.add_argument(
        "--layers", type=int, default=None, metavar="N",
        help="N decoder layers in Flash-Next's pattern (QSA at i %% 4 == 3) (default: the preset's)",
    )  # fmt: skip
    p.add_argument(
        "--ngram-vocab-base", type=int, default=None, metavar="B",
        help="PLE n-gram rows per head before rounding up to primes, ngram_vocab_size_base (default: the "
        "preset's; the released model's is 20000000)",
    )  # fmt: skip
    p.add_argument(
        "--quantization", choices=["fp8", "int4"], default=None,
        help="fp8: write the projections and experts block-wise FP8 (E4M3, 128 x 128 blocks, "
        "weight_scale_inv), as Qwen's FP8 releases ship; int4: W4A16 in compressed-tensors' pack-quantized "
        "format, as llm-compressor writes it (round-to-nearest, symmetric) (default: none)",
    )  # fmt: skip
    p.add_argument(
        "--group-size", type=int, default=128, metavar="G",
        help="with --quantization int4: input columns that share a scale (default 128; it must divide every "
        "quantized weight's input dimension: the small presets need 32 or 16)",
    )  # fmt: skip
    p.set_defaults(func=_run_make_model)


def _run_make_model(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from pathlib import Path

    import torch

    from .model.make_model import make_model
    from .model.presets import preset_overrides

    try:
        overrides = preset_overrides(args.preset, args.layers, args.ngram_vocab_base)
    except ValueError as exc:
        parser.error(str(exc))
    out = make_model(
        args.preset, Path(args.out), seed=args.seed, layout=args.layout, with_mtp=not args.no_mtp,
        overrides=overrides, dtype=getattr(torch, args.dtype), quantization=args.quantization,
        group_size=args.group_size,
    )  # fmt: skip
    print(out)
    return 0


def _bench_parser(sub) -> None:
    from . import bench

    p = sub.add_parser(
        "bench",
        help="benchmark prefill, decode, memory, energy and the roofline (JSON on stdout)",
        description=bench.__doc__.split("\n\n")[0],
    )
    bench.add_arguments(p)
    p.set_defaults(func=lambda args, parser: bench.run_from_args(args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nextserve", description="Inference server for Flash-Next models")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _serve_parser(sub)
    _generate_parser(sub)
    _make_model_parser(sub)
    _bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from .runtime.stage_launch import torchrun_rank

    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    run = torchrun_rank()
    if run is not None and args.command in ("serve", "generate"):
        # NOTE: under torchrun every rank runs this same command: rank 0 serves, the others are its stages
        stages = getattr(args, "pipeline_stages", 1)
        if stages != run[1]:
            print(
                f"nextserve {args.command}: under torchrun each rank runs one pipeline stage: "
                f"--pipeline-stages is {stages} with {run[1]} ranks (give --pipeline-stages {run[1]})",
                file=sys.stderr,
            )
            return 2
        if run[0] > 0:
            from .runtime.stage_main import torchrun_stage

            return torchrun_stage()
    sub_parser = parser._subparsers._group_actions[0].choices[args.command]  # type: ignore[union-attr]
    return args.func(args, sub_parser)


if __name__ == "__main__":
    sys.exit(main())
