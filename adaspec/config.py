"""Frozen configuration of an engine: what to load, how big the cache is, how to schedule,
how to speculate. Everything user-facing funnels into `EngineConfig.create(**kwargs)`, which
is shared by the offline `LLM`, the server and the command line (`add_engine_cli_args`).

Each option is defined once, as a field made by `adaspec.options.opt` (default, flag, type,
range, help): the checks, the flags and the keywords all come from those fields."""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field, fields

from adaspec.options import add_option_args, check_fields, keyword_aliases, kwargs_from_args, opt

SPECULATION_POLICIES = ("off", "always", "threshold", "auto")
GENERATION_CONFIG_MODES = ("auto", "none")
DTYPES = ("auto", "float32", "float16", "bfloat16")


def _power_of_two(v: int) -> str | None:
    return None if 1 <= v <= 256 and v & (v - 1) == 0 else "a power of two from 1 to 256"


def _device(v: str) -> str | None:
    ok = v in ("auto", "cpu", "cuda") or (v.startswith("cuda:") and v[5:].isdigit())
    return None if ok else "auto, cpu, cuda or cuda:N"


def _chat_template(v: str) -> str | None:
    """A template given inline (vLLM accepts both) holds Jinja markup; anything else must be a file."""
    return None if os.path.isfile(v) or "{{" in v or "{%" in v else "a file or a Jinja template"


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = opt(16, "--block-size", "tokens per KV-cache block", type=int, check=_power_of_two)
    num_blocks: int | None = opt(
        None, "--num-gpu-blocks-override", "KV-cache blocks; wins over the memory budget", type=int, ge=1,
        aliases=("--num-kv-blocks",), kw_aliases=("num_kv_blocks", "num_gpu_blocks_override"),
        default_text="from the memory budget")
    memory_bytes: int | None = opt(
        None, "--kv-cache-memory-bytes", "KV-cache budget in bytes", type=int, gt=0,
        aliases=("--kv-cache-memory",), kw_aliases=("kv_cache_memory", "kv_cache_memory_bytes"),
        default_text="128 MiB on CPU; on CUDA --gpu-memory-utilization of free memory less 4 GiB")
    gpu_memory_utilization: float = opt(0.90, "--gpu-memory-utilization",
                                        "fraction of free GPU memory the engine may use", type=float, gt=0, le=1)
    enable_prefix_caching: bool = opt(True, "--enable-prefix-caching", "reuse the KV of shared prompt prefixes",
                                      type=bool, negative_alias="--no-prefix-caching")

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = opt(256, "--max-num-seqs", "requests in the running batch at most", type=int, ge=1)
    max_num_batched_tokens: int = opt(8192, "--max-num-batched-tokens",
                                      "tokens one step may hold (longer prompts prefill in chunks)", type=int, ge=1)
    # While requests decode, a step's prefill tokens are capped (engine/prefill_pacer.py): by
    # measurement so a step costs at most ~2x a decode-only step (0, the default), or at this many.
    long_prefill_token_threshold: int = opt(
        0, "--long-prefill-token-threshold", "while requests decode, cap a step's prefill tokens at this many "
        "(at least 16 per decode token); 0: paced by measurement so long prompts about double running "
        "streams' inter-token latency (more where a step's fixed cost of carrying prompt rows alone is "
        "more than that)", type=int, ge=0)
    max_model_len: int | None = opt(
        None, "--max-model-len", "context length, prompt and output together; must be >= 2 (a prompt token "
        "and a generated one)", type=int, ge=2,
        default_text="the model's max_position_embeddings, cut to what the KV cache holds")

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class SpecConfig:
    """Speculation. Shapes follow SGLang: `num_steps` draft forwards (tree depth), `topk`
    branches per step, `num_draft_tokens` tokens verified per request including the root
    (a chain of k has num_steps=k, topk=1, num_draft_tokens=k+1)."""

    draft: str | None = opt(None, "--draft", "EAGLE-3 head directory", default_text="none")
    policy: str = opt("off", "--speculation", "speculation policy", choices=SPECULATION_POLICIES,
                      kw_aliases=("speculation",))
    num_steps: int = opt(3, "--num-steps", "draft forwards per step (the depth of the chain or tree)",
                         type=int, ge=1)
    topk: int = opt(1, "--topk", "branches per draft forward (1: a chain)", type=int, ge=1)
    num_draft_tokens: int | None = opt(None, "--num-draft-tokens",
                                       "tokens verified per request and step, the root included (trees)",
                                       type=int, ge=2, default_text="num_steps + 1")
    spec_disable_batch_size: int | None = opt(
        None, "--spec-disable-batch-size", "threshold policy: no speculation above this many running requests",
        type=int, ge=1, default_text="none")
    hysteresis: int | None = opt(
        None, "--spec-hysteresis", "threshold policy: speculation resumes at or below "
        "--spec-disable-batch-size minus this", type=int, ge=0, kw_aliases=("spec_hysteresis",),
        default_text="a quarter of --spec-disable-batch-size")
    simulate_accept_rate: float | None = opt(
        None, "--spec-simulate-accept-rate", "benchmarking only: accept each draft token with this probability",
        type=float, ge=0, le=1, kw_aliases=("spec_simulate_accept_rate",), default_text="off")
    simulate_seed: int = opt(0, None, "seed of the simulated acceptance", type=int)
    auto_profile: bool = opt(True, "--spec-auto-profile",
                             "auto policy: time each draft depth at start-up to seed its cost table", type=bool)

    def __post_init__(self) -> None:
        check_fields(self)
        n = self.resolved_num_draft_tokens
        most = 1 + self.topk + (self.num_steps - 1) * self.topk * self.topk
        if n > most:
            raise ValueError(f"num_draft_tokens (--num-draft-tokens) {n} impossible for --num-steps "
                             f"{self.num_steps} and --topk {self.topk} (at most {most})")
        if self.topk == 1 and n > self.num_steps + 1:
            raise ValueError(f"a chain (--topk 1) of --num-steps {self.num_steps} verifies at most "
                             f"{self.num_steps + 1} tokens, got --num-draft-tokens {n}")
        if self.policy == "threshold" and self.spec_disable_batch_size is None:
            raise ValueError("--speculation threshold needs --spec-disable-batch-size N "
                             "(spec_disable_batch_size) >= 1")
        if self.policy != "off" and self.draft is None:
            raise ValueError(f"--speculation {self.policy} needs a draft model (--draft DIR, draft=DIR)")

    @property
    def resolved_num_draft_tokens(self) -> int:
        return self.num_draft_tokens if self.num_draft_tokens is not None else self.num_steps + 1

    @property
    def enabled(self) -> bool:
        return self.policy != "off" and self.draft is not None


