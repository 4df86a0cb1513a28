"""tierkv's engine: a small paged-attention engine for Llama-architecture models."""
from engine.blend import Segment
from engine.kv_connector import KVConnector, NoOpConnector
from engine.llm import LLM, Completion, RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["Segment", "LLM", "SamplingParams", "KVConnector", "NoOpConnector", "RequestOutput", "Completion", "RequestMetrics"]
