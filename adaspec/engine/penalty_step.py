"""The host side of history-dependent sampling (`adaspec.penalties`) and of logprobs: which
rows of a verify batch need them, staged with the step's one host->device copy.

Overlap: a step may be planned while the request's previous step is still in flight, so the
host history misses that step's tokens. They are on the device already: the post-forward
keeps each device row's last emitted tokens (`DeviceRows.last_emitted`), and a request whose
previous step is unread (`Request.pending`) adds those. So penalized requests keep planning
ahead like every other request; only their post-forward runs eagerly (no post CUDA graph).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from adaspec.device.logprobs import logprob_rows
from adaspec.device.staging import Staging
from adaspec.penalties import PenaltyBatch


@dataclass
class StagedPenalties:
    """Staging handles of a `PenaltyBatch` (device tensors after commit)."""

    refs: dict
    use_repetition: bool
    use_min_tokens: bool

    def batch(self) -> PenaltyBatch:
        t = {k: r.t for k, r in self.refs.items()}
        allow = {} if "allow" not in t else {"allow": t["allow"], "restricted": t["restricted"].bool()}
        bad = {} if "bad_row" not in t else {
            "bad_row": t["bad_row"], "bad_last": t["bad_last"],
            "bad_prefix": t["bad_prefix"], "tail": t["tail"]}
        return PenaltyBatch(t["rows"], t["presence"], t["frequency"], t["repetition"], t["min_tokens"],
                            t["out_len"], t["pending"].bool(), t["hist"], t["hist_val"], t["prompt"], t["bias"],
                            t["bias_val"], t["stops"], self.use_repetition, self.use_min_tokens, **allow, **bad)


def _pairs(pairs: list[tuple[int, int]]) -> np.ndarray:
    return np.array(pairs, dtype=np.int64).reshape(-1, 2).T.copy()


def _stacked(rows: list, toks: list) -> np.ndarray:
    """[2, T] (row, token) pairs from per-request arrays."""
    if not toks:
        return np.zeros((2, 0), dtype=np.int64)
    return np.stack([np.concatenate(rows), np.concatenate(toks)])


def stage_penalties(stg: Staging, reqs: list) -> StagedPenalties | None:
    """Stage the penalized requests among `reqs` (the verify batch's, in order); None if none."""
    rows = [k for k, r in enumerate(reqs) if r.params.penalized]
    if not rows:
        return None
    # The histories by numpy, per request in C: a Python loop over every output and prompt
    # token of every penalized request cost ~13 ms per step at b = 64 (200 out, 256 in).
    hist_tok, hist_cnt, hist_row, prompt_tok, prompt_row = [], [], [], [], []
    bias, bias_val, stops = [], [], []
    for j, k in enumerate(rows):
        r = reqs[k]
        p = r.params
        if r.output_token_ids:
            tok, cnt = np.unique(np.asarray(r.output_token_ids, dtype=np.int64), return_counts=True)
            hist_tok.append(tok)
            hist_cnt.append(cnt)
            hist_row.append(np.full(len(tok), j, dtype=np.int64))
        if p.repetition_penalty != 1:
            tok = np.unique(np.asarray(r.prompt_token_ids, dtype=np.int64))
            prompt_tok.append(tok)
            prompt_row.append(np.full(len(tok), j, dtype=np.int64))
        for t, b in (p.logit_bias or {}).items():
            bias.append((j, t))
            bias_val.append(b)
        if p.min_tokens:
            ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(r.eos_token_ids))
            stops.extend((j, t) for t in ids)
    ps = [reqs[k].params for k in rows]
    host = {
        "rows": (rows, torch.int64),
        "presence": ([p.presence_penalty for p in ps], torch.float32),
        "frequency": ([p.frequency_penalty for p in ps], torch.float32),
        "repetition": ([p.repetition_penalty for p in ps], torch.float32),
        "min_tokens": ([p.min_tokens for p in ps], torch.int64),
        "out_len": ([len(reqs[k].output_token_ids) for k in rows], torch.int64),
        "pending": ([reqs[k].pending > 0 for k in rows], torch.uint8),
        "hist": (_stacked(hist_row, hist_tok), torch.int64),
        "hist_val": (np.concatenate(hist_cnt).astype(np.float32) if hist_cnt else [], torch.float32),
        "prompt": (_stacked(prompt_row, prompt_tok), torch.int64),
        "bias": (_pairs(bias), torch.int64), "bias_val": (bias_val, torch.float32),
        "stops": (_pairs(stops), torch.int64),
    }
    if any(p.allowed_token_ids is not None for p in ps):
        allow = [(j, t) for j, p in enumerate(ps) for t in (p.allowed_token_ids or ())]
        host["allow"] = (_pairs(allow), torch.int64)
        host["restricted"] = ([p.allowed_token_ids is not None for p in ps], torch.uint8)
    words = [(j, w) for j, k in enumerate(rows) for w in reqs[k].bad_word_ids]
    width = max((len(w) - 1 for _, w in words), default=0)
    if words:
        host.update(_bad_words(words, width, [reqs[k] for k in rows]))
    # (eager: a post-forward with penalties runs no graph. The histories of many penalized
    # requests with long prompts outgrew the buffer, which is sized for a step's metadata, and
    # the step failed for every request in it.)
    refs = {k: stg.add_eager(v, dt) for k, (v, dt) in host.items()}
    return StagedPenalties(refs, any(p.repetition_penalty != 1 for p in ps), any(p.min_tokens for p in ps))


