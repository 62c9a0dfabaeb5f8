"""tokenmill: a readable, measured engine for serving generative language models.

    from tokenmill import LLM, SamplingParams

Importing it points threads started afterwards (the kernels' build threads, the server's
engine thread) at glibc's main arena, so that CPU steps can reuse what earlier steps freed
(utils/heap.py; TOKENMILL_KEEP_HEAP=0 leaves glibc's defaults). Nothing imported here starts a
thread.
"""

from tokenmill.config import EngineConfig
from tokenmill.engine.beam_search import BeamSearchOutput, BeamSearchSequence
from tokenmill.engine.llm import LLM
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine_args import EngineArgs
from tokenmill.lora.request import LoRARequest
from tokenmill.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    RequestOutput,
)
from tokenmill.pooling_params import PoolerConfig, PoolingParams
from tokenmill.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from tokenmill.structured_output.params import StructuredOutputsParams
from tokenmill.utils import heap

heap.share_main_arena()

__version__ = "0.1.0"
__all__ = ["LLM", "BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence",
           "CompletionOutput", "EmbeddingOutput", "EmbeddingRequestOutput", "EngineArgs",
           "EngineConfig",
           "LLMEngine", "LoRARequest", "Logprob", "PoolerConfig", "PoolingParams", "RequestOutput",
           "RequestOutputKind", "SamplingParams", "StructuredOutputsParams", "__version__"]
