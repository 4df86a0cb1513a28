"""The default connector: loads nothing, saves nothing, and has no per-layer work."""

from __future__ import annotations

from typing import Any

import torch

from tierkv.engine.kv_connector import ConnectorRequest, ConnectorStep, KVConnector


class NoOpConnector(KVConnector):
    """The default: loads nothing, saves nothing."""

    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> int:
        return 0

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        pass

    def build_connector_meta(self, scheduler_output: ConnectorStep) -> object:
        return None

    def request_finished(self, request: ConnectorRequest, block_ids: list[int]) -> bool:
        return False

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        pass

    def start_load_kv(self, meta: object) -> None:
        pass

    def wait_for_layer_load(self, layer: int) -> None:
        pass

    def save_kv_layer(self, layer: int, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        pass

    def layer_work(self) -> bool:
        return False

    def wait_for_save(self) -> None:
        pass

    def get_finished(self) -> tuple[set[str], set[str]]:
        return set(), set()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()
