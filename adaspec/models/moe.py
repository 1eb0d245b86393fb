"""Mixture-of-experts decoders: Qwen2-MoE, Qwen3-MoE, Mixtral and GLM-4.5 (Glm4Moe).

They are the Llama decoder (models/llama.py: attention, norms, rotary, EAGLE-3 capture, forward
context) with some layers' MLP replaced by a sparse block:

    weights, ids = router(x)                        # layers/moe/routing.py, per RouterConfig
    y = sum_j weights_j * expert_{ids_j}(x)         # layers/moe: Triton on CUDA, else a torch loop
    y += shared(x)                                  # GLM n_shared_experts; Qwen2-MoE shared expert,
                                                    #   scaled by sigmoid(shared_expert_gate(x))

Experts are stored stacked, w13 [E, 2I, H] (gate rows then up rows) and w2 [E, H, I], filled at
load time from the per-expert tensors checkpoints publish (`checkpoint_parts`). Which layers
are sparse: Qwen `decoder_sparse_step` / `mlp_only_layers`, GLM `first_k_dense_replace`.

`parse_moe(arch, cfg)` reads config.json; a routing option adaspec does not implement (an
unknown expert/router key, or a known key with a value other than the implemented one) is a
ValueError naming it, never silently ignored.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from adaspec.layers.linear import linear
from adaspec.layers.moe import RouterConfig, fused_experts, route
from adaspec.models.llama import MLP, LlamaForCausalLM, ModelSpec
from adaspec.models.moe_spec import MoeSpec


@dataclass(frozen=True)
class ExpertLayout:
    """Checkpoint names of one architecture's sparse block, below `model.layers.{i}.`."""

    block: str                 # the MLP's module name
    gate: str                  # per-expert projections: experts.{e}.{gate|up|down}.weight
    up: str
    down: str
    shared: str = ""           # shared expert(s) module name


LAYOUTS = {
    "qwen": ExpertLayout("mlp", "gate_proj", "up_proj", "down_proj", shared="shared_expert"),
    "mixtral": ExpertLayout("block_sparse_moe", "w1", "w3", "w2"),
    "glm": ExpertLayout("mlp", "gate_proj", "up_proj", "down_proj", shared="shared_experts"),
}


# ---- config parsing ---------------------------------------------------------------------------

# Keys that look like routing options; each architecture lists the ones it implements.
_ROUTING_KEY = re.compile(r"expert|router|topk|top_k|^moe_|^n_group$|routed|scoring|dense_replace|"
                          r"sparse_step|mlp_only|moe_layer")
# Present in published configs, meaningless for inference (training losses and noise).
_IGNORED = {"output_router_logits", "router_aux_loss_coef", "router_jitter_noise", "router_z_loss_coef"}


def _check_keys(arch: str, cfg: dict, understood: set[str], fixed: dict) -> None:
    """Refuse routing keys `arch` does not implement; `fixed` = keys allowed only at one value."""
    for key in sorted(cfg):
        if not _ROUTING_KEY.search(key) or key in _IGNORED or key in understood:
            continue
        if key in fixed:
            if cfg[key] is not None and cfg[key] != fixed[key]:
                raise ValueError(f"{arch}: unsupported routing option {key}={cfg[key]!r} (adaspec implements "
                                 f"{key}={fixed[key]!r} only)")
            continue
        raise ValueError(f"{arch}: unsupported routing option {key}={cfg[key]!r} (not implemented by adaspec)")


def _qwen(arch: str, cfg: dict, L: int, shared: bool) -> tuple[MoeSpec, dict]:
    understood = {"num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"}
    if shared:
        understood.add("shared_expert_intermediate_size")
    _check_keys(arch, cfg, understood, {"scoring_func": "softmax"})
    E = cfg.get("num_experts", cfg.get("num_local_experts", 0)) or 0
    step = cfg.get("decoder_sparse_step", 1) or 1
    dense = set(cfg.get("mlp_only_layers") or [])
    sparse = tuple(i not in dense and E > 0 and (i + 1) % step == 0 for i in range(L))
    router = RouterConfig("softmax", max(E, 1), cfg.get("num_experts_per_tok", 1) if E else 1,
                          renormalize=bool(cfg.get("norm_topk_prob", False)))
    over = {}
    if shared:
        over["qkv_bias"] = bool(cfg.get("qkv_bias", True))  # Qwen2-MoE: q/k/v bias unless told otherwise
    elif cfg.get("attention_bias"):
        raise ValueError(f"{arch}: attention_bias=true is not supported (Qwen3-MoE would put a bias on o_proj too)")
    spec = MoeSpec(router, cfg.get("moe_intermediate_size", 0), sparse, "qwen",
                   shared_intermediate_size=cfg.get("shared_expert_intermediate_size", 0) if shared else 0,
                   shared_gate=shared, round_weights=True)
    return spec, over


