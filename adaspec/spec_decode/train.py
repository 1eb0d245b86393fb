"""A small EAGLE-3 head trainer (training-time test, as in the EAGLE-3 paper / SpecForge).

    from adaspec.spec_decode.train import train_eagle3_head
    result = train_eagle3_head("path/to/target", "path/to/head", steps=300)
    result["acc"]  # held-out accuracy of each unrolled step (step 0 = first draft token)

Data: random prompts (seeded) continued greedily by the target (Hugging Face, float32); the
label of every position is the target's own argmax there. The target's features (the
*inputs* of layers `aux_layers`, pre-norm residual stream, concatenated) are computed once.

The head trained here is the very module the engine loads (`load_eagle3`), so the forward
below uses its submodules and must match `Eagle3Head.forward` + the drafter exactly:

- Pair p = (hidden_p, token_{p+1}) at rotary position p; step 0's hidden is fc(aux_p).
- Step k of the unroll at sequence index i: hidden = output of step k-1 at index i, token
  token_{i+k+1}, rotary position i+k, label = the target's prediction of token_{i+k+2}.
- Its query attends to the step-0 keys of indices <= i (the draft cache, filled from the
  target's hidden states) and to the keys of (step j, index i) for j = 1..k (its ancestors
  in the draft chain, and itself): exactly the draft-cache entries a depth-(k+1) query sees
  at inference when the last verified pair is i.
- Loss: cross-entropy, step k weighted 0.8**k.

The head is saved with `adaspec.testing.make_eagle3_head` (full vocabulary, no d2t).
`replay_chain_acceptance` replays the engine's chain schedule with this forward: an
independent reference for what the engine must accept.

On random targets: `make_tiny_model(..., init_std=0.2)` (the default) continues greedily in
an essentially chaotic way; even 3000 steps x 256 sequences reach only ~7% accuracy. With
init_std=0.05 greedy output settles into loops and repeats, and 300 CPU steps (~10 s) give
~55% per-step accuracy and an engine accept length of ~1.9 with a 3-deep chain.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from adaspec.layers.rotary import apply_rotary


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """The engine's default capture layers (target layer *inputs*; index L = final pre-norm hidden)."""
    L = num_layers
    return tuple(min(max(i, 0), L) for i in (2, L // 2, L - 3))


def _load_target(target_dir: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def _decoder(model) -> nn.Module:
    return model.model if hasattr(model, "model") else model.base_model


@torch.no_grad()
def _greedy_continue(model, prompts: torch.Tensor, total_len: int) -> torch.Tensor:
    """Continue `prompts` [B, P] greedily (ignoring EOS) to `total_len` tokens."""
    ids = prompts
    out = model(input_ids=ids, use_cache=True)
    past = out.past_key_values
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    while ids.shape[1] < total_len:
        ids = torch.cat([ids, nxt], dim=1)
        if ids.shape[1] == total_len:
            break
        out = model(input_ids=nxt, past_key_values=past, use_cache=True)
        past = out.past_key_values
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    return ids


@torch.no_grad()
def _features(model, ids: torch.Tensor, aux_layers: tuple[int, ...], chunk: int = 64):
    """(aux [B, T, len(aux)*H] = inputs of `aux_layers`, labels [B, T] = target argmax)."""
    dec = _decoder(model)
    layers = dec.layers
    L = len(layers)
    captured: dict[int, torch.Tensor] = {}
    hooks = []

    def grab(i):
        def hook(module, args, kwargs):
            x = args[0] if args else kwargs.get("hidden_states")
            captured[i] = x.detach()
        return hook

    for i in set(aux_layers):
        mod = layers[i] if i < L else dec.norm
        hooks.append(mod.register_forward_pre_hook(grab(i), with_kwargs=True))
    auxs, labels = [], []
    try:
        for s in range(0, ids.shape[0], chunk):
            captured.clear()
            logits = model(input_ids=ids[s:s + chunk], use_cache=False).logits
            labels.append(logits.argmax(-1))
            auxs.append(torch.cat([captured[i] for i in aux_layers], dim=-1))
    finally:
        for h in hooks:
            h.remove()
    return torch.cat(auxs), torch.cat(labels)


def _reset_head(head: nn.Module, gen: torch.Generator, target_lm_head: torch.Tensor | None) -> None:
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            elif name == "lm_head.weight" and target_lm_head is not None:
                p.copy_(target_lm_head)
            else:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=gen).to(p.device) / math.sqrt(fan_in))


def ttt_forward(head, embed: nn.Embedding, aux: torch.Tensor, tokens: torch.Tensor, labels: torch.Tensor,
                ttt_steps: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Unrolled training-time-test forward over sequences [B, T].

    Returns per step k: logits [B, N, V] (N = T - 1 pair indices), labels [B, N] and a valid
    mask [B, N] (index i is valid at step k iff i + k + 1 <= T - 1).
    """
    layer = head.midlayer
    attn = layer.self_attn
    nh, nkv, hd = attn.nh, attn.nkv, attn.hd
    rep = nh // nkv
    B, T = tokens.shape
    N = T - 1
    dev = tokens.device
    idx = torch.arange(N, device=dev)
    causal = idx.view(N, 1) >= idx.view(1, N)  # [query i, key j]: j <= i
    h = head.project(aux[:, :N])
    k0 = v0 = None
    diag_k: list[torch.Tensor] = []
    diag_v: list[torch.Tensor] = []
    out_logits, out_labels, out_valid = [], [], []
    for k in range(ttt_steps):
        src = idx + k + 1
        valid = (src <= T - 1).unsqueeze(0).expand(B, N)
        src = src.clamp(max=T - 1)
        tok = tokens[:, src]
        lab = labels[:, src]
        x = layer.attn_input(embed(tok), h)  # [B, N, 2H]
        cos, sin = head.rotary.cos_sin(idx + k, x.dtype)  # [N, hd]
        q = apply_rotary(attn.q_proj(x).view(B, N, nh, hd), cos, sin).transpose(1, 2)  # [B, nh, N, hd]
        kk = apply_rotary(attn.k_proj(x).view(B, N, nkv, hd), cos, sin).transpose(1, 2)
        vv = attn.v_proj(x).view(B, N, nkv, hd).transpose(1, 2)
        kk = kk.repeat_interleave(rep, dim=1)  # GQA: query head h reads kv head h // rep
        vv = vv.repeat_interleave(rep, dim=1)
        if k == 0:
            k0, v0 = kk, vv
        else:
            diag_k.append(kk)
            diag_v.append(vv)
        s0 = (q @ k0.transpose(-1, -2)) * attn.scale  # [B, nh, N, N]
        s0 = s0.masked_fill(~causal, float("-inf"))
        sd = [(q * dk).sum(-1, keepdim=True) * attn.scale for dk in diag_k]  # each [B, nh, N, 1]
        p = torch.softmax(torch.cat([s0, *sd], dim=-1), dim=-1)
        o = p[..., :N] @ v0
        for j, dv in enumerate(diag_v):
            o = o + p[..., N + j: N + j + 1] * dv
        o = attn.o_proj(o.transpose(1, 2).reshape(B, N, nh * hd))
        h2 = h + o
        h = h2 + layer.mlp(layer.post_attention_layernorm(h2))
        out_logits.append(head.lm_head(head.norm(h)))
        out_labels.append(lab)
        out_valid.append(valid)
    return out_logits, out_labels, out_valid


def train_eagle3_head(target_dir: str | Path, out_dir: str | Path, *, steps: int = 300, seq_len: int = 48,
                      batch_size: int = 16, lr: float = 1e-2, ttt_steps: int = 3, seed: int = 0,
                      num_sequences: int = 1024, prompt_len: int = 8, aux_layers: tuple[int, ...] | None = None,
                      step_weight: float = 0.8, init_lm_head_from_target: bool = True,
                      eval_fraction: float = 0.125, log_every: int = 0, device: str = "cpu",
                      num_threads: int | None = None) -> dict:
    """Train an EAGLE-3 head for the target in `target_dir`; write it to `out_dir`.

    `num_sequences` random prompts of `prompt_len` tokens are continued greedily to `seq_len`
    tokens; `eval_fraction` of them are held out. AdamW with warmup + cosine decay to 0 over
    `steps` steps of `batch_size` sequences (the defaults suit tiny test models). `aux_layers`
    (3 target layer indices, inputs captured; index L = final pre-norm hidden) defaults to the
    engine's; other choices are written to the head's `eagle_config`. `num_threads`, if given,
    sets torch's CPU threads for the call (1 is the robust choice on a loaded machine).

    Returns {"acc": held-out accuracy per unrolled step, "train_acc": per-step accuracy over
    the last 10% of steps, "loss", "steps", "time_s", "data_time_s", "aux_layers", "out_dir"}.
    """
    if num_threads is None:
        return _train(target_dir, out_dir, steps=steps, seq_len=seq_len, batch_size=batch_size, lr=lr,
                      ttt_steps=ttt_steps, seed=seed, num_sequences=num_sequences, prompt_len=prompt_len,
                      aux_layers=aux_layers, step_weight=step_weight,
                      init_lm_head_from_target=init_lm_head_from_target, eval_fraction=eval_fraction,
                      log_every=log_every, device=device)
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        return train_eagle3_head(target_dir, out_dir, steps=steps, seq_len=seq_len, batch_size=batch_size, lr=lr,
                                 ttt_steps=ttt_steps, seed=seed, num_sequences=num_sequences,
                                 prompt_len=prompt_len, aux_layers=aux_layers, step_weight=step_weight,
                                 init_lm_head_from_target=init_lm_head_from_target,
                                 eval_fraction=eval_fraction, log_every=log_every, device=device)
    finally:
        torch.set_num_threads(before)


def _train(target_dir, out_dir, *, steps, seq_len, batch_size, lr, ttt_steps, seed, num_sequences, prompt_len,
           aux_layers, step_weight, init_lm_head_from_target, eval_fraction, log_every, device) -> dict:
    from adaspec.models.registry import parse_model_spec
    from adaspec.spec_decode.eagle3 import load_eagle3
    from adaspec.testing import make_eagle3_head

    t0 = time.perf_counter()
    target_dir, out_dir = Path(target_dir), Path(out_dir)
    tspec, _ = parse_model_spec(target_dir)
    L = tspec.num_layers
    default = default_aux_layers(L)
    aux_layers = tuple(aux_layers) if aux_layers is not None else default
    if len(aux_layers) != 3 or any(not 0 <= i <= L for i in aux_layers):
        raise ValueError(f"aux_layers must be 3 layer indices in [0, {L}], got {aux_layers}")
    aux_ids = None if aux_layers == default else [i - 1 for i in aux_layers]
    if seq_len < ttt_steps + 2 or prompt_len < 1 or prompt_len >= seq_len:
        raise ValueError(f"need ttt_steps + 2 <= seq_len and 1 <= prompt_len < seq_len "
                         f"(seq_len={seq_len}, prompt_len={prompt_len}, ttt_steps={ttt_steps})")

    dev = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    model = _load_target(target_dir).to(dev)
    V = tspec.vocab_size
    prompts = torch.randint(0, V, (num_sequences, prompt_len), generator=gen).to(dev)
    ids = _greedy_continue(model, prompts, seq_len)
    aux, labels = _features(model, ids, aux_layers)
    embed = nn.Embedding.from_pretrained(model.get_input_embeddings().weight.detach().clone(), freeze=True)
    target_lm_head = model.get_output_embeddings().weight.detach().clone()
    del model
    data_time = time.perf_counter() - t0

    n_eval = max(1, int(num_sequences * eval_fraction)) if num_sequences > 1 else 0
    tr_ids, tr_aux, tr_lab = ids[n_eval:], aux[n_eval:], labels[n_eval:]
    ev_ids, ev_aux, ev_lab = ids[:n_eval], aux[:n_eval], labels[:n_eval]

    # The module the engine will load: write the config (random weights for now), load it.
    make_eagle3_head(out_dir, target_dir, aux_layer_ids=aux_ids)
    head = load_eagle3(out_dir, tspec, embed, dev, torch.float32)
    if head.lm_head.weight.shape != target_lm_head.shape:
        target_lm_head = None
    _reset_head(head, gen, target_lm_head if init_lm_head_from_target else None)
    head.train()
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = max(1, steps // 20)

    def lr_at(s):
        if s < warmup:
            return lr * (s + 1) / warmup
        return lr * 0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, steps - warmup)))

    weights = [step_weight ** k for k in range(ttt_steps)]
    tail = max(1, steps // 10)
    tail_correct = torch.zeros(ttt_steps, device=dev)
    tail_total = torch.zeros(ttt_steps, device=dev)
    loss_val = float("nan")
    for s in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(s)
        rows = torch.randint(0, tr_ids.shape[0], (batch_size,), generator=gen).to(dev)
        logits, labs, valids = ttt_forward(head, embed, tr_aux[rows], tr_ids[rows], tr_lab[rows], ttt_steps)
        loss = 0.0
        for k, (lg, lb, vd) in enumerate(zip(logits, labs, valids)):
            ce = F.cross_entropy(lg.reshape(-1, lg.shape[-1]), lb.reshape(-1), reduction="none")
            m = vd.reshape(-1).float()
            loss = loss + weights[k] * (ce * m).sum() / m.sum().clamp(min=1)
            if s >= steps - tail:
                tail_correct[k] += ((lg.argmax(-1) == lb) & vd).sum()
                tail_total[k] += vd.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        loss_val = float(loss.detach())
        if log_every and (s % log_every == 0 or s == steps - 1):
            print(f"step {s:5d}  loss {loss_val:.4f}  lr {lr_at(s):.2e}", flush=True)

    head.eval()
    acc = evaluate_head(head, embed, ev_aux, ev_ids, ev_lab, ttt_steps) if n_eval else []
    state = {k: v.detach().cpu().clone() for k, v in head.state_dict().items() if not k.startswith("embed_tokens")}
    make_eagle3_head(out_dir, target_dir, aux_layer_ids=aux_ids, state_dict=state)
    result = {
        "acc": acc,
        "train_acc": (tail_correct / tail_total.clamp(min=1)).cpu().tolist(),
        "loss": loss_val, "steps": steps, "time_s": time.perf_counter() - t0, "data_time_s": data_time,
        "aux_layers": list(aux_layers), "out_dir": str(out_dir),
    }
    (out_dir / "train_result.json").write_text(json.dumps(result, indent=2))
    return result


@torch.no_grad()
def evaluate_head(head, embed, aux, ids, labels, ttt_steps: int, chunk: int = 64) -> list[float]:
    """Teacher-forced accuracy of each unrolled step over sequences [B, T]."""
    correct = torch.zeros(ttt_steps, device=ids.device)
    total = torch.zeros(ttt_steps, device=ids.device)
    for s in range(0, ids.shape[0], chunk):
        logits, labs, valids = ttt_forward(head, embed, aux[s:s + chunk], ids[s:s + chunk], labels[s:s + chunk],
                                           ttt_steps)
        for k, (lg, lb, vd) in enumerate(zip(logits, labs, valids)):
            correct[k] += ((lg.argmax(-1) == lb) & vd).sum()
            total[k] += vd.sum()
    return (correct / total.clamp(min=1)).cpu().tolist()


@torch.no_grad()
def replay_chain_acceptance(target_dir: str | Path, head_dir: str | Path, sequences: list[list[int]],
                            prompt_lens: list[int], num_steps: int = 3) -> dict:
    """What greedy chain speculation (topk 1, `num_steps` deep) must accept on `sequences`.

    Each sequence is a prompt followed by the target's greedy output. Replays the engine's
    schedule: the first output token comes from prefill; every later step drafts
    min(num_steps, tokens left - 1) tokens from the last verified pair, accepts the longest
    correct prefix and emits one bonus token. Draft predictions come from `ttt_forward`
    (teacher forcing is exact here: an accepted draft token *is* the sequence's token), so
    this is an independent reference for the engine's drafter, draft cache and verifier.
    Returns {"verify_steps", "emitted_tokens", "accept_length", "accepted_per_position",
    "drafted_per_position"} in the engine's `stats()` conventions.
    """
    from adaspec.models.registry import parse_model_spec
    from adaspec.spec_decode.eagle3 import load_eagle3

    tspec, _ = parse_model_spec(target_dir)
    model = _load_target(Path(target_dir))
    embed = nn.Embedding.from_pretrained(model.get_input_embeddings().weight.detach().clone(), freeze=True)
    head = load_eagle3(head_dir, tspec, embed, torch.device("cpu"), torch.float32)
    acc = [0] * num_steps
    drafted = [0] * num_steps
    steps = emitted = 0
    for seq, P in zip(sequences, prompt_lens):
        ids = torch.tensor([seq])
        aux, labels = _features(model, ids, head.aux_layers)
        logits, _, _ = ttt_forward(head, embed, aux, ids, labels, num_steps)
        pred = [lg[0].argmax(-1).tolist() for lg in logits]  # pred[k][q]: draft for token q+k+2
        T, n = len(seq), P + 1
        while n < T:
            depth = min(num_steps, T - n - 1)
            if depth <= 0:
                n += 1
                continue
            q, a = n - 2, 0
            while a < depth and pred[a][q] == seq[q + a + 2]:
                a += 1
            for k in range(depth):
                drafted[k] += 1
            for k in range(a):
                acc[k] += 1
            steps += 1
            emitted += a + 1
            n += a + 1
    return {"verify_steps": steps, "emitted_tokens": emitted,
            "accept_length": emitted / steps if steps else 0.0,
            "accepted_per_position": acc, "drafted_per_position": drafted}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="adaspec train-draft", description="Train an EAGLE-3 head for a target model.")
    ap.add_argument("--target", required=True, help="target model directory (Hugging Face layout)")
    ap.add_argument("--out", required=True, help="output directory for the head")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seq-len", type=int, default=48)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--ttt-steps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-sequences", type=int, default=1024)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--aux-layers", type=str, default=None,
                    help="comma-separated target layer indices whose inputs feed the head (default: engine's)")
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    a = ap.parse_args(argv)
    aux = tuple(int(x) for x in a.aux_layers.split(",")) if a.aux_layers else None
    res = train_eagle3_head(a.target, a.out, steps=a.steps, seq_len=a.seq_len, batch_size=a.batch, lr=a.lr,
                            ttt_steps=a.ttt_steps, seed=a.seed, num_sequences=a.num_sequences,
                            prompt_len=a.prompt_len, aux_layers=aux, log_every=a.log_every,
                            device=a.device, num_threads=a.threads)
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
