"""The KV connector seam, exercised by a connector that is not blending.

``DictConnector`` keeps, in a dict keyed by a prompt's first N token ids, the K/V that the
forward computed for those N tokens (``save_kv_layer``), and supplies them to a later request
with the same first N tokens (``get_num_new_matched_tokens`` + ``start_load_kv``): the engine
then computes only the rest. It uses nothing but the interface and the attention backend.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field

import pytest
import torch
from helpers import QuietLLM

from blendkv import SamplingParams
from blendkv.engine.kv_connector import KVConnectorBase, KVConnectorMetadata
from blendkv.errors import InvalidRequestError

N = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@dataclass
class DictMeta(KVConnectorMetadata):
    loads: list = field(default_factory=list)  # (key, block_table, first position, count)
    saves: list = field(default_factory=list)  # (index in the step, key)


class DictConnector(KVConnectorBase):
    def __init__(self, context, n: int) -> None:
        super().__init__(context)
        self.n = n
        self.kv: dict[tuple[int, ...], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.to_load: dict[str, int] = {}
        self.rows_computed: list[int] = []

    def _key(self, seq) -> tuple[int, ...]:
        return tuple(seq.prompt_token_ids[: self.n])

    # scheduler side
    def get_num_new_matched_tokens(self, seq, num_computed_tokens):
        if self._key(seq) not in self.kv:
            return 0
        return max(0, self.n - num_computed_tokens)

    def update_state_after_alloc(self, seq, num_external_tokens):
        if num_external_tokens:
            self.to_load[seq.request_id] = num_external_tokens

    def build_connector_meta(self, scheduler_output):
        meta = DictMeta()
        for i, (seq, num_new) in enumerate(scheduler_output.scheduled):
            count = self.to_load.pop(seq.request_id, 0)
            if count:
                first = seq.num_computed_tokens - count
                meta.loads.append((self._key(seq), list(seq.block_table), first, count))
            elif seq.num_computed_tokens == 0 and num_new >= self.n:
                meta.saves.append((i, self._key(seq)))
        return meta

    # worker side
    def start_load_kv(self, inputs):
        self.rows_computed.append(inputs.attn_metadata.num_tokens)
        backend = self.context.attn_backend
        for key, table, first, count in self._metadata.loads:
            positions = torch.arange(first, first + count)
            bs = inputs.kv_caches[0].shape[2]
            slots = torch.tensor(table)[positions // bs] * bs + positions % bs
            for layer, kv_cache in enumerate(inputs.kv_caches):
                k, v = self.kv[key][layer]
                rows = slice(first, first + count)
                backend.write_kv(kv_cache, k[rows], v[rows], slots)

    def save_kv_layer(self, layer_idx, k, v, kv_cache, attn_metadata):
        backend = self.context.attn_backend
        for index, key in self._metadata.saves:
            lo = attn_metadata.query_start_loc_cpu[index]
            k_rot, v_new = backend.read_kv(kv_cache, attn_metadata.slot_mapping[lo : lo + self.n])
            self.kv.setdefault(key, {})[layer_idx] = (k_rot.clone(), v_new.clone())


@pytest.fixture(scope="module")
def dict_llm(tiny_llama_dir):
    llm = QuietLLM(
        str(tiny_llama_dir),
        dtype="float32",
        block_size=4,
        enable_prefix_caching=False,
        kv_connector=lambda ctx: DictConnector(ctx, N),
    )
    yield llm
    llm.close()


def test_dict_connector_supplies_first_tokens(dict_llm, tiny_llama_dir):
    conn = dict_llm.engine.kv_connector
    prompt = list(range(5, 5 + 40))
    first = dict_llm.generate([prompt], GREEDY, logits_from=N)[0]
    assert set(conn.kv[tuple(prompt[:N])]) == set(range(3))  # every layer saved
    conn.rows_computed.clear()
    second = dict_llm.generate([prompt], GREEDY, logits_from=N)[0]
    # The first step computed only the tokens the dict did not supply.
    assert conn.rows_computed[0] == len(prompt) - N
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    torch.testing.assert_close(
        second.extra["prompt_logits"], first.extra["prompt_logits"], atol=1e-5, rtol=0
    )
    # And the reference: the same engine without any connector.
    with QuietLLM(
        str(tiny_llama_dir),
        dtype="float32",
        block_size=4,
        enable_prefix_caching=False,
        kv_connector=None,
    ) as plain:
        ref = plain.generate([prompt], GREEDY, logits_from=N)[0]
    assert ref.outputs[0].token_ids == second.outputs[0].token_ids
    torch.testing.assert_close(
        second.extra["prompt_logits"], ref.extra["prompt_logits"], atol=1e-5, rtol=0
    )
    dict_llm.engine.check_integrity()


def test_supplied_tokens_are_checked(dict_llm):
    """Loading the wrong K/V changes the result: the loaded values are really read."""
    conn = dict_llm.engine.kv_connector
    prompt = list(range(60, 60 + 40))
    first = dict_llm.generate([prompt], GREEDY, logits_from=N)[0]
    for layer, (k, v) in conn.kv[tuple(prompt[:N])].items():
        conn.kv[tuple(prompt[:N])][layer] = (k + 1.0, v)
    second = dict_llm.generate([prompt], GREEDY, logits_from=N)[0]
    diff = (second.extra["prompt_logits"] - first.extra["prompt_logits"]).abs().max()
    assert diff > 1e-3


def test_no_connector_refuses_dict_prompts(tiny_llama_dir):
    with QuietLLM(str(tiny_llama_dir), dtype="float32", kv_connector=None) as llm:
        with pytest.raises(InvalidRequestError, match="KV connector"):
            llm.generate([{"documents": ["a b c"], "query": "q"}], GREEDY)
        assert llm.generate(["hello"], GREEDY)[0].outputs[0].token_ids


def test_engine_imports_nothing_from_blend():
    code = (
        "import sys, blendkv.engine.llm_engine, blendkv.engine.model_runner, "
        "blendkv.engine.scheduler\n"
        "bad = sorted(m for m in sys.modules if m.startswith('blendkv.blend'))\n"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
