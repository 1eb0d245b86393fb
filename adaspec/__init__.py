"""adaspec: an LLM inference server whose EAGLE-3 speculative decoding adapts to load."""
from adaspec.sampling import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "Engine", "SamplingParams", "__version__"]


def __getattr__(name):  # keep `import adaspec` light; torch models load on first use
    if name in ("LLM", "Engine"):
        from adaspec.engine import engine

        return getattr(engine, name)
    raise AttributeError(name)
