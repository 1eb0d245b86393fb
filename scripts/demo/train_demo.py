"""Step 2 of the demo pair (one GPU, ~6 minutes on an H200): train the target, then its EAGLE-3
head on the target's own greedy continuations, with adaspec's trainer.

    PYTHONPATH=. python scripts/demo/train_demo.py DATA_DIR OUT_DIR [--target-seconds 190]

DATA_DIR is `prepare_data.py`'s output (tokenizer/, train_tokens.npy.xz, heldout_tokens.npy.xz).
OUT_DIR receives target/ (Hugging Face Llama, bf16 safetensors, tokenizer unless
--no-tokenizer-out), head/ (EAGLE-3,
SpecForge layout) and demo_train.json (config, steps, loss curve, held-out loss/accuracy,
times). The target is written as soon as it is trained, so a run cut short still returns it.

Target: a Llama (8 layers, hidden 256, GQA 8/4 heads, tied embeddings, 2,048 positions),
AdamW on random 1,024-token windows of the token stream (documents joined by </s>), bf16
autocast; the number of steps is fixed after timing the first ones so that training fills
`--target-seconds` and the cosine schedule ends there. Head: `train_eagle3_head` on windows of
the training stream used as prompts (4 prompt lengths) and continued greedily by the target.
`--tiny` shrinks everything for a CPU smoke run.
"""
from __future__ import annotations

import argparse
import json
import lzma
import math
import random
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

TARGET = dict(hidden_size=256, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
              intermediate_size=704, max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-5,
              tie_word_embeddings=True)
TINY = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-5,
            tie_word_embeddings=True)
PROMPT_LENS = (16, 48, 96, 160)


