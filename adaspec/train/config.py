"""What a training run does (`TrainConfig`, frozen and checked on construction) and which
target layers feed the head (`resolve_aux_layers`).

Aux layers are target layer *inputs* (index L = the final pre-norm hidden), three distinct
ones, kept in layer order: SGLang, vLLM and EAGLE capture each listed layer once and
concatenate the features in layer order, so a head trained on a repeated or permuted list
would get a different fc input there than it was trained on.
"""
from __future__ import annotations

from dataclasses import dataclass

from adaspec.spec_decode.eagle3_checkpoint import default_aux_layers, distinct_aux_layers

# Eval configurations of the end-of-training acceptance measurement: (num_steps, topk, num_draft_tokens).
DEFAULT_EVAL_SPECS = ((4, 1, 5), (2, 4, 16))
NUM_AUX_LAYERS = 3   # SGLang's and vLLM's fc reads three target features


@dataclass(frozen=True)
class TrainConfig:
    """What `train_eagle3_head` does; the defaults suit tiny test models (see the CLI for real ones)."""

    steps: int = 300
    seq_len: int = 48                    # tokens per training sequence (prompt + continuation)
    batch_size: int = 16
    lr: float = 1e-2
    ttt_steps: int = 3                   # unrolled draft steps per position
    step_weight: float = 0.8             # loss weight of unrolled step k is step_weight**k
    loss: str = "soft"                   # "soft": CE against the target's distribution; "hard": its argmax
    seed: int = 0
    num_sequences: int = 1024            # training + held-out sequences built from the data
    prompt_len: int = 8                  # prompt tokens of a window (files, random prompts)
    eval_fraction: float = 0.125
    aux_layers: tuple[int, ...] | None = None
    init_lm_head_from_target: bool = True
    data: tuple[str, ...] = ()           # files / folders / jsonl; empty = random prompts
    regenerate: bool = True              # file windows: continue the prompt with the target
    regenerate_with: str = "engine"      # "engine" (adaspec) or "hf" (transformers' greedy loop)
    draft_vocab_size: int | None = None  # None = the target's full vocabulary
    device: str = "cpu"
    dtype: str = "auto"                  # auto: bfloat16 on GPU, float32 on CPU
    checkpoint_every: int = 0
    resume: bool = False
    log_every: int = 0
    time_limit_s: float | None = None    # stop (and checkpoint) once training has run this long
    eval_prompts: int = 0                # held-out prompts for the engine acceptance measurement
    eval_max_tokens: int = 64
    eval_specs: tuple[tuple[int, int, int], ...] = DEFAULT_EVAL_SPECS
    progress: bool = False

    def __post_init__(self) -> None:
        if self.seq_len < self.ttt_steps + 2 or self.prompt_len < 1 or self.prompt_len >= self.seq_len:
            raise ValueError(f"need ttt_steps + 2 <= seq_len and 1 <= prompt_len < seq_len "
                             f"(seq_len={self.seq_len}, prompt_len={self.prompt_len}, ttt_steps={self.ttt_steps})")
        if self.steps < 1 or self.batch_size < 1 or self.ttt_steps < 1 or self.num_sequences < 2:
            raise ValueError("steps, batch_size and ttt_steps must be >= 1 and num_sequences >= 2")
        if self.loss not in ("soft", "hard"):
            raise ValueError(f"loss must be 'soft' or 'hard', got {self.loss!r}")
        if self.regenerate_with not in ("engine", "hf"):
            raise ValueError(f"regenerate_with must be 'engine' or 'hf', got {self.regenerate_with!r}")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"dtype must be auto, float32 or bfloat16, got {self.dtype!r}")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 2:
            raise ValueError(f"draft_vocab_size must be >= 2, got {self.draft_vocab_size}")


def small_target_aux_layers(num_layers: int) -> tuple[int, ...]:
    """Three distinct capture layers where the upstream default repeats one
    (`eagle3_checkpoint.distinct_aux_layers`)."""
    return distinct_aux_layers(num_layers)


def resolve_aux_layers(requested: tuple[int, ...] | None, num_layers: int) -> tuple[tuple[int, ...], bool]:
    """(aux layers in layer order, whether they are the upstream default, i.e. need not be
    written). Refuses a list that is not three distinct layer inputs in [0, L]."""
    L = num_layers
    if requested is None:
        upstream = default_aux_layers(L)
        if len(set(upstream)) == NUM_AUX_LAYERS and all(0 <= i <= L for i in upstream):
            return tuple(sorted(upstream)), tuple(sorted(upstream)) == upstream
        return small_target_aux_layers(L), False
    if len(requested) != NUM_AUX_LAYERS or any(not 0 <= i <= L for i in requested):
        raise ValueError(f"aux_layers must be {NUM_AUX_LAYERS} layer indices in [0, {L}], got {requested}")
    if len(set(requested)) != len(requested):
        raise ValueError(f"aux_layers {requested} repeat a layer: SGLang and vLLM capture each layer once, "
                         f"so the head would get a narrower fc input there than it was trained on")
    layers = tuple(sorted(requested))
    return layers, layers == default_aux_layers(L)
