"""The demo pair shipped with the package: a small Llama-architecture Python code model and
its EAGLE-3 head, so that `adaspec serve` with no --model shows speculation at work.

How they were made (data, licences, steps, losses, held-out figures): scripts/demo/README.md
in the repository, with the scripts that reproduce them.
"""
from __future__ import annotations

from pathlib import Path

DEMO_DIR = Path(__file__).parent
DEMO_TARGET = DEMO_DIR / "target"
DEMO_HEAD = DEMO_DIR / "head"
DEMO_MODEL_NAME = "adaspec-demo"
# The demo pair's draft depth when none is given. Its head keeps paying deep (accepted tokens
# per verify step, served on the H200 at concurrency 1: 2.78 at 4 drafts, 3.19 at 8), and at
# small batches its step is host-bound, so a deeper chain costs about the same (0.57-0.69 ms
# per step for 1..8 drafts, benchmarks/step_cost_trace.py). `auto` picks the depth that pays
# from 0..8 by measurement (results/h200/session14_2026-12-04).
DEMO_NUM_STEPS = 8


def demo_available() -> bool:
    return (DEMO_TARGET / "model.safetensors").exists() and (DEMO_HEAD / "model.safetensors").exists()


def apply_demo_defaults(args, *, set_policy: bool = True) -> bool:
    """With no --model: serve the demo pair (its head as the draft, the `auto` policy unless
    --speculation says otherwise, chains of up to DEMO_NUM_STEPS drafts unless a depth or a
    tree is given, under the short model name). Returns whether it applied.
    Raises ValueError when the package was installed without the demo files."""
    if getattr(args, "model", None) is not None:
        return False
    if not demo_available():
        raise ValueError(f"no --model given and the bundled demo pair is missing from {DEMO_DIR}; "
                         f"pass --model DIR")
    args.model = str(DEMO_TARGET)
    if getattr(args, "draft", None) is None:
        args.draft = str(DEMO_HEAD)
    if set_policy and getattr(args, "speculation", None) is None:
        args.speculation = "auto"
    # (a tree, vLLM's --speculative-config or an explicit depth keep theirs)
    if getattr(args, "num_steps", 0) is None and getattr(args, "speculative_config", None) is None \
            and getattr(args, "topk", 1) in (None, 1) and getattr(args, "num_draft_tokens", None) is None:
        args.num_steps = DEMO_NUM_STEPS
    if getattr(args, "served_model_name", None) is None:
        args.served_model_name = DEMO_MODEL_NAME
    return True
