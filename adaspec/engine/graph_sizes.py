"""Which CUDA graphs exist: the batch-size buckets of the uniform graphs, the row buckets of the
token graphs, and the rule that stops token graphs where a replay no longer pays (`pays`)."""
from __future__ import annotations

import os

MAX_GRAPH_TOKENS = 2048   # uniform (decode / verify) graphs up to this many rows


def batch_buckets(max_bs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 64, 8)) + list(range(64, 128, 16)) + list(range(128, 1025, 32))
    return sorted({b for b in sizes if b <= max_bs} | {max_bs})


def token_buckets(max_rows: int) -> list[int]:
    """Row counts of the token graphs, up to the first that holds `max_rows` (none for 0): 16,
    32, 64, then steps of an eighth or less (64 up to 1,024, 128 up to 2,048, 256 up to 4,096,
    512 up to 8,192, 1,024 beyond), so padding adds at most 12.5% of the rows above 512 (a
    forward bound by the device pays for those)."""
    if max_rows <= 0:
        return []
    sizes = [16, 32, 64] + list(range(128, 1025, 64)) + list(range(1152, 2049, 128)) \
        + list(range(2304, 4097, 256)) + list(range(4608, 8193, 512)) + list(range(9216, max_rows + 1024, 1024))
    out = [r for r in sizes if r < max_rows]
    return out + [r for r in sizes if r >= max_rows][:1]


def pays(replay_s: float, eager_below_s: float, margin_s: float = 0.0) -> bool:
    """Whether a token graph is worth capturing: its replay (all of its rows) beats the eager
    forward of the bucket below it, the fewest rows a step it serves can hold more than, plus
    `margin_s` (what a served eager step costs beyond that forward: `token_graph_margin_s`)."""
    return replay_s < eager_below_s + margin_s


def token_graph_margin_s() -> float:
    """ADASPEC_TOKEN_GRAPH_MARGIN_MS (default 0), in seconds: the margin `pays` gives replays.

    Start-up times the bare eager forward back to back. A served eager step also loses the
    overlap of the host's next-step work with the device, which a replay keeps. The policy
    feeds of session 22 (H100, dense 8B) put speculative servers' eager steps with prompt rows
    12-15 ms above replays of the same rows, where start-up saw 0.3-1.7 ms between them. The
    default stays 0 until an A/B run on the device measures a margin; this variable is that A/B's
    switch (a large value captures up to --cuda-graph-max-tokens)."""
    v = os.environ.get("ADASPEC_TOKEN_GRAPH_MARGIN_MS", "").strip()
    if not v:
        return 0.0
    try:
        ms = float(v)
    except ValueError:
        ms = float("nan")
    if not ms >= 0:   # (nan too)
        raise ValueError(f"ADASPEC_TOKEN_GRAPH_MARGIN_MS={v!r}: expected milliseconds (a number >= 0)")
    return ms / 1e3
