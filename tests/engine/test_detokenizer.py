"""Incremental detokenization: the DecodeStream path and the window path give the text
`tokenizer.decode` gives, hold back split characters, and cut at stop strings."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from adaspec.engine.detokenizer import Detokenizer
from adaspec.tokenization import load_tokenizer

TEXT = "def f(x):\n    return 'héllo wörld 日本語 🙂' + x  # done"


def _request(stop=None):
    return SimpleNamespace(output_token_ids=[], prefix_offset=0, read_offset=0, text="", stop_checked_len=0,
                           decode_stream=None, params=SimpleNamespace(stop=stop))


def _run(det, ids, stop=None, step=1):
    req, shown, stopped = _request(stop), [], False
    for i in range(0, len(ids), step):       # several tokens per step, as speculation emits them
        req.output_token_ids.extend(ids[i:i + step])
        stopped = det.update(req)
        shown.append(req.text)
        if stopped:
            break
    else:
        det.flush(req)
    return req.text, shown, stopped


@pytest.mark.parametrize("stream", [True, False])
def test_incremental_text_equals_decode(tok_model_dir, stream):
    tok = load_tokenizer(tok_model_dir)
    det = Detokenizer(tok)
    if not stream:
        det.backend = None                    # the window path (slow tokenizers, space clean-up)
    else:
        assert det.backend is not None
    ids = tok.encode(TEXT, add_special_tokens=False)
    for step in (1, 3):
        text, shown, _ = _run(det, ids, step=step)
        assert text == tok.decode(ids, skip_special_tokens=True) == TEXT
        assert all("\ufffd" not in t for t in shown)                 # split characters held back
        assert all(a == b[:len(a)] for a, b in zip(shown, shown[1:]))  # text only grows
    text, _, stopped = _run(det, ids, stop=["wörld"], step=2)
    assert stopped and text == "def f(x):\n    return 'héllo "
    cut = ids[:next(i for i in range(1, len(ids)) if "\ufffd" in tok.decode(ids[:i]))]   # ends mid-character
    text, _, _ = _run(det, cut)
    assert text == tok.decode(cut, skip_special_tokens=True)          # flushed, U+FFFD included
