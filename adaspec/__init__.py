"""adaspec: an LLM inference server whose EAGLE-3 speculative decoding adapts to load."""
from adaspec.sampling import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "Engine", "SamplingParams", "__version__"]


def __getattr__(name):  # keep `import adaspec` light; torch models load on first use
    if name == "Engine":
        from adaspec.engine.engine import Engine

        return Engine
    if name == "LLM":
        from adaspec.engine.llm import LLM

        return LLM
    raise AttributeError(name)
