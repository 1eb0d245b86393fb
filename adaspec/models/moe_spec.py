"""What a mixture-of-experts model's config says about its sparse layers (`MoeSpec`): read by
`models/moe.py` (`parse_moe`), carried by `models/llama.py`'s ModelSpec. A module of its own so
that the dense decoder can name the type without importing the MoE decoders built on it."""
from __future__ import annotations

from dataclasses import dataclass

from adaspec.layers.moe import RouterConfig


@dataclass(frozen=True)
class MoeSpec:
    router: RouterConfig
    intermediate_size: int            # per routed expert
    sparse_layers: tuple              # per layer: True = sparse block, False = dense MLP
    layout: str                       # key of models/moe.py LAYOUTS
    shared_intermediate_size: int = 0  # 0: no shared expert
    shared_gate: bool = False         # Qwen2-MoE: sigmoid(shared_expert_gate(x)) * shared(x)
    router_bias: bool = False         # e_score_correction_bias (selection only)
    router_fp32: bool = False         # GLM: router weight, logits and weights in fp32 (HF keeps them so)
    round_weights: bool = False       # Qwen: routing weights rounded to the model dtype before use
    # Expert parallelism (parallel/shard.py): (first, count) of the routed experts this rank holds
    # whole; None: all of them (one rank, or every expert cut by tensor parallelism).
    local_experts: tuple[int, int] | None = None
