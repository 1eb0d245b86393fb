"""`adaspec train-draft`: argument parsing and the entry point (flags map one to one onto
`TrainConfig`; errors in the arguments or data exit with status 2 and a message)."""
from __future__ import annotations

import argparse
import json
import sys

from adaspec.train.config import DEFAULT_EVAL_SPECS
from adaspec.train.trainer import train_eagle3_head

def _eval_specs(text: str) -> tuple[tuple[int, int, int], ...]:
    """"4,1,5;2,4,16" -> ((4, 1, 5), (2, 4, 16))."""
    try:
        specs = tuple(tuple(int(x) for x in part.split(",")) for part in text.split(";") if part.strip())
    except ValueError:
        specs = ()
    if not specs or any(len(s) != 3 for s in specs):
        raise argparse.ArgumentTypeError(f"expected NUM_STEPS,TOPK,NUM_DRAFT_TOKENS[;...], got {text!r}")
    return specs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="adaspec train-draft", description="Train an EAGLE-3 head for a target model on its own outputs.",
        epilog="Example: adaspec train-draft --target Llama-3.1-8B-Instruct --out head --data sharegpt.jsonl "
               "--device cuda --seq-len 2048 --batch 16 --steps 20000 --ttt-steps 7 --draft-vocab-size 32000 "
               "--lr 1e-4 --checkpoint-every 1000")
    ap.add_argument("--target", required=True, help="target model directory (Hugging Face layout)")
    ap.add_argument("--out", required=True, help="output directory for the head (and checkpoint/)")
    ap.add_argument("--data", nargs="*", default=[],
                    help="text/code files or folders, or jsonl prompt files (prompt/text, Spec-Bench turns, "
                         "ShareGPT conversations, OpenAI messages); none = random prompts (tiny test models)")
    ap.add_argument("--no-regenerate", action="store_true",
                    help="train on file windows as they are instead of the target's continuations")
    ap.add_argument("--regenerate-with", choices=["engine", "hf"], default="engine")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seq-len", type=int, default=48)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--ttt-steps", type=int, default=3, help="unrolled draft steps (SpecForge uses 7)")
    ap.add_argument("--step-weight", type=float, default=0.8)
    ap.add_argument("--loss", choices=["soft", "hard"], default="soft",
                    help="soft: CE against the target's distribution (SpecForge); hard: against its argmax")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-sequences", type=int, default=1024)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--draft-vocab-size", type=int, default=None, help="default: the target's vocabulary")
    ap.add_argument("--aux-layers", type=str, default=None,
                    help="three distinct target layer indices whose inputs feed the head, comma-separated (default: "
                         "2,L/2,L-3 as SGLang and vLLM assume; 1,L/2,L-1 where that repeats a layer, L < 7)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="auto: bfloat16 autocast on GPU, float32 on CPU")
    ap.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints (0: only at the end)")
    ap.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    ap.add_argument("--eval-prompts", type=int, default=32,
                    help="held-out prompts for the end-of-training acceptance measurement (0: skip)")
    ap.add_argument("--eval-max-tokens", type=int, default=64)
    ap.add_argument("--eval-specs", type=_eval_specs, default=DEFAULT_EVAL_SPECS,
                    help="NUM_STEPS,TOPK,NUM_DRAFT_TOKENS[;...] (default: chain of 4 and a 16-token tree 2,4,16)")
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    a = ap.parse_args(argv)
    try:
        aux = tuple(int(x) for x in a.aux_layers.split(",")) if a.aux_layers else None
        res = train_eagle3_head(
            a.target, a.out, steps=a.steps, seq_len=a.seq_len, batch_size=a.batch, lr=a.lr, ttt_steps=a.ttt_steps,
            step_weight=a.step_weight, loss=a.loss, seed=a.seed, num_sequences=a.num_sequences, prompt_len=a.prompt_len,
            aux_layers=aux, data=tuple(a.data), regenerate=not a.no_regenerate, regenerate_with=a.regenerate_with,
            draft_vocab_size=a.draft_vocab_size, device=a.device, dtype=a.dtype,
            checkpoint_every=a.checkpoint_every, resume=a.resume, log_every=a.log_every,
            eval_prompts=a.eval_prompts, eval_max_tokens=a.eval_max_tokens, eval_specs=a.eval_specs,
            progress=not a.no_progress, num_threads=a.threads)
    except (ValueError, OSError) as e:
        print(f"adaspec train-draft: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
