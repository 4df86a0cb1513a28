"""tierkv's connector: the engine's KV connector hooks over the tiered store."""

from tierkv.connector.config import ConnectorConfig
from tierkv.connector.connector import TierKVConnector
from tierkv.connector.requests import model_fingerprint
from tierkv.storage_backends.build import TiersConfig

__all__ = ["ConnectorConfig", "TierKVConnector", "TiersConfig", "model_fingerprint"]
