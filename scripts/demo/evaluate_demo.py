"""Step 3 of the demo pair (CPU): held-out figures of the trained pair, with adaspec's engine.

    PYTHONPATH=. python scripts/demo/evaluate_demo.py DATA_DIR [--target T --head H] [--out J]

On Python files held out of both trainings (`DATA_DIR/heldout.jsonl`, see prepare_data.py):
- acceptance length, greedy, `--prompts` windows of ~`--prompt-tokens` tokens (cut at line
  boundaries), `--max-tokens` generated each: chains of 2, 3, 4, 6 draft tokens and the
  16-token tree (2 steps, topk 4);
- parse rate: the first `--functions` functions with a docstring (methods dedented); the
  prompt is the signature and docstring, the greedy completion (at most 128 tokens) is cut
  where the function ends (the first non-blank line indented no deeper than `def`); the
  whole must parse with `ast` AND the function must have a statement after its docstring
  (else a completion that writes no body at all would count). The prompt stops right after
  the docstring's closing quotes, without the newline: the BPE merges a newline with the
  next line's indentation ("\n    " is one token), so a prompt ending in "\n" asks for a
  token boundary the model never saw in training, and it then starts a new top-level line.
`--write-test-set PATH` also writes the prompts the test suite ships (tests/data/).
"""
from __future__ import annotations

import argparse
import ast
import json
import sys
import textwrap
import time
from pathlib import Path

CHAIN_AND_TREE = ((2, 1, 3), (3, 1, 4), (4, 1, 5), (6, 1, 7), (2, 4, 16))


def code_windows(files: list[dict], n: int, tokens: int, tokenizer, skip: int = 0) -> list[str]:
    """`n` prompts: the first ~`tokens` tokens (whole lines) of the files after a docstring-ish
    header, one per file, files in order (skipping the first `skip`)."""
    out = []
    for d in files[skip:]:
        lines = d["text"].splitlines(keepends=True)
        start = min(len(lines) // 3, 40)  # past the licence header / imports, into real code
        cur, count = [], 0
        for line in lines[start:]:
            count += len(tokenizer.encode(line))
            cur.append(line)
            if count >= tokens:
                break
        if count >= tokens // 2:
            out.append("".join(cur))
        if len(out) == n:
            break
    return out


def function_prompts(files: list[dict], n: int) -> list[tuple[str, int]]:
    """(signature + docstring, dedented; indentation of `def` = 0) of the first n functions."""
    out = []
    for d in files:
        try:
            tree = ast.parse(d["text"])
        except SyntaxError:
            continue
        lines = d["text"].splitlines(keepends=True)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.decorator_list:
                continue
            doc = node.body[0] if node.body else None
            if not (isinstance(doc, ast.Expr) and isinstance(getattr(doc, "value", None), ast.Constant)
                    and isinstance(doc.value.value, str)) or len(node.body) < 2:
                continue
            head = textwrap.dedent("".join(lines[node.lineno - 1:doc.end_lineno])).rstrip("\n")
            if len(head) > 1200:
                continue
            out.append(head)
            if len(out) == n:
                return out
            break  # one function per file: variety
    return out


def cut_function(prompt: str, completion: str) -> str:
    """The completion up to the end of the function that `prompt` starts (def at column 0)."""
    kept = []
    for line in completion.splitlines(keepends=True):
        if line.strip() and not line[0].isspace():
            break
        kept.append(line)
    return prompt + "".join(kept)


def parses_with_body(src: str) -> bool:
    """`src` parses and its first function has a statement after the docstring."""
    try:
        tree = ast.parse(src)
    except (SyntaxError, ValueError):
        return False
    fn = next((n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))), None)
    return fn is not None and len(fn.body) >= 2


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("data")
    ap.add_argument("--target", default=None)
    ap.add_argument("--head", default=None)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--functions", type=int, default=64)
    ap.add_argument("--specs", default=None,
                    help="NUM_STEPS,TOPK,NUM_DRAFT_TOKENS[;...] (default: chains of 2, 3, 4, 6 and the 2,4,16 tree)")
    ap.add_argument("--skip-parse", action="store_true")
    ap.add_argument("--skip-acceptance", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--write-test-set", default=None)
    a = ap.parse_args()
    from adaspec import LLM, SamplingParams
    from adaspec.demo import DEMO_HEAD, DEMO_TARGET
    from adaspec.train.evaluate import acceptance_lengths

    target, head = a.target or str(DEMO_TARGET), a.head or str(DEMO_HEAD)
    files = [json.loads(line) for line in open(Path(a.data) / "heldout.jsonl")]
    llm = LLM(target, device="cpu")
    tok = llm.tokenizer
    result: dict = {"target": target, "head": head, "held_out_files": len(files)}

    if a.write_test_set:  # a few prompts for the test suite, from other held-out files
        test_prompts = code_windows(files, 8, 64, tok, skip=len(files) // 2)
        Path(a.write_test_set).write_text("".join(json.dumps({"prompt": p}) + "\n" for p in test_prompts))

    t0 = time.perf_counter()
    funcs = [] if a.skip_parse else function_prompts(files, a.functions)
    outs = llm.generate(funcs, SamplingParams(max_tokens=128, temperature=0.0)) if funcs else []
    ok = [parses_with_body(cut_function(p, o.text)) for p, o in zip(funcs, outs)]
    result["parse"] = {"functions": len(funcs), "parsed": sum(ok), "rate": sum(ok) / max(1, len(funcs)),
                       "max_tokens": 128}
    result["parse_examples"] = [{"prompt": p, "completion": o.text, "parses": k}
                                for p, o, k in list(zip(funcs, outs, ok))[:4]]
    print(f"parse rate {sum(ok)}/{len(funcs)} = {result['parse']['rate']:.3f} "
          f"({time.perf_counter() - t0:.0f}s)", file=sys.stderr, flush=True)
    del llm

    if a.skip_acceptance:
        text = json.dumps(result, indent=1)
        if a.out:
            Path(a.out).write_text(text)
        print(text)
        return 0
    windows = code_windows(files, a.prompts, a.prompt_tokens, tok)
    prompts = [tok.encode(w) for w in windows]
    specs = CHAIN_AND_TREE if a.specs is None else tuple(
        tuple(int(x) for x in part.split(",")) for part in a.specs.split(";"))
    result["acceptance"] = acceptance_lengths(target, head, prompts, a.max_tokens, specs, device="cpu")
    text = json.dumps(result, indent=1)
    if a.out:
        Path(a.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
