"""Connector hooks: a test connector that records every call, really saves KV out of the
blocks (kernels.gather_kv) and loads it into a fresh engine (kernels.scatter_kv)."""

from __future__ import annotations

import pytest
import torch

from tests.test_hf_match import GREEDY, save_checkpoint
from tierkv.engine import LLM, KVConnector
from tierkv.kernels import LayerCache, gather_kv, scatter_kv

pytestmark = pytest.mark.triton_path

BS = 16


class RecordingConnector(KVConnector):
    def __init__(self, store: dict, fail_first_load: bool = False) -> None:
        self.calls: list[tuple] = []
        self.store = store  # tuple(tokens) -> [L, 2, T, Hkv, D]
        self.caches: list[torch.Tensor] = []
        self.pending: list[tuple] = []  # (seq, block_ids, start, count) to load
        self.meta: list[tuple] = []
        self.saving: set[str] = set()
        self.loaded: dict[str, int] = {}
        self.fail_first_load = fail_first_load
        self.failed: set[int] = set()

    def _best(self, tokens: list[int]) -> tuple[int, ...] | None:
        keys = [k for k in self.store if tuple(tokens[: len(k)]) == k]
        return max(keys, key=len, default=None)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self.calls.append(("match", request.request_id, num_computed_tokens))
        key = self._best(request.token_ids)
        return 0 if key is None else max(0, len(key) - num_computed_tokens)

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        self.calls.append(("alloc", request.request_id, num_external_tokens))
        assert len(block_ids) * BS >= request.num_computed_tokens + num_external_tokens
        if num_external_tokens:
            self.pending.append(
                (request, list(block_ids), request.num_computed_tokens, num_external_tokens)
            )

    def build_connector_meta(self, scheduler_output):
        self.calls.append(("meta", len(scheduler_output.seqs)))
        meta, self.pending = self.pending, []
        return meta

    def request_finished(self, request, block_ids):
        self.calls.append(("finished", request.request_id))
        n = request.num_prompt_tokens  # save the prompt's KV (all computed by now)
        seg = torch.empty(
            len(self.caches), 2, n, *self.caches[0].shape[3:], dtype=self.caches[0].dtype
        )
        ids = torch.tensor(block_ids)
        for layer, cache in enumerate(self.caches):
            gather_kv(LayerCache.of(cache), ids, 0, seg[layer])
        self.store[tuple(request.token_ids[:n])] = seg
        self.saving.add(request.request_id)
        return True  # hold the blocks until get_finished reports the save

    def register_kv_caches(self, kv_caches):
        self.calls.append(("register", len(kv_caches)))
        self.caches = kv_caches

    def start_load_kv(self, meta):
        self.calls.append(("start_load", len(meta)))
        self.meta = meta

    def wait_for_layer_load(self, layer):
        self.calls.append(("wait_load", layer))
        for seq, block_ids, start, count in self.meta:
            key = self._best(seq.token_ids)
            src = self.store[key][layer, :, start : start + count]
            scatter_kv(
                src.contiguous(), LayerCache.of(self.caches[layer]), torch.tensor(block_ids), start
            )
            self.loaded[seq.request_id] = count
            if self.fail_first_load and layer == 0:
                bad = block_ids[
                    (start + count - 1) // BS
                ]  # the last loaded block: poison and report it
                self.caches[layer][:, bad] = 1e4
                self.failed.add(bad)
                self.fail_first_load = False

    def save_kv_layer(self, layer, kv_layer, attn_metadata):
        self.calls.append(("save", layer))
        assert kv_layer is self.caches[layer] and attn_metadata.num_tokens > 0

    def wait_for_save(self):
        self.calls.append(("wait_save",))

    def get_finished(self):
        self.calls.append(("get_finished",))
        done, self.saving = self.saving, set()
        return done, set()

    def get_block_ids_with_load_errors(self):
        out, self.failed = self.failed, set()
        return out

    def request_metrics(self, request_id):
        return {"loaded_tokens": {"test": self.loaded.get(request_id, 0)}}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("conn")
    save_checkpoint(path)
    return path


def prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (40, 23)]


def check_order(calls: list[tuple], layers: int) -> None:
    assert calls[0] == ("register", layers)
    steps, cur = [], None
    for c in calls[1:]:
        if c[0] == "meta":
            cur = [c]
            steps.append(cur)
        elif cur is not None:
            cur.append(c)
    assert steps
    for st in steps:
        names = [c[0] for c in st]
        assert names[1] == "start_load"
        body = st[2 : 2 + 2 * layers]
        assert body == [x for i in range(layers) for x in (("wait_load", i), ("save", i))]
        assert names[2 + 2 * layers] == "wait_save"
        assert names[3 + 2 * layers] == "get_finished"


def test_hooks_order_save_and_load_into_a_fresh_engine(ckpt):
    store: dict = {}
    first = RecordingConnector(store)
    llm = LLM(ckpt, dtype="fp32", kv_cache_bytes=1 << 22, kv_connector=first)
    ref = llm.generate(prompts(), GREEDY, use_tqdm=False)
    check_order(first.calls, 2)
    assert all(c[2] == 0 for c in first.calls if c[0] == "match")
    assert len(store) == 2 and not llm.scheduler.held  # saves reported, blocks freed
    llm.check_integrity()
    assert len(llm.blocks.free) + llm.blocks.tree.num_blocks == llm.runner.num_blocks

    second = RecordingConnector(store)
    fresh = LLM(
        ckpt, dtype="fp32", kv_cache_bytes=1 << 22, kv_connector=second, enable_prefix_caching=False
    )
    outs = fresh.generate(prompts(), GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    for o, p in zip(outs, prompts()):
        assert o.metrics.external_tokens == len(p) - 1  # all but the last prompt token loaded
        assert o.metrics.computed_tokens == 1 + 31
        assert o.metrics.connector == {"loaded_tokens": {"test": len(p) - 1}}
    check_order(second.calls, 2)
    fresh.check_integrity()


def test_failed_load_is_recomputed(ckpt):
    store: dict = {}
    llm = LLM(ckpt, dtype="fp32", kv_cache_bytes=1 << 22, kv_connector=RecordingConnector(store))
    ref = llm.generate(prompts(), GREEDY, use_tqdm=False)
    conn = RecordingConnector(store, fail_first_load=True)
    fresh = LLM(
        ckpt, dtype="fp32", kv_cache_bytes=1 << 22, kv_connector=conn, enable_prefix_caching=False
    )
    outs = fresh.generate(prompts(), GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    # prompt 0 (40 tokens): 39 loaded into blocks 0-2, block 2 failed: its step (1 token) is
    # wasted and tokens 32..39 recomputed
    assert (
        outs[0].metrics.external_tokens == 32
        and outs[0].metrics.computed_tokens == 1 + (40 - 32) + 31
    )
    fresh.check_integrity()
