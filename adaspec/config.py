"""Frozen configuration of an engine: what to load, how big the cache is, how to schedule,
how to speculate. Everything user-facing funnels into `EngineConfig.create(**kwargs)`, which
is shared by the offline `LLM`, the server and the command line (`add_engine_cli_args`)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields

SPECULATION_POLICIES = ("off", "always", "threshold", "auto")
GENERATION_CONFIG_MODES = ("auto", "none")


def _require(ok: bool, name: str, flag: str, what: str, value) -> None:
    """A ValueError naming the keyword and its command-line flag, e.g.
    "max_num_seqs (--max-num-seqs) must be >= 1, got 0"."""
    if not ok:
        raise ValueError(f"{name} ({flag}) must be {what}, got {value!r}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int | None = None        # explicit pool size wins over the memory budget
    memory_bytes: int | None = None      # KV budget; default: 128 MiB on CPU, on CUDA
                                         # gpu_memory_utilization of free memory less 4 GiB
    gpu_memory_utilization: float = 0.90
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        bs = self.block_size
        _require(isinstance(bs, int) and 1 <= bs <= 256 and bs & (bs - 1) == 0, "block_size", "--block-size",
                 "a power of two from 1 to 256", bs)
        _require(self.num_blocks is None or self.num_blocks >= 1, "num_kv_blocks", "--num-kv-blocks", ">= 1",
                 self.num_blocks)
        _require(self.memory_bytes is None or self.memory_bytes > 0, "kv_cache_memory", "--kv-cache-memory",
                 "> 0 bytes", self.memory_bytes)
        _require(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization", "--gpu-memory-utilization",
                 "in (0, 1]", self.gpu_memory_utilization)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192   # per-step token budget (chunked prefill)
    max_model_len: int | None = None     # default: the model's max_position_embeddings
    # While requests decode, a step's prefill tokens are capped (engine/prefill_pacer.py): by
    # measurement so a step costs at most ~2x a decode-only step (0, the default), or at this many.
    long_prefill_token_threshold: int = 0

    def __post_init__(self) -> None:
        _require(self.max_num_seqs >= 1, "max_num_seqs", "--max-num-seqs", ">= 1", self.max_num_seqs)
        _require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "--max-num-batched-tokens", ">= 1",
                 self.max_num_batched_tokens)
        _require(self.long_prefill_token_threshold >= 0, "long_prefill_token_threshold",
                 "--long-prefill-token-threshold", ">= 0", self.long_prefill_token_threshold)
        _require(self.max_model_len is None or self.max_model_len >= 2, "max_model_len", "--max-model-len",
                 ">= 2 (a prompt token and a generated one)", self.max_model_len)


@dataclass(frozen=True)
class SpecConfig:
    """Speculation. Shapes follow SGLang: `num_steps` draft forwards (tree depth), `topk`
    branches per step, `num_draft_tokens` tokens verified per request including the root
    (a chain of k has num_steps=k, topk=1, num_draft_tokens=k+1)."""

    draft: str | None = None
    policy: str = "off"
    num_steps: int = 3
    topk: int = 1
    num_draft_tokens: int | None = None
    spec_disable_batch_size: int | None = None
    hysteresis: int | None = None            # threshold policy: re-enable below N - hysteresis
    simulate_accept_rate: float | None = None
    simulate_seed: int = 0
    auto_profile: bool = True                # auto policy: short start-up profile of step times

    def __post_init__(self) -> None:
        if self.policy not in SPECULATION_POLICIES:
            raise ValueError(f"speculation must be one of {SPECULATION_POLICIES}, got {self.policy!r}")
        if self.num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {self.num_steps}")
        if self.topk < 1:
            raise ValueError(f"topk must be >= 1, got {self.topk}")
        n = self.resolved_num_draft_tokens
        if n < 2 or n > 1 + self.topk + (self.num_steps - 1) * self.topk * self.topk:
            raise ValueError(
                f"num_draft_tokens={n} impossible for num_steps={self.num_steps}, topk={self.topk} "
                f"(at most {1 + self.topk + (self.num_steps - 1) * self.topk * self.topk})")
        if self.topk == 1 and n > self.num_steps + 1:
            raise ValueError(f"a chain (topk=1) of num_steps={self.num_steps} verifies at most "
                             f"{self.num_steps + 1} tokens, got num_draft_tokens={n}")
        if self.policy == "threshold" and (self.spec_disable_batch_size is None or self.spec_disable_batch_size < 1):
            raise ValueError("speculation='threshold' needs spec_disable_batch_size "
                             "(--spec-disable-batch-size) >= 1")
        if self.policy != "off" and self.draft is None:
            raise ValueError(f"speculation={self.policy!r} needs a draft model (draft=DIR, --draft DIR)")
        if self.simulate_accept_rate is not None and not (0.0 <= self.simulate_accept_rate <= 1.0):
            raise ValueError(f"spec_simulate_accept_rate must be in [0, 1], got {self.simulate_accept_rate}")

    @property
    def resolved_num_draft_tokens(self) -> int:
        return self.num_draft_tokens if self.num_draft_tokens is not None else self.num_steps + 1

    @property
    def enabled(self) -> bool:
        return self.policy != "off" and self.draft is not None


@dataclass(frozen=True)
class EngineConfig:
    model: str
    tokenizer: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    load_format: str = "auto"            # "auto" (safetensors) | "dummy" (random weights)
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    served_model_name: str | None = None
    attention_backend: str = "auto"      # "auto" (triton on CUDA, else torch) | "triton" | "torch"
    enforce_eager: bool = False          # no CUDA graphs
    # Plan and launch step N+1 while the device runs step N (SGLang's overlap scheduler, vLLM's
    # async scheduling). Outputs are identical either way; off = one step at a time.
    overlap: bool = True
    # "auto": sampling fields a request leaves out come from the model's generation_config.json
    # (like vLLM's --generation-config auto); "none": adaspec's own defaults (OpenAI's).
    generation_config: str = "auto"
    # Tensor parallelism: one process per rank (rank 0 is this one and plans every step; the
    # others are spawned workers). 1 = today's single-process engine, no extra processes.
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        _require(isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1,
                 "tensor_parallel_size", "--tensor-parallel-size", "an integer >= 1", self.tensor_parallel_size)
        if self.attention_backend not in ("auto", "triton", "torch"):
            raise ValueError(f"attention_backend must be auto, triton or torch, got {self.attention_backend!r}")
        if self.generation_config not in GENERATION_CONFIG_MODES:
            raise ValueError(f"generation_config must be one of {GENERATION_CONFIG_MODES}, "
                             f"got {self.generation_config!r}")

    @classmethod
    def create(cls, model: str, **kw) -> "EngineConfig":
        """Build from flat keyword arguments (the LLM / CLI vocabulary). Unknown keys raise."""
        groups = {"cache": CacheConfig, "scheduler": SchedulerConfig, "spec": SpecConfig}
        aliases = {"speculation": "policy", "spec_simulate_accept_rate": "simulate_accept_rate",
                   "num_kv_blocks": "num_blocks", "kv_cache_memory": "memory_bytes",
                   "spec_hysteresis": "hysteresis"}
        top = {f.name for f in fields(cls)} - set(groups)
        parts: dict[str, dict] = {g: {} for g in groups}
        own: dict = {}
        for key, value in kw.items():
            name = aliases.get(key, key)
            if name in top:
                own[name] = value
                continue
            for g, klass in groups.items():
                if name in {f.name for f in fields(klass)}:
                    parts[g][name] = value
                    break
            else:
                raise TypeError(f"unknown engine option {key!r}")
        if parts["spec"].get("draft") is not None and "policy" not in parts["spec"]:
            parts["spec"]["policy"] = "always"
        return cls(model=model, **own, **{g: groups[g](**v) for g, v in parts.items()})


def add_engine_cli_args(p: argparse.ArgumentParser) -> None:
    """The engine options every command shares (serve, generate, compare)."""
    p.add_argument("--model", default=None,
                   help="local Hugging Face model directory (default: the bundled demo pair, "
                        "its EAGLE-3 head as --draft and --speculation auto)")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--draft", default=None, help="EAGLE-3 head directory")
    p.add_argument("--speculation", choices=SPECULATION_POLICIES, default=None,
                   help="default: 'always' with a draft, else 'off'")
    p.add_argument("--spec-disable-batch-size", type=int, default=None)
    p.add_argument("--num-steps", type=int, default=3)
    p.add_argument("--topk", type=int, default=1)
    p.add_argument("--num-draft-tokens", type=int, default=None)
    p.add_argument("--spec-simulate-accept-rate", type=float, default=None,
                   help="benchmarking only: accept each draft token with this probability")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--kv-cache-memory", type=int, default=None, help="bytes")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.90)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="while requests decode, cap a step's prefill tokens at this many (at least 4 per decode "
                        "token); 0: paced by measurement so long prompts at most double running streams' "
                        "inter-token latency")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--attention-backend", default="auto", choices=["auto", "triton", "torch"])
    p.add_argument("--enforce-eager", action="store_true", help="run without CUDA graphs")
    p.add_argument("--no-overlap", dest="overlap", action="store_false",
                   help="run steps one at a time (by default the CPU plans step N+1 while the GPU runs step N)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="shard the target over this many GPUs (one worker process per extra GPU; "
                        "gloo processes on CPU)")
    p.add_argument("--generation-config", default="auto", choices=GENERATION_CONFIG_MODES,
                   help="auto: sampling fields a request leaves out (temperature, top_p, top_k, min_p) "
                        "default to the model's generation_config.json; none: to 1.0 / 1.0 / -1 / 0.0")


def engine_kwargs_from_cli(a: argparse.Namespace) -> dict:
    """Map parsed `add_engine_cli_args` flags to `EngineConfig.create` keywords."""
    kw = dict(tokenizer=a.tokenizer, device=a.device, dtype=a.dtype, load_format=a.load_format,
              seed=a.seed, block_size=a.block_size, num_blocks=a.num_kv_blocks,
              memory_bytes=a.kv_cache_memory, gpu_memory_utilization=a.gpu_memory_utilization,
              enable_prefix_caching=not a.no_prefix_caching, max_num_seqs=a.max_num_seqs,
              max_num_batched_tokens=a.max_num_batched_tokens,
              long_prefill_token_threshold=a.long_prefill_token_threshold, max_model_len=a.max_model_len,
              served_model_name=a.served_model_name, generation_config=a.generation_config, draft=a.draft, num_steps=a.num_steps,
              topk=a.topk, num_draft_tokens=a.num_draft_tokens,
              spec_disable_batch_size=a.spec_disable_batch_size,
              simulate_accept_rate=a.spec_simulate_accept_rate,
              attention_backend=a.attention_backend, enforce_eager=a.enforce_eager, overlap=a.overlap,
              tensor_parallel_size=a.tensor_parallel_size)
    if a.speculation is not None:
        kw["policy"] = a.speculation
    return kw
