"""Checks of `adaspec serve`'s arguments that need nothing loaded: paths and values. Each
returns what is wrong (one sentence naming the flag) or None."""
from __future__ import annotations

import argparse
import os

from adaspec.server.vllm_flags import check_vllm_flags
from adaspec.tokenization import TOKENIZER_FILES


def check_paths(args: argparse.Namespace) -> str | None:
    """What is wrong with --model / --draft / --tokenizer, before anything heavy is imported or
    loaded, or None. Models load from local directories only."""
    def hint(path: str) -> str:
        if "/" in path.strip("/") and not os.path.isabs(path) and not path.startswith("."):
            return (f"; adaspec loads models from local directories only (no hub download): fetch it "
                    f"first, e.g. `hf download {path} --local-dir DIR` (older huggingface_hub: "
                    f"`huggingface-cli download {path} --local-dir DIR`), then pass DIR")
        return ""

    for flag, path, must_hold in (("--model", args.model, ("config.json",)),
                                  ("--draft", args.draft, ("config.json",)),
                                  ("--tokenizer", args.tokenizer, TOKENIZER_FILES)):
        if path is None:
            continue
        if not os.path.isdir(path):
            return f"{flag} {path}: not a directory{hint(path)}"
        if not any(os.path.exists(os.path.join(path, f)) for f in must_hold):
            return f"{flag} {path}: holds none of {', '.join(must_hold)}"
    return None


def check_serve_values(args: argparse.Namespace) -> str | None:
    """What is wrong with the server's numeric flags and the vLLM flags' values, or None."""
    for name, value in (("--max-queue-len", args.max_queue_len), ("--max-request-bytes", args.max_request_bytes),
                        ("--client-timeout", args.client_timeout), ("--stall-timeout", args.stall_timeout),
                        ("--log-stats-interval", args.log_stats_interval)):
        if value <= 0:
            return f"{name} must be > 0, got {value}"
    if args.max_prompts_per_request < 1:
        return f"--max-prompts-per-request must be >= 1, got {args.max_prompts_per_request}"
    return check_vllm_flags(args)