def _bad_words(words: list[tuple[int, tuple]], width: int, reqs: list) -> dict:
    """The bad-word arrays of `PenaltyBatch`: each word's row, last token and the others
    right-aligned in `width` columns (-2: any token), and each row's last `width` output
    tokens (-1 where the output is shorter)."""
    prefix = np.full((len(words), width), -2, dtype=np.int64)
    for i, (_, w) in enumerate(words):
        if len(w) > 1:
            prefix[i, width - len(w) + 1:] = w[:-1]
    tail = np.full((len(reqs), width), -1, dtype=np.int64)
    for j, r in enumerate(reqs):
        out = r.output_token_ids[-width:] if width else []
        if out:
            tail[j, width - len(out):] = out
    return {"bad_row": ([j for j, _ in words], torch.int64), "bad_last": ([w[-1] for _, w in words], torch.int64),
            "bad_prefix": (prefix, torch.int64), "tail": (tail, torch.int64)}


@dataclass
class StagedLogprobs:
    """Rows of the verify batch that report logprobs, and the most alternatives any asks for."""

    rows: object     # staging handle [L] int64
    k: int


def stage_logprobs(stg: Staging, reqs: list) -> StagedLogprobs | None:
    rows = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
    if not rows:
        return None
    return StagedLogprobs(stg.add(rows, torch.int64), max(reqs[i].params.logprobs for i in rows))


def token_logprobs(logits: torch.Tensor, N: int, path: torch.Tensor, emitted: torch.Tensor, k: int,
                   reqs: torch.Tensor | None = None) -> torch.Tensor:
    """[L, D+1, 1 + 2k] float32 for L requests' emitted tokens: the token's raw log-probability,
    then the k most likely tokens' log-probabilities and ids (ids as floats: exact below 2**24).
    `logits` [B*N, V] raw target logits of the nodes (request i's node j in row i*N + j);
    `reqs` [L] the requests that report (None: all B); the token emitted at depth d was chosen
    at node path[:, d] (`path`, `emitted` [L, D+1]). On CUDA the chosen rows' logsumexp
    reads them where they lie, one pass over each (`device.logprobs`); their top k, a copy."""
    L, D1 = path.shape
    first = (reqs if reqs is not None else torch.arange(L, device=path.device)) * N
    at = (first.unsqueeze(1) + path).reshape(-1)
    return logprob_rows(logits, at, emitted.reshape(-1), k).view(L, D1, -1)