def _qwen3(cfg: dict, L: int):
    return _qwen("Qwen3MoeForCausalLM", cfg, L, shared=False)


def _qwen2(cfg: dict, L: int):
    return _qwen("Qwen2MoeForCausalLM", cfg, L, shared=True)


def _mixtral(cfg: dict, L: int):
    arch = "MixtralForCausalLM"
    _check_keys(arch, cfg, {"num_local_experts", "num_experts_per_tok"}, {"scoring_func": "softmax"})
    router = RouterConfig("softmax", cfg.get("num_local_experts", 8), cfg.get("num_experts_per_tok", 2),
                          renormalize=True)
    # Mixtral's expert width is the config's intermediate_size; every layer is sparse.
    return MoeSpec(router, cfg["intermediate_size"], (True,) * L, "mixtral"), {}


def _glm4(cfg: dict, L: int):
    arch = "Glm4MoeForCausalLM"
    _check_keys(arch, cfg, {"n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                            "n_group", "topk_group", "routed_scaling_factor", "n_shared_experts",
                            "first_k_dense_replace"},
                {"scoring_func": "sigmoid", "topk_method": "noaux_tc"})
    E = cfg.get("n_routed_experts", 128)
    router = RouterConfig("sigmoid_group", E, cfg.get("num_experts_per_tok", 8),
                          renormalize=bool(cfg.get("norm_topk_prob", True)), n_group=cfg.get("n_group", 1) or 1,
                          topk_group=cfg.get("topk_group", 1) or 1,
                          scaling=float(cfg.get("routed_scaling_factor", 1.0)))
    inter = cfg.get("moe_intermediate_size", 1408)
    first_dense = cfg.get("first_k_dense_replace", 1)
    spec = MoeSpec(router, inter, tuple(i >= first_dense for i in range(L)), "glm",
                   shared_intermediate_size=inter * (cfg.get("n_shared_experts", 1) or 0),
                   router_bias=True, router_fp32=True)
    return spec, {"qk_norm": bool(cfg.get("use_qk_norm", False)), "partial_rotary_default": 0.5}


#: architecture -> config parser returning (MoeSpec, ModelSpec field overrides)
MOE_PARSERS: dict[str, Callable[[dict, int], tuple[MoeSpec, dict]]] = {
    "Qwen3MoeForCausalLM": _qwen3, "Qwen2MoeForCausalLM": _qwen2,
    "MixtralForCausalLM": _mixtral, "Glm4MoeForCausalLM": _glm4,
}


# ---- modules ----------------------------------------------------------------------------------

class Router(nn.Module):
    """gate.weight [E, H] (+ e_score_correction_bias [E]) -> (weights fp32 [T, k], ids [T, k])."""

    def __init__(self, hidden: int, moe: MoeSpec):
        super().__init__()
        self.cfg = moe.router
        self.weight = nn.Parameter(torch.empty(moe.router.num_experts, hidden))
        if moe.router_bias:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(moe.router.num_experts), requires_grad=False)
        self.has_bias = moe.router_bias
        self.keep_fp32 = moe.router_fp32   # the loader keeps this module in fp32

    def forward(self, x: torch.Tensor):
        logits = F.linear(x.float(), self.weight.float()) if self.keep_fp32 else linear(x, self.weight)
        return route(logits, self.cfg, self.e_score_correction_bias if self.has_bias else None)


class Experts(nn.Module):
    """The routed experts this rank holds, stacked: all of them, or under expert parallelism the
    run `moe.local_experts`, whose forward is this rank's part of the sum (the rest is 0)."""

    def __init__(self, hidden: int, moe: MoeSpec):
        super().__init__()
        I = moe.intermediate_size
        self.first, count = moe.local_experts or (None, moe.router.num_experts)
        self.routed = moe.router.num_experts if moe.local_experts else None   # set with first
        self.w13 = nn.Parameter(torch.empty(count, 2 * I, hidden))
        self.w2 = nn.Parameter(torch.empty(count, hidden, I))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                round_weights: bool = False) -> torch.Tensor:
        return fused_experts(x, self.w13, self.w2, weights, ids, round_weights, self.first, self.routed)


class SparseMoeBlock(nn.Module):
    """[T, H] -> [T, H]: routed experts, plus the shared expert(s) if the architecture has them."""

    def __init__(self, hidden: int, moe: MoeSpec):
        super().__init__()
        self.gate = Router(hidden, moe)
        self.experts = Experts(hidden, moe)
        self.shared = MLP(hidden, moe.shared_intermediate_size) if moe.shared_intermediate_size else None
        self.shared_gate = nn.Linear(hidden, 1, bias=False) if moe.shared_gate and self.shared is not None else None
        self.round_weights = moe.round_weights

    def fuse(self) -> None:
        if self.shared is not None:
            self.shared.fuse()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        y = self.experts(x, weights, ids, self.round_weights)
        if self.shared is not None:
            s = self.shared(x)
            if self.shared_gate is not None:
                s = torch.sigmoid(self.shared_gate(x)) * s
            y = y + s
        return y


