"""tierkv's engine: a small paged-attention engine for Llama-architecture models."""

from tierkv.engine.blend import PromptPart
from tierkv.engine.engine import Engine, NoFit
from tierkv.engine.kv_connector import ConnectorRequest, KVConnector
from tierkv.engine.llm import LLM
from tierkv.engine.noop_connector import NoOpConnector
from tierkv.engine.outputs import Completion, Request, RequestMetrics, RequestOutput
from tierkv.engine.sampling_params import SamplingParams

__all__ = [
    "PromptPart",
    "Engine",
    "NoFit",
    "LLM",
    "Request",
    "SamplingParams",
    "KVConnector",
    "ConnectorRequest",
    "NoOpConnector",
    "RequestOutput",
    "Completion",
    "RequestMetrics",
]