@dataclass(frozen=True)
class EngineConfig:
    model: str
    tokenizer: str | None = opt(None, "--tokenizer", "tokenizer directory", default_text="the model directory")
    device: str = opt("auto", "--device", "where the engine runs: auto (CUDA when present), cpu, cuda, cuda:N",
                      check=_device)
    dtype: str = opt("auto", "--dtype", "weight and activation dtype (auto: bfloat16 on CUDA, float32 on CPU)",
                     choices=DTYPES, values={"half": "float16", "float": "float32"})
    load_format: str = opt("auto", "--load-format", "auto: the safetensors weights, else the PyTorch .bin ones; "
                           "safetensors / pt: only those (the target's; a draft head reads either); "
                           "dummy: random weights", choices=("auto", "safetensors", "pt", "dummy"))
    seed: int = opt(0, "--seed", "seed of sampling for requests without their own", type=int)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    served_model_name: str | None = opt(None, "--served-model-name", "the model name clients send",
                                        default_text="the model directory")
    attention_backend: str = opt("auto", "--attention-backend", "auto: triton on CUDA, else torch",
                                 choices=("auto", "triton", "torch"))
    enforce_eager: bool = opt(False, "--enforce-eager", "run without CUDA graphs", type=bool)
    cuda_graph_max_tokens: int = opt(
        8192, "--cuda-graph-max-tokens", "steps of up to this many query rows that no uniform decode or "
        "verify graph holds (prompt chunks beside decodes) replay token graphs, captured up to the first "
        "bucket that holds it (or --max-num-batched-tokens) and only while a replay measures faster than "
        "the eager forward; 0: such steps run eagerly", type=int, ge=0)
    # Plan and launch step N+1 while the device runs step N (SGLang's overlap scheduler, vLLM's
    # async scheduling). Outputs are identical either way; off = one step at a time.
    overlap: bool = opt(True, "--overlap", "plan step N+1 on the CPU while the GPU runs step N "
                        "(outputs are the same either way)", type=bool)
    # "auto": sampling fields a request leaves out come from the model's generation_config.json
    # (like vLLM's --generation-config auto); "none": adaspec's own defaults (OpenAI's).
    generation_config: str = opt(
        "auto", "--generation-config", "auto: sampling fields a request leaves out (temperature, top_p, "
        "top_k, min_p, penalties) default to the model's generation_config.json; none: to 1.0 / 1.0 / -1 / 0.0",
        choices=GENERATION_CONFIG_MODES)
    chat_template: str | None = opt(None, "--chat-template", "a Jinja chat template (a file, or the template "
                                    "itself) replacing the tokenizer's", check=_chat_template,
                                    default_text="the tokenizer's")

    # Tensor parallelism: one process per rank (rank 0 is this one and plans every step; the
    # others are spawned workers). 1 = the single-process engine, no extra processes.
    tensor_parallel_size: int = opt(1, "--tensor-parallel-size", "shard the target over this many GPUs (one "
                                    "worker process per extra GPU; gloo processes on CPU)", type=int, ge=1,
                                    aliases=("-tp",))
    # Expert parallelism (vLLM's flag): the tensor-parallel ranks split a MoE's routed experts
    # between them, each expert whole, instead of cutting every expert (parallel/shard.py).
    enable_expert_parallel: bool = opt(False, "--enable-expert-parallel", "MoE targets: each tensor-parallel "
                                       "rank holds whole experts, a contiguous 1/N of them, instead of 1/N of "
                                       "every expert (no effect with one rank or a dense model)", type=bool,
                                       aliases=("-ep",))

    def __post_init__(self) -> None:
        check_fields(self)

    @classmethod
    def create(cls, model: str, **kw) -> "EngineConfig":
        """Build from flat keyword arguments (the LLM / CLI vocabulary: field names and their
        aliases, plus `speculative_config`, vLLM's dict or JSON form). Unknown keys raise."""
        groups = {"cache": CacheConfig, "scheduler": SchedulerConfig, "spec": SpecConfig}
        aliases = keyword_aliases(cls, *groups.values())
        if kw.get("speculative_config") is not None:
            kw = merge_speculative_config(kw)
        kw.pop("speculative_config", None)
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