_EXPERT_PARAM = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(w13|w2)$")
# transformers >= 5 names (its modules in memory): a layer's experts stacked under `mlp`.
_STACKED = re.compile(r"^(model\.layers\.\d+)\.mlp\.(experts\.gate_up_proj|experts\.down_proj|gate\.weight)$")


class MoeForCausalLM(LlamaForCausalLM):
    """The Llama-family decoder with sparse blocks where `spec.moe.sparse_layers` says."""

    def __init__(self, spec: ModelSpec):
        if spec.moe is None:
            raise ValueError("MoeForCausalLM needs a ModelSpec with moe set")
        super().__init__(spec)

    @property
    def layout(self) -> ExpertLayout:
        return LAYOUTS[self.spec.moe.layout]

    def make_mlp(self, spec: ModelSpec, layer_idx: int) -> nn.Module:
        if spec.moe.sparse_layers[layer_idx]:
            return SparseMoeBlock(spec.hidden_size, spec.moe)
        return MLP(spec.hidden_size, spec.intermediate_size)

    def warm_up_kernels(self, max_tokens: int | None = None) -> int:
        """Compile the fused-MoE kernels for every launch bucket up to `max_tokens` tokens a step
        (CUDA only; the runner's warm-up calls this before serving, as it warms the attention
        kernels). Returns launches."""
        block = next((layer.mlp for layer in self.layers if isinstance(layer.mlp, SparseMoeBlock)), None)
        w13 = block.experts.w13 if block is not None else None
        from adaspec.layers.fused_ops import use_triton

        if w13 is None or not use_triton(w13):
            return 0
        from adaspec.layers.moe.triton_kernels import warm_up

        x = torch.zeros(1, self.spec.hidden_size, dtype=w13.dtype, device=w13.device)
        block.gate(x)  # the fused router
        return 1 + warm_up(w13, block.experts.w2, self.spec.moe.router.top_k, w13.dtype, block.round_weights,
                           max_tokens, block.experts.routed)

    def checkpoint_name(self, param_name: str) -> str:
        name = super().checkpoint_name(param_name)
        lay = self.layout
        name = name.replace(".mlp.shared_gate.", ".mlp.shared_expert_gate.")
        name = name.replace(".mlp.shared.", f".mlp.{lay.shared}.")
        return name.replace(".mlp.", f".{lay.block}.", 1) if lay.block != "mlp" else name

    def split_checkpoint_tensor(self, name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
        """A checkpoint written from transformers 5's state dict (not by save_pretrained, which
        writes the published per-expert layout) keeps a layer's experts stacked, as its modules
        hold them: `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows, then up rows) and
        `mlp.experts.down_proj` [E, H, I], and Mixtral's router under `mlp` too. Read as the
        per-expert tensors they stand for (the loader's `split`); None: a tensor left as it is."""
        m = _STACKED.match(name)
        if m is None:
            return None
        lay = self.layout
        pre, what = f"{m.group(1)}.{lay.block}", m.group(2)
        if what == "gate.weight":   # the router: only Mixtral's block has another name
            return [(f"{pre}.gate.weight", t)] if lay.block != "mlp" else None
        if t.dim() != 3 or (what.endswith("gate_up_proj") and t.shape[1] % 2):
            raise ValueError(f"{name} has shape {tuple(t.shape)}: expected stacked experts [E, 2I, H] / [E, H, I]")
        if what.endswith("down_proj"):
            return [(f"{pre}.experts.{e}.{lay.down}.weight", t[e]) for e in range(t.shape[0])]
        inter = t.shape[1] // 2
        return [(f"{pre}.experts.{e}.{proj}.weight", t[e, o:o + inter])
                for e in range(t.shape[0]) for proj, o in ((lay.gate, 0), (lay.up, inter))]

    def checkpoint_parts(self, param_name: str) -> list[tuple[str, tuple]] | None:
        """Stacked expert tensors come from E (w2) or 2E (w13: gate rows, then up rows)
        per-expert checkpoint tensors: [(checkpoint name, index into the parameter)]."""
        m = _EXPERT_PARAM.match(param_name)
        if m is None:
            return None
        i, which = int(m.group(1)), m.group(2)
        lay, moe = self.layout, self.spec.moe
        I = moe.intermediate_size
        first, count = moe.local_experts or (0, moe.router.num_experts)   # expert parallelism: this rank's
        pre = f"model.layers.{i}.{lay.block}.experts"
        if which == "w2":
            return [(f"{pre}.{first + e}.{lay.down}.weight", (e,)) for e in range(count)]
        return [(f"{pre}.{first + e}.{proj}.weight", (e, slice(o, o + I)))
                for e in range(count) for proj, o in ((lay.gate, 0), (lay.up, I))]
