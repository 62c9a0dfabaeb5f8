"""tokenmill: a readable, measured engine for serving generative language models.

    from tokenmill import LLM, SamplingParams
"""

from tokenmill.config import EngineConfig
from tokenmill.engine.llm import LLM
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "EngineConfig", "LLMEngine", "RequestOutput",
           "SamplingParams", "__version__"]
