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


def token_graph_margin_s(eager_below_s: float, launch_below_s: float) -> float:
    """The margin `pays` gives replays, in seconds: ADASPEC_TOKEN_GRAPH_MARGIN_MS where set (0 is
    the bare comparison of sessions 21-22), else max(0, 2 x launch - eager) of the eager forward
    of the bucket below (`eager_below_s` its synchronized time, `launch_below_s` the host time
    until its launches return).

    Why: start-up times forwards alone, but a served step does more host work after its forward
    (sampling, the next step's plan, drafting), which runs beside a replay's device work and
    after an eager forward's launches. A served eager step then costs about max(launch + that
    work, device time), a replay max(that work, device time). Assuming that work takes as long
    as the launches (not measured; in session 22, H100, dense 8B, eager steps of 384-639 rows
    cost 11-12 ms more served than replayed, where the whole bare eager forward took about 15
    ms), an eager step costs max(eager, 2 x launch): the margin is large where the eager forward
    is host-bound and 0 where the device bounds it, so capture stops where padding costs more
    than launches save.

    Measured: the bare comparison put the cut anywhere from 384 to 1,280 rows on identical
    servers (H100 and H200, dense 8B, sessions 22-23), and a server cut at 448 rows ran its
    512-row prompt steps eagerly at 26.3-30.5 ms against 14.8-18.1 ms replayed; capturing to
    8,192 rows gave 0.990-0.998x the throughput of a cut at 768 rows (H100, session 23) for 4.46
    GiB more graph memory. Against the bare comparison this rule made 1.005x / 1.007x the
    throughput at C = 16 / 64 (thr32, H100, session 24: no step there passed either cut) for
    0.89 GiB more graph memory."""
    v = os.environ.get("ADASPEC_TOKEN_GRAPH_MARGIN_MS", "").strip()
    if not v:
        return max(0.0, 2 * launch_below_s - eager_below_s)
    try:
        ms = float(v)
    except ValueError:
        ms = float("nan")
    if not ms >= 0:   # (nan too)
        raise ValueError(f"ADASPEC_TOKEN_GRAPH_MARGIN_MS={v!r}: expected milliseconds (a number >= 0)")
    return ms / 1e3
