"""tierkv's engine: a small paged-attention engine for Llama-architecture models."""

from tierkv.engine.blend import PromptPart
from tierkv.engine.kv_connector import KVConnector, NoOpConnector
from tierkv.engine.llm import LLM, Completion, RequestMetrics, RequestOutput
from tierkv.engine.sampling_params import SamplingParams

__all__ = [
    "PromptPart",
    "LLM",
    "SamplingParams",
    "KVConnector",
    "NoOpConnector",
    "RequestOutput",
    "Completion",
    "RequestMetrics",
]
