"""`adaspec serve | generate | bench | compare`: one entry point, one module per command."""
from __future__ import annotations

import sys

COMMANDS = {
    "serve": ("adaspec.server.cli", "serve_main", "run the OpenAI-compatible server"),
    "generate": ("adaspec.server.cli", "generate_main", "generate for one prompt and print it"),
    "bench": ("adaspec.bench.cli", "bench_main", "sweep concurrency levels against a server"),
    "compare": ("adaspec.bench.compare", "compare_main", "start the server per configuration and compare"),
    "train-draft": ("adaspec.train.cli", "main", "train a small EAGLE-3 head on a target's own outputs"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["--version"], ["-V"]):
        from adaspec import __version__
        print(f"adaspec {__version__}")
        return 0
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: adaspec [--version] {" + ",".join(COMMANDS) + "} [options]\n")
        for name, (_, _, doc) in COMMANDS.items():
            print(f"  {name:10s} {doc}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module, func, _ = COMMANDS[argv[0]]
    import importlib
    return int(getattr(importlib.import_module(module), func)(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
