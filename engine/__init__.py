"""tierkv's engine: a small paged-attention engine for Llama-architecture models."""
from engine.kv_connector import KVConnector, NoOpConnector
from engine.llm import LLM, Completion, RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "KVConnector", "NoOpConnector", "RequestOutput", "Completion", "RequestMetrics"]
