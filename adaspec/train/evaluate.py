"""How good a trained head is: teacher-forced accuracy per unrolled step (`evaluate_head`),
greedy acceptance length in adaspec's engine (`acceptance_lengths`), and an independent replay
of what greedy chain speculation must accept (`replay_chain_acceptance`), a reference that the
engine's drafter, draft cache and verifier are tested against.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

from adaspec.spec_decode.eagle3_checkpoint import load_eagle3
from adaspec.train.config import DEFAULT_EVAL_SPECS
from adaspec.train.target import TargetFeatures, autocast, features, load_target
from adaspec.train.ttt import ttt_forward

@torch.no_grad()
def evaluate_head(head, embed, feats: TargetFeatures, ids: torch.Tensor, lengths: torch.Tensor, ttt_steps: int,
                  amp: torch.dtype = torch.float32, chunk: int = 64) -> list[float]:
    """Teacher-forced accuracy of each unrolled step (draft argmax == target argmax)."""
    correct = torch.zeros(ttt_steps, device=ids.device)
    total = torch.zeros(ttt_steps, device=ids.device)
    for s in range(0, ids.shape[0], chunk):
        with autocast(ids.device, amp):
            aux, tgt = feats(ids[s:s + chunk])
            logits, srcs, valids = ttt_forward(head, embed, aux, ids[s:s + chunk], ttt_steps, lengths[s:s + chunk])
        lab = tgt.argmax(-1)
        for k, (lg, src, vd) in enumerate(zip(logits, srcs, valids)):
            pred = head.to_target_ids(lg.argmax(-1))
            correct[k] += ((pred == lab[:, src]) & vd).sum()
            total[k] += vd.sum()
    return (correct / total.clamp(min=1)).cpu().tolist()


def acceptance_lengths(target_dir: str | Path, head_dir: str | Path, prompts: list[list[int]], max_tokens: int,
                       specs=DEFAULT_EVAL_SPECS, device: str = "cpu") -> list[dict]:
    """Greedy acceptance length of the head in adaspec's engine, per (num_steps, topk,
    num_draft_tokens): emitted tokens per verify step, the bonus token included."""
    from adaspec import LLM, SamplingParams

    out = []
    for num_steps, topk, ndt in specs:
        llm = LLM(str(target_dir), draft=str(head_dir), speculation="always", num_steps=num_steps, topk=topk,
                  num_draft_tokens=ndt, device=device)
        llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        st = llm.stats()
        out.append({"num_steps": num_steps, "topk": topk, "num_draft_tokens": ndt,
                    "kind": "chain" if topk == 1 else "tree", "accept_length": st["accept_length"],
                    "verify_steps": st["verify_steps"], "prompts": len(prompts), "max_tokens": max_tokens})
        print(f"acceptance {out[-1]['kind']} steps={num_steps} topk={topk} tokens={ndt}: "
              f"{st['accept_length']:.3f}", file=sys.stderr, flush=True)
        del llm
    return out


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

    tspec, _ = parse_model_spec(target_dir)
    model = load_target(Path(target_dir))
    embed = nn.Embedding.from_pretrained(model.get_input_embeddings().weight.detach().clone(), freeze=True)
    head = load_eagle3(head_dir, tspec, embed, torch.device("cpu"), torch.float32)
    acc = [0] * num_steps
    drafted = [0] * num_steps
    steps = emitted = 0
    for seq, P in zip(sequences, prompt_lens):
        ids = torch.tensor([seq])
        aux, _ = features(model, ids, head.aux_layers)
        logits, _, _ = ttt_forward(head, embed, aux, ids, num_steps)
        pred = [head.to_target_ids(lg[0].argmax(-1)).tolist() for lg in logits]  # pred[k][q]: token q+k+2
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
