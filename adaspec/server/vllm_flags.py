"""vLLM `serve` flags that `adaspec serve` takes too, so a vLLM command line runs unchanged.

Flags with an effect (server behaviour, vLLM's meaning):
  --enable-prompt-tokens-details   usage.prompt_tokens_details.cached_tokens (prefix-cache hits)
  --return-tokens-as-token-ids     logprob tokens spelled "token_id:<id>" unless a request says otherwise
  --response-role ROLE             the role of chat answers (default assistant)
  --reasoning-parser NAME          a chat answer's <think> text as reasoning_content (server/reasoning.py)
Flags accepted because adaspec already behaves as they ask (their help says why):
  --trust-remote-code, --enable-auto-tool-choice, --enable-chunked-prefill,
  --disable-log-requests / --enable-log-requests
Flags with one value adaspec supports (any other is an error naming it):
  --kv-cache-dtype auto, --pipeline-parallel-size 1, --no-enable-chunked-prefill refused,
  --quantization: only the method the checkpoint's config.json declares (models/quantized.py)
"""
from __future__ import annotations

import argparse


def add_vllm_serve_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("vLLM compatibility")
    g.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="report usage.prompt_tokens_details.cached_tokens (prompt tokens served by the prefix cache)")
    g.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="spell logprob tokens as 'token_id:<id>' (a request's own field wins)")
    g.add_argument("--response-role", default="assistant", help="role of chat answers (default: assistant)")
    g.add_argument("--reasoning-parser", choices=["deepseek_r1", "qwen3", "glm45"], default=None,
                   help="put a chat answer's <think> text in reasoning_content (server/reasoning.py)")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="accepted for vLLM command lines: adaspec implements each architecture itself and never "
                        "runs code from a checkpoint")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM command lines: tool_choice 'auto' is always available")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="accepted for vLLM command lines: prefill is always chunked (--no-... is refused)")
    g.add_argument("--disable-log-requests", "--enable-log-requests", dest="vllm_log_requests", action="store_true",
                   help="accepted for vLLM command lines: adaspec never logs prompts (--access-log logs requests)")
    g.add_argument("--kv-cache-dtype", default="auto",
                   help="only 'auto' (the KV cache is kept in the model's dtype)")
    g.add_argument("--quantization", "-q", default=None,
                   help="only the checkpoint's own method (fp8, compressed-tensors, fbgemm_fp8): FP8 checkpoints "
                        "are read as published and dequantized at load; a model is never quantized on the fly")
    g.add_argument("--pipeline-parallel-size", type=int, default=1,
                   help="only 1 (use --tensor-parallel-size to spread a model over GPUs)")


def check_vllm_flags(args: argparse.Namespace) -> str | None:
    """What is wrong with the vLLM flags' values, or None."""
    if args.enable_chunked_prefill is False:
        return "--no-enable-chunked-prefill: adaspec always chunks prefill (use --max-num-batched-tokens)"
    if args.kv_cache_dtype != "auto":
        return f"--kv-cache-dtype {args.kv_cache_dtype}: only 'auto' (the model's dtype) is supported"
    if args.pipeline_parallel_size != 1:
        return (f"--pipeline-parallel-size {args.pipeline_parallel_size}: pipeline parallelism is not supported; "
                f"use --tensor-parallel-size")
    if not args.response_role.strip():
        return "--response-role must be a non-empty role name"
    return None


def check_quantization_flag(args: argparse.Namespace) -> str | None:
    """What is wrong with --quantization for the model (a directory that check_paths passed)."""
    from adaspec.models.quantized import check_requested   # (torch: not before the cheap checks)
    try:
        check_requested(args.quantization, args.model)
    except ValueError as e:
        return f"--quantization: {e}"
    return None


def vllm_settings(args: argparse.Namespace) -> dict:
    """The `ServerSettings` fields the vLLM flags set."""
    return {"prompt_tokens_details": args.enable_prompt_tokens_details,
            "tokens_as_ids": args.return_tokens_as_token_ids, "response_role": args.response_role,
            "reasoning_parser": args.reasoning_parser}