def unpack_logprobs(rows: list, k: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """One request's `token_logprobs` rows (host lists) as (logprob, ((token id, logprob),) * k)
    per emitted token. Tuples of numbers only, which the cyclic garbage collector stops
    tracking: with lists, the entries a long answer accumulates made full collections walk
    them again and again (0.23-0.30 s of a 5.6 s run at b = 64 with logprobs=5 on the H200)."""
    K = (len(rows[0]) - 1) // 2 if rows else 0
    return [(r[0], tuple(zip(map(int, r[1 + K:1 + K + k]), r[1:1 + k]))) for r in rows]


def _first_k(lp: torch.Tensor, k: int) -> torch.Tensor:
    """Logprob rows [..., 1 + 2K] cut to [..., 1 + 2k] (k <= K): what the host converts."""
    K = (lp.shape[-1] - 1) // 2
    if k >= K:
        return lp
    return torch.cat([lp[..., :1 + k], lp[..., 1 + K:1 + K + k]], dim=-1)


def prompt_logprob_rows(plan, lay) -> list[tuple[int, int, list[int], list[int]]]:
    """(request index, first position, query rows, prompt tokens they predict) of the
    requests in `plan` that want prompt logprobs and prefill in it: row j of a chunk starting
    at position c predicts the prompt token at c + j + 1."""
    out = []
    for i, (s, L) in enumerate(zip(plan.scheduled, lay.reqs)):
        r = s.req
        if r.params.prompt_logprobs is None:
            continue
        c, n = r.num_computed, r.num_prompt_tokens
        js = [j for j in range(L.n_new) if c + j + 1 < n]
        if js:
            out.append((i, c + 1, [L.row0 + j for j in js], [r.prompt_token_ids[c + j + 1] for j in js]))
    return out


def prompt_logprobs(lm_head, hidden: torch.Tensor, rows: list, k: int) -> torch.Tensor:
    """[R, 1 + 2k] rows of `rows` (from `prompt_logprob_rows`): as `token_logprobs`, for the
    prompt tokens each query row predicts."""
    q = torch.tensor([x for _, _, rs, _ in rows for x in rs], dtype=torch.long).to(hidden.device)
    tgt = torch.tensor([x for _, _, _, ts in rows for x in ts], dtype=torch.long).to(hidden.device)
    return logprob_rows(lm_head(hidden[q]), torch.arange(q.numel(), device=hidden.device), tgt, k)


def attach_logprobs(plan, verify: list, lp, results: list, every_row: bool = False) -> None:
    """Put a step's output logprobs (the host copy of the logprob rows of its requests that
    asked for them, in verify order; `every_row`: of every verify row, as a post graph computes
    them) on their StepResults, one entry per emitted token."""
    asked = [(k, i) for k, i in enumerate(verify) if plan.scheduled[i].req.params.logprobs is not None]
    if every_row:
        if len(asked) < lp.shape[0]:   # (index_select: list indexing costs ms on the host)
            lp = lp.index_select(0, torch.tensor([k for k, _ in asked]))
    lp = _first_k(lp, max(plan.scheduled[i].req.params.logprobs for _, i in asked))
    for (_, i), rows in zip(asked, lp.tolist()):
        results[i].logprobs = unpack_logprobs(rows[:len(results[i].emitted)], plan.scheduled[i].req.params.logprobs)


def attach_prompt_logprobs(plan, prompt_lp: tuple, results: list) -> None:
    """Put a step's prompt logprobs (rows from `prompt_logprob_rows`, their host copy) on the
    StepResults of their requests, as (first position, `unpack_logprobs` entries)."""
    rows, t = prompt_lp
    t = t.tolist()
    at = 0
    for i, first, qs, _ in rows:
        k = plan.scheduled[i].req.params.prompt_logprobs
        results[i].prompt_logprobs = (first, unpack_logprobs(t[at:at + len(qs)], k))
        at += len(qs)