# vLLM's --speculative-config keys -> adaspec's keywords (the others adaspec accepts as they are).
_SPEC_CONFIG_KEYS = {"model": "draft", "num_speculative_tokens": "num_steps"}
_SPEC_CONFIG_OWN = ("policy", "speculation", "topk", "num_draft_tokens", "spec_disable_batch_size")


def merge_speculative_config(kw: dict) -> dict:
    """`kw` with its `speculative_config` ({"method": "eagle3", "model": DIR,
    "num_speculative_tokens": K, ...}, a dict or JSON text) spread into flat keywords.
    A key the flat keywords also set, to another value, is an error."""
    raw = kw["speculative_config"]
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError as e:
            raise ValueError(f"--speculative-config must be a JSON object: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"--speculative-config must be a JSON object, got {raw!r}")
    method = raw.get("method", "eagle3")
    if method not in ("eagle3", "eagle"):
        raise ValueError(f"--speculative-config method {method!r}: adaspec drafts with EAGLE-3 heads only "
                         f"(method 'eagle3')")
    out = {k: v for k, v in kw.items() if k != "speculative_config"}
    for key, value in raw.items():
        if key == "method":
            continue
        if key not in _SPEC_CONFIG_KEYS and key not in _SPEC_CONFIG_OWN:
            raise ValueError(f"--speculative-config: unsupported key {key!r} (adaspec reads method, model, "
                             f"num_speculative_tokens, {', '.join(_SPEC_CONFIG_OWN)})")
        name = _SPEC_CONFIG_KEYS.get(key, "policy" if key == "speculation" else key)
        if out.get(name) is not None and out[name] != value:
            raise ValueError(f"--speculative-config sets {key}={value!r}, but the {name} option says "
                             f"{out[name]!r}")
        out[name] = value
    return out


def add_engine_cli_args(p: argparse.ArgumentParser) -> None:
    """The engine options every command shares (serve, generate, compare), generated from the
    option fields of the configs above."""
    p.add_argument("--model", default=None,
                   help="local Hugging Face model directory (default: the bundled demo pair, "
                        "its EAGLE-3 head as --draft and --speculation auto)")
    add_option_args(p, EngineConfig, CacheConfig, SchedulerConfig, SpecConfig)
    # The policy's default depends on --draft, and the draft depth's on the model (the bundled
    # demo pair drafts deeper: adaspec/demo), so these flags default to "not given".
    p.set_defaults(speculation=None, num_steps=None)
    p.add_argument("--speculative-config", default=None,
                   help='vLLM\'s form, beside the flags above: \'{"method": "eagle3", "model": DIR, '
                        '"num_speculative_tokens": K}\' (also "topk", "num_draft_tokens", "policy")')


def engine_kwargs_from_cli(a: argparse.Namespace) -> dict:
    """Map parsed `add_engine_cli_args` flags to `EngineConfig.create` keywords. Values equal to
    their default are left out, so --speculative-config can set what the flags did not."""
    kw = kwargs_from_args(a, EngineConfig, CacheConfig, SchedulerConfig, SpecConfig)
    if getattr(a, "speculation", None) is not None:
        # Given, even at its default: `--speculation off` with a draft (the demo pair's) must not
        # become the "always" that a draft alone implies (EngineConfig.create).
        kw["policy"] = a.speculation
    if getattr(a, "speculative_config", None) is not None:
        kw["speculative_config"] = a.speculative_config
    return kw
