"""tokenmill: a readable, measured engine for serving generative language models.

    from tokenmill import LLM, SamplingParams
"""

from tokenmill.config import EngineConfig
from tokenmill.engine.beam_search import BeamSearchOutput, BeamSearchSequence
from tokenmill.engine.llm import LLM
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.outputs import CompletionOutput, Logprob, RequestOutput
from tokenmill.sampling_params import BeamSearchParams, SamplingParams
from tokenmill.structured_output.params import StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence",
           "CompletionOutput", "EngineConfig", "LLMEngine", "Logprob", "RequestOutput",
           "SamplingParams", "StructuredOutputsParams", "__version__"]
