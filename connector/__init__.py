"""tierkv's connector: the engine's KV connector hooks over the tiered store."""
from connector.config import ConnectorConfig
from connector.connector import TierKVConnector
from connector.requests import model_fingerprint

__all__ = ["ConnectorConfig", "TierKVConnector", "model_fingerprint"]
