"""Which torch device and attention backend an engine runs on ("auto": CUDA and Triton when
present, else the CPU and the PyTorch reference)."""
from __future__ import annotations

import torch


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' requested but CUDA is not available")
    return dev


def resolve_backend(name: str, device: torch.device) -> str:
    if name != "auto":
        return name
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
            return "triton"
        except ImportError:
            return "torch"
    return "torch"
