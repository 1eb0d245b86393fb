"""The training loop behind `adaspec train-draft`: data, the frozen target alongside, AdamW on
the head with a warm-up + cosine schedule, checkpoints and resume, the written head.

    from adaspec.train import train_eagle3_head
    result = train_eagle3_head("target", "head", data=["src/", "prompts.jsonl"], steps=2000,
                               draft_vocab_size=4096, device="cuda")
    result["acc"]            # held-out accuracy of each unrolled step (step 0 = first draft token)
    result["acceptance"]     # held-out engine acceptance lengths (chain and tree), if eval_prompts

Per batch the target gives its features and logits (`target.py`); the loss (`ttt.py`) at every
unrolled step is the cross-entropy against the target's distribution restricted to the draft
vocabulary (the `draft_vocab_size` most frequent tokens of the training sequences), on
positions whose target argmax it contains; step k is weighted `step_weight**k`. bf16 autocast
on GPU, float32 on CPU; master weights and the optimiser stay float32.

Output: the head in SpecForge's layout (`eagle3_checkpoint.save_eagle3`; no embed_tokens: the
target's is shared), aux layers written when they are not the upstream default.
Checkpoints (`checkpoint_every`) go to OUT/checkpoint/ (data, head, optimiser, RNG, loss curve)
and rewrite the loadable head; `resume=True` continues from there (same data; the step counter
and the loss curve continue). `train_result.json` and, with `eval_prompts`, `eval.json` are
written beside the head.

On random targets: `make_tiny_model(..., init_std=0.2)` (the default) continues greedily in
an essentially chaotic way; even 3000 steps x 256 sequences reach only ~7% accuracy. With
init_std=0.05 greedy output settles into loops and repeats, and 300 CPU steps (~10 s) give
~55% per-step accuracy and an engine accept length of ~1.9 with a 3-deep chain.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

from adaspec.models.registry import parse_model_spec
from adaspec.spec_decode.eagle3_checkpoint import head_tensors, load_eagle3, save_eagle3
from adaspec.tokenization import load_tokenizer
from adaspec.train.config import TrainConfig, resolve_aux_layers
from adaspec.train.data import build_dataset, draft_vocabulary, progress_bar
from adaspec.train.evaluate import acceptance_lengths, evaluate_head
from adaspec.train.target import TargetFeatures, autocast, load_target
from adaspec.train.ttt import reset_head, ttt_forward, ttt_loss


def train_eagle3_head(target_dir: str | Path, out_dir: str | Path, *, num_threads: int | None = None, **kw) -> dict:
    """Train an EAGLE-3 head for the target in `target_dir`; write it to `out_dir`.

    Keywords are `TrainConfig`'s fields. `num_threads`, if given, sets torch's CPU threads for
    the call (1 is the robust choice on a loaded machine). Returns {"acc": held-out accuracy
    per unrolled step, "train_acc": per-step accuracy over the last 10% of steps, "loss",
    "losses" ([step, loss] every log interval, continued across --resume), "steps", "time_s",
    "data_time_s", "aux_layers", "draft_vocab_size", "acceptance" (with eval_prompts), "out_dir"}.
    """
    if "aux_layers" in kw and kw["aux_layers"] is not None:
        kw["aux_layers"] = tuple(kw["aux_layers"])
    for key in ("data", "eval_specs"):
        if key in kw:
            kw[key] = tuple(tuple(x) if isinstance(x, list) else x for x in ([kw[key]] if isinstance(kw[key], str) else kw[key]))
    cfg = TrainConfig(**kw)
    if num_threads is None:
        return _train(Path(target_dir), Path(out_dir), cfg)
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        return _train(Path(target_dir), Path(out_dir), cfg)
    finally:
        torch.set_num_threads(before)


def _lr_schedule(cfg: TrainConfig, total: int, opt: torch.optim.Optimizer):
    """lr at step s: linear warm-up over the first 5% of `total` steps, then cosine to 0 at
    `total` (transformers' get_cosine_schedule_with_warmup). Read as a function of the step, not
    stepped, because a resumed run starts mid-schedule and a time limit can shorten it."""
    from transformers import get_cosine_schedule_with_warmup

    factor = get_cosine_schedule_with_warmup(opt, max(1, total // 20), total).lr_lambdas[0]
    return lambda s: cfg.lr * factor(s)


def _load_or_build_data(target_dir: Path, ckpt_dir: Path, cfg: TrainConfig, model, aux_layers, gen):
    """(dataset, resumed state or None): a resume reads both from the checkpoint and checks
    that this run asks for the same head; a fresh run builds the data and saves it there."""
    if not cfg.resume:
        tokenizer = load_tokenizer(str(target_dir)) if cfg.data else None
        data = build_dataset(target_dir, cfg, model, tokenizer, gen)
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        torch.save(data, ckpt_dir / "data.pt")
        return data, None
    if not (ckpt_dir / "state.pt").exists():
        raise ValueError(f"--resume: no checkpoint in {ckpt_dir}")
    data = torch.load(ckpt_dir / "data.pt")
    state = torch.load(ckpt_dir / "state.pt", weights_only=False)
    if tuple(state["aux_layers"]) != tuple(aux_layers) or state["draft_vocab_size"] != cfg.draft_vocab_size:
        raise ValueError(f"--resume: checkpoint has aux_layers={state['aux_layers']}, draft_vocab_size="
                         f"{state['draft_vocab_size']}; this run asks for {list(aux_layers)}, {cfg.draft_vocab_size}")
    if data["tokens"].shape[1] != cfg.seq_len:
        raise ValueError(f"--resume: checkpoint sequences have {data['tokens'].shape[1]} tokens, "
                         f"--seq-len is {cfg.seq_len}")
    if state["step"] >= cfg.steps:
        raise ValueError(f"--resume: the checkpoint is at step {state['step']}; ask for more --steps")
    return data, state


def _train(target_dir: Path, out_dir: Path, cfg: TrainConfig) -> dict:
    t0 = time.perf_counter()
    tspec, _ = parse_model_spec(target_dir)
    V = tspec.vocab_size
    aux_layers, is_default = resolve_aux_layers(cfg.aux_layers, tspec.num_layers)
    written_aux = None if is_default else aux_layers   # the upstream default is not written
    dev = torch.device(cfg.device)
    amp = {"auto": torch.bfloat16 if dev.type == "cuda" else torch.float32,
           "float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.dtype]
    ckpt_dir = out_dir / "checkpoint"
    gen = torch.Generator().manual_seed(cfg.seed)
    model = load_target(target_dir, dev)
    data, state = _load_or_build_data(target_dir, ckpt_dir, cfg, model, aux_layers, gen)
    data_time = time.perf_counter() - t0

    tokens, lengths, plens = data["tokens"], data["lengths"], data["prompt_lens"]
    n = tokens.shape[0]
    n_eval = min(n - 1, max(1, int(n * cfg.eval_fraction)))
    t_ids, d2t, t2d = draft_vocabulary(tokens[n_eval:], lengths[n_eval:], V, cfg.draft_vocab_size)
    t_ids, d2t, t2d = t_ids.to(dev), d2t.to(dev), t2d.to(dev)
    embed = nn.Embedding.from_pretrained(model.get_input_embeddings().weight.detach().clone(), freeze=True)
    target_lm_head = model.get_output_embeddings().weight.detach()[t_ids].clone()

    # The module the engine will load: built through the loader from a head written with the
    # target's shape (fresh weights follow), so training and inference share one definition.
    head = _fresh_head(out_dir, target_dir, tspec, embed, dev, written_aux, cfg.draft_vocab_size, V)
    head.d2t = d2t
    if head.lm_head.weight.shape != target_lm_head.shape or not cfg.init_lm_head_from_target:
        target_lm_head = None
    reset_head(head, gen, target_lm_head)
    head.train()
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    step, losses = 0, []
    if state is not None:
        head.load_state_dict(state["head"], strict=False)
        opt.load_state_dict(state["opt"])
        gen.set_state(state["gen"])
        step, losses = state["step"], state["losses"]
    # `total` is the schedule's length: cfg.steps, or fewer once a time limit shows that
    # cfg.steps will not fit (measured over the first 20 steps), so the cosine still ends at 0.
    total = cfg.steps
    lr_at = _lr_schedule(cfg, total, opt)
    save_dtype = torch.bfloat16 if amp == torch.bfloat16 else torch.float32

    def checkpoint(s):
        torch.save({"step": s, "head": {k: v.cpu() for k, v in head.state_dict().items()},
                    "opt": opt.state_dict(), "gen": gen.get_state(), "losses": losses,
                    "aux_layers": list(aux_layers), "draft_vocab_size": cfg.draft_vocab_size,
                    "config": asdict(cfg)}, ckpt_dir / "state.pt.tmp")
        (ckpt_dir / "state.pt.tmp").replace(ckpt_dir / "state.pt")  # never a half-written checkpoint
        save_eagle3(out_dir, target_dir, head_tensors(head, t2d if cfg.draft_vocab_size is not None else None,
                                                      save_dtype),
                    aux_layers=written_aux, draft_vocab_size=cfg.draft_vocab_size,
                    torch_dtype=str(save_dtype).removeprefix("torch."))

    feats = TargetFeatures(model, aux_layers)
    tail_correct = torch.zeros(cfg.ttt_steps, device=dev)
    tail_total = torch.zeros(cfg.ttt_steps, device=dev)
    tr_tokens, tr_lengths = tokens[n_eval:], lengths[n_eval:]
    loss_val = losses[-1][1] if losses else float("nan")
    bar = progress_bar(total, "train", cfg.progress, initial=step)
    t_train, first = time.perf_counter(), step
    while step < total:
        if cfg.time_limit_s is not None:
            elapsed = time.perf_counter() - t_train
            if step == first + 20 and total == cfg.steps:
                fits = first + 20 + int((cfg.time_limit_s - elapsed) / (elapsed / 20))
                if fits < total:
                    total = max(step + 1, fits)
                    lr_at = _lr_schedule(cfg, total, opt)
                    bar.total = total
                    print(f"time limit: the schedule is shortened to {total} steps", file=sys.stderr, flush=True)
            if elapsed > cfg.time_limit_s:
                print(f"time limit: stopping at step {step} of {total} (--resume continues)", file=sys.stderr)
                break
        s = step
        for g in opt.param_groups:
            g["lr"] = lr_at(s)
        rows = torch.randint(0, tr_tokens.shape[0], (cfg.batch_size,), generator=gen)
        ids, lens = tr_tokens[rows].to(dev), tr_lengths[rows].to(dev)
        with autocast(dev, amp):
            aux, tgt_logits = feats(ids)
            logits, srcs, valids = ttt_forward(head, embed, aux, ids, cfg.ttt_steps, lens)
        loss, correct, counted = ttt_loss(logits, srcs, valids, tgt_logits, t_ids, t2d, d2t, cfg.step_weight,
                                          soft=cfg.loss == "soft")
        if s >= total - max(1, total // 10):
            tail_correct += correct
            tail_total += counted
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        loss_val = float(loss.detach())
        if cfg.log_every and (s % cfg.log_every == 0 or step == total):
            losses.append([s, loss_val])
            if not cfg.progress:
                print(f"step {s:5d}  loss {loss_val:.4f}  lr {lr_at(s):.2e}", file=sys.stderr, flush=True)
        bar.set_postfix(loss=f"{loss_val:.3f}", refresh=False)
        bar.update(1)
        if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step < total:
            checkpoint(step)
    bar.close()

    head.eval()
    acc = evaluate_head(head, embed, feats, tokens[:n_eval].to(dev), lengths[:n_eval].to(dev), cfg.ttt_steps, amp)
    feats.close()
    checkpoint(step)
    del model
    result = {
        "acc": acc,
        "train_acc": (tail_correct / tail_total.clamp(min=1)).cpu().tolist(),
        "loss": loss_val, "losses": losses, "steps": step, "time_s": time.perf_counter() - t0,
        "data_time_s": data_time, "aux_layers": list(aux_layers), "draft_vocab_size": cfg.draft_vocab_size,
        "num_sequences": n, "num_eval_sequences": n_eval, "out_dir": str(out_dir),
    }
    if cfg.eval_prompts:
        prompts = [tokens[i, :int(plens[i])].tolist() for i in range(min(cfg.eval_prompts, n_eval))]
        result["acceptance"] = acceptance_lengths(target_dir, out_dir, prompts, cfg.eval_max_tokens, cfg.eval_specs,
                                                  device=cfg.device)
        (out_dir / "eval.json").write_text(json.dumps(result["acceptance"], indent=2))
    (out_dir / "train_result.json").write_text(json.dumps(result, indent=2))
    return result


def _fresh_head(out_dir: Path, target_dir: Path, tspec, embed: nn.Embedding, dev: torch.device,
                aux_layers, draft_vocab_size: int | None, vocab_size: int):
    """Write a head of the right shapes (zeros; `reset_head` draws the real start) and load it."""
    H = tspec.hidden_size
    nh, nkv, hd = tspec.num_heads, tspec.num_kv_heads, H // tspec.num_heads
    inter, Vd = tspec.intermediate_size, draft_vocab_size or vocab_size
    k = len(aux_layers) if aux_layers is not None else 3
    shapes = {"fc.weight": (H, k * H), "midlayer.self_attn.q_proj.weight": (nh * hd, 2 * H),
              "midlayer.self_attn.k_proj.weight": (nkv * hd, 2 * H), "midlayer.self_attn.v_proj.weight": (nkv * hd, 2 * H),
              "midlayer.self_attn.o_proj.weight": (H, nh * hd), "midlayer.mlp.gate_proj.weight": (inter, H),
              "midlayer.mlp.up_proj.weight": (inter, H), "midlayer.mlp.down_proj.weight": (H, inter),
              "midlayer.input_layernorm.weight": (H,), "midlayer.hidden_norm.weight": (H,),
              "midlayer.post_attention_layernorm.weight": (H,), "norm.weight": (H,), "lm_head.weight": (Vd, H)}
    tensors = {name: torch.zeros(shape) for name, shape in shapes.items()}
    if draft_vocab_size is not None:  # a placeholder map (the first Vd ids); the trainer sets d2t
        tensors["d2t"] = torch.zeros(Vd, dtype=torch.long)
        tensors["t2d"] = torch.arange(vocab_size) < Vd
    save_eagle3(out_dir, target_dir, tensors, aux_layers=aux_layers, draft_vocab_size=draft_vocab_size)
    return load_eagle3(out_dir, tspec, embed, dev, torch.float32)
