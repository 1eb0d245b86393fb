"""Training-time test (EAGLE-3 / SpecForge): the unrolled draft forward and its loss. Pure
functions of tensors and the head's own submodules, no I/O.

The head trained is the very module the engine loads (`load_eagle3`), so `ttt_forward` uses
its submodules and must match `Eagle3Head.forward` + the drafter exactly:
- Pair p = (hidden_p, token_{p+1}) at rotary position p; step 0's hidden is fc(aux_p).
- Step k of the unroll at sequence index i: hidden = output of step k-1 at index i, token
  token_{i+k+1}, rotary position i+k, label = the target's prediction of token_{i+k+2}.
- Its query attends to the step-0 keys of indices <= i (the draft cache, filled from the
  target's hidden states) and to the keys of (step j, index i) for j = 1..k (its ancestors
  in the draft chain, and itself): exactly the draft-cache entries a depth-(k+1) query sees
  at inference when the last verified pair is i.
Only the layouts adaspec trains are unrolled here: one Llama layer, lm_head(norm(h)), the
pre-norm hidden fed back.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from adaspec.layers.rotary import apply_rotary

def reset_head(head: nn.Module, gen: torch.Generator, target_lm_head: torch.Tensor | None) -> None:
    """Fresh weights: unit norms, zero biases, normal(0, 1/fan_in) matrices; lm_head from the
    target's rows of the draft vocabulary when `target_lm_head` is given."""
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


def ttt_forward(head, embed: nn.Embedding, aux: torch.Tensor, tokens: torch.Tensor, ttt_steps: int,
                lengths: torch.Tensor | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Unrolled training-time-test forward over sequences [B, T].

    Returns per step k: draft logits [B, N, Vd] (N = T - 1 pair indices), the sequence index
    of each label [N] (the target's prediction at that index is the label) and a valid mask
    [B, N] (index i is valid at step k iff i + k + 1 <= length - 1).
    """
    layer = head.midlayer
    attn = layer.self_attn
    nh, nkv, hd = attn.nh, attn.nkv, attn.hd
    rep = nh // nkv
    B, T = tokens.shape
    N = T - 1
    dev = tokens.device
    last = (lengths.to(dev) - 1).view(B, 1) if lengths is not None else torch.full((B, 1), T - 1, device=dev)
    idx = torch.arange(N, device=dev)
    causal = idx.view(N, 1) >= idx.view(1, N)  # [query i, key j]: j <= i
    h = head.project(aux[:, :N])
    k0 = v0 = None
    diag_k: list[torch.Tensor] = []
    diag_v: list[torch.Tensor] = []
    out_logits, out_src, out_valid = [], [], []
    for k in range(ttt_steps):
        src = idx + k + 1
        valid = src.unsqueeze(0) <= last
        src = src.clamp(max=T - 1)
        x = layer.attn_input(embed(tokens[:, src]).to(h.dtype), h)  # [B, N, 2H]
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
        p = torch.softmax(torch.cat([s0, *sd], dim=-1).float(), dim=-1).to(q.dtype)
        o = p[..., :N] @ v0
        for j, dv in enumerate(diag_v):
            o = o + p[..., N + j: N + j + 1] * dv
        o = attn.o_proj(o.transpose(1, 2).reshape(B, N, nh * hd))
        h2 = h + o
        h = h2 + layer.mlp(layer.post_attention_layernorm(h2))
        out_logits.append(head.lm_head(head.norm(h)))
        out_src.append(src)
        out_valid.append(valid)
    return out_logits, out_src, out_valid


def ttt_loss(logits, srcs, valids, target_logits: torch.Tensor, t_ids: torch.Tensor, t2d: torch.Tensor,
             d2t: torch.Tensor, step_weight: float, soft: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weighted loss, correct [K], counted [K]). Per step: cross-entropy against the target's
    distribution over the draft vocabulary (`soft`, as SpecForge) or against its argmax (hard:
    what greedy acceptance needs, better for tiny random targets whose distributions are
    flat), on valid positions whose target argmax is in the draft vocabulary; "correct" = the
    draft's argmax (as a target id) equals the target's argmax."""
    tgt_arg = target_logits.argmax(-1)  # [B, T]
    tgt_logp = torch.log_softmax(target_logits[..., t_ids].float(), dim=-1) if soft else None  # [B, T, Vd]
    t2d_index = torch.cumsum(t2d.long(), 0) - 1  # target id -> draft id (valid where t2d)
    loss = torch.zeros((), device=target_logits.device)
    correct, counted = [], []
    for k, (lg, src, vd) in enumerate(zip(logits, srcs, valids)):
        lab = tgt_arg[:, src]
        m = vd & t2d[lab]
        if soft:
            ce = -(tgt_logp[:, src].exp() * torch.log_softmax(lg.float(), dim=-1)).sum(-1)
        else:
            ce = F.cross_entropy(lg.float().transpose(1, 2), t2d_index[lab].clamp(min=0), reduction="none")
        mf = m.float()
        loss = loss + (step_weight ** k) * (ce * mf).sum() / mf.sum().clamp(min=1)
        pred = lg.argmax(-1)
        pred = pred + d2t[pred]
        correct.append(((pred == lab) & vd).sum())
        counted.append(vd.sum())
    return loss, torch.stack(correct), torch.stack(counted)
