"""The server tests' shared server: one `adaspec serve` process (tiny Llama with a tool-capable
chat template, a random EAGLE-3 head, speculation always), started once for the session
because starting one costs more than most of the tests that use it."""
from __future__ import annotations

import pytest

from server_helpers import ServerProcess


@pytest.fixture(scope="session")
def spec_server(tok_model_dir, tok_head_dir):
    srv = ServerProcess(["--model", tok_model_dir, "--draft", tok_head_dir, "--speculation", "always",
                         "--num-kv-blocks", "512", "--max-model-len", "512", "--tool-call-parser", "hermes"])
    yield srv
    code, out = srv.stop()
    assert code == 0, out
