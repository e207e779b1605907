"""hipengine: a batch-1, latency-first LLM decode engine (numpy reference on CPU; HIP kernels on GPU)."""
from .backend import SamplingParams
from .errors import HipEngineError

__all__ = ["Engine", "SamplingParams", "HipEngineError"]
__version__ = "0.1.0"


def __getattr__(name):  # lazy: importing the package stays cheap for the CLI's error paths
    if name == "Engine":
        from .engine import Engine

        return Engine
    raise AttributeError(name)
