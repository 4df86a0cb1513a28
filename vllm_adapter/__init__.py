"""tierkv inside vLLM: `TierKVConnector`, a KVConnectorBase_V1 loaded out of tree with
`KVTransferConfig(kv_connector="TierKVConnector", kv_connector_module_path="tierkv.vllm",
kv_role="kv_both", kv_connector_extra_config={...ConnectorConfig's knobs...})`."""

from tierkv.vllm.connector import TierKVConnector

__all__ = ["TierKVConnector"]