def load_tokens(path: Path) -> torch.Tensor:
    with lzma.open(path) as f:
        return torch.from_numpy(np.load(f).astype(np.int64))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def train_target(tokens, held, vocab, args, dev, record) -> "torch.nn.Module":
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, bos_token_id=0, eos_token_id=1, pad_token_id=2, hidden_act="silu",
                      **(TINY if args.tiny else TARGET))
    cfg.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"target: {n_params / 1e6:.2f}M parameters, {tokens.numel() / 1e6:.1f}M training tokens")
    T, B = args.ctx, args.batch
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=dev.type == "cuda")
    amp = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda")
    gen = torch.Generator().manual_seed(0)
    tokens = tokens.to(dev)
    warmup, total, losses = 50, None, []
    t0 = time.perf_counter()
    step = 0
    while total is None or step < total:
        if step == 30 and total is None:  # fix the schedule from the measured step time
            per_step = (time.perf_counter() - t_timing) / 20
            total = max(60, int(args.target_seconds / per_step))
            log(f"target: {per_step * 1000:.1f} ms/step -> {total} steps ({total * B * T / 1e6:.0f}M tokens)")
        if step == 10:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t_timing = time.perf_counter()
        horizon = total or 10 ** 9
        lr = args.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, step / horizon))))
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, tokens.numel() - T - 1, (B,), generator=gen).to(dev)
        batch = tokens[starts.unsqueeze(1) + torch.arange(T + 1, device=dev)]
        with amp:
            loss = _lm_loss(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0:
            losses.append([step, round(float(loss.detach()), 4)])
            log(f"target step {step}  loss {losses[-1][1]:.4f}  lr {lr:.2e}")
        step += 1
    train_s = time.perf_counter() - t0
    model.eval()
    held_loss = evaluate_lm(model, held, T, dev, max_rows=16 if args.tiny else 256)
    log(f"target: {step} steps in {train_s:.0f}s; held-out loss {held_loss:.4f} (ppl {math.exp(held_loss):.2f})")
    record["target"] = {"config": {**(TINY if args.tiny else TARGET), "vocab_size": vocab}, "parameters": n_params,
                        "steps": step, "batch": B, "context": T, "tokens_seen": step * B * T, "lr": args.lr,
                        "train_seconds": round(train_s, 1), "losses": losses,
                        "final_train_loss": losses[-1][1] if losses else None,
                        "held_out_loss": round(held_loss, 4),
                        "held_out_tokens_evaluated": min(256 * T, int(held.numel()))}
    return model


def _lm_loss(model, batch):
    logits = model(input_ids=batch[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


@torch.no_grad()
def evaluate_lm(model, held, T, dev, max_rows: int = 256) -> float:
    """Mean next-token loss over the first `max_rows` windows of T tokens of the held-out stream."""
    n = min(max_rows, (held.numel() - 1) // T)
    total = count = 0.0
    amp = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda")
    for s in range(0, n, 32):
        rows = torch.stack([held[i * T:i * T + T + 1] for i in range(s, min(n, s + 32))]).to(dev)
        with amp:
            total += float(_lm_loss(model, rows)) * rows.shape[0]
        count += rows.shape[0]
    return total / max(count, 1)


def save_target(model, data_dir: Path, out: Path) -> None:
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(str(out))
    model.float()
    GenerationConfig(bos_token_id=0, eos_token_id=1, pad_token_id=2).save_pretrained(str(out))
    for f in (data_dir / "tokenizer").iterdir():
        shutil.copy(f, out / f.name)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("data")
    ap.add_argument("out")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--target-seconds", type=float, default=190)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--head-steps", type=int, default=1500)
    ap.add_argument("--head-seconds", type=float, default=150)
    ap.add_argument("--head-sequences", type=int, default=6144)
    ap.add_argument("--head-seq-len", type=int, default=320)
    ap.add_argument("--head-batch", type=int, default=64)
    ap.add_argument("--head-lr", type=float, default=3e-3)
    ap.add_argument("--ttt-steps", type=int, default=6)
    ap.add_argument("--draft-vocab", type=int, default=2048)
    ap.add_argument("--no-tokenizer-out", action="store_true",
                    help="leave the tokenizer files (already in DATA_DIR) out of OUT_DIR/target")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny target, few steps")
    args = ap.parse_args()
    from adaspec.train import train_eagle3_head

    data, out = Path(args.data), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path("/tmp/adaspec_demo_work")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    dev = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = True
    record: dict = {"args": vars(args), "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
                    "torch": torch.__version__}
    t_all = time.perf_counter()
    tokens = load_tokens(data / "train_tokens.npy.xz")
    held = load_tokens(data / "heldout_tokens.npy.xz")
    vocab = json.loads((data / "data.json").read_text())["vocab_size"]
    model = train_target(tokens, held, vocab, args, dev, record)
    save_target(model, data, work / "target")
    del model
    (out / "target").mkdir(exist_ok=True)
    for f in (work / "target").iterdir():
        if not (args.no_tokenizer_out and f.name.startswith("tokenizer")):
            shutil.copy(f, out / "target" / f.name)
    (out / "demo_train.json").write_text(json.dumps(record, indent=1))

    # Head prompts: windows of the training stream (never the held-out files), 4 prompt lengths.
    rng = random.Random(1)
    flat = tokens.numpy()
    with open(work / "prompts.jsonl", "w") as f:
        for i in range(args.head_sequences):
            n = PROMPT_LENS[i % len(PROMPT_LENS)]
            s = rng.randrange(0, len(flat) - n)
            f.write(json.dumps({"prompt_ids": flat[s:s + n].tolist()}) + "\n")
    t_head = time.perf_counter()
    res = train_eagle3_head(
        work / "target", work / "head", data=[str(work / "prompts.jsonl")], regenerate_with="hf",
        num_sequences=args.head_sequences, seq_len=args.head_seq_len, steps=args.head_steps,
        batch_size=args.head_batch, lr=args.head_lr, ttt_steps=args.ttt_steps, draft_vocab_size=args.draft_vocab,
        device=args.device, checkpoint_every=250, time_limit_s=args.head_seconds, log_every=50,
        eval_fraction=0.05, progress=False)
    (out / "head").mkdir(exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(work / "head" / name, out / "head" / name)
    record["head"] = {k: v for k, v in res.items() if k != "out_dir"}
    record["head"]["wall_seconds"] = round(time.perf_counter() - t_head, 1)
    record["head"]["prompt_lens"] = PROMPT_LENS
    record["total_seconds"] = round(time.perf_counter() - t_all, 1)
    (out / "demo_train.json").write_text(json.dumps(record, indent=1))
    log(f"head: held-out per-step accuracy {[round(a, 3) for a in res['acc']]}; total {record['total_seconds']}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
