"""A blended request makes the host wait for the device at most 3 times, however many layers
the model has: no ``.item()``, ``.tolist()``, ``.cpu()`` of a device tensor,
``nonzero`` or boolean-mask gather inside the layer loop.

Counted on the CPU by the launch counter's :class:`HostSyncs` (``blendkv bench launches``),
which follows the tensors a GPU run would hold on the device; on the Triton backend (the GPU's,
here under the interpreter) and a tiny random-weight model with 2 and 4 layers. Each failure
lists the file:line of every sync.
"""

from __future__ import annotations

import pytest
from helpers import BLEND_DOCS, BLEND_QUERY, QuietLLM, make_tiny_model_dir

from blendkv import LLM, SamplingParams
from blendkv.blend.config import BlendConfig
from blendkv.eval.bench.launches import count, device_tensors
from blendkv.models.llama import LlamaDecoderLayer

# Short: the Triton interpreter's time grows with the rows (the counts do not).
PROMPT = {"documents": [doc.split(".")[0] + "." for doc in BLEND_DOCS[1:]], "query": BLEND_QUERY}
ONE = SamplingParams(temperature=0.0, max_tokens=1)
LAYERS = (2, 4)
MAX_SYNCS = 3
CONFIGS = {
    "prophet": BlendConfig(recompute_ratio=0.15),  # the default selection
    "v_deviation": BlendConfig(recompute_ratio=0.15, selection="v_deviation", check_layer=1),
    "reuse": BlendConfig(recompute_ratio=0.0),
}


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    llms = {}
    for n in LAYERS:
        path = make_tiny_model_dir(tmp_path_factory.mktemp(f"syncs{n}"), num_hidden_layers=n)
        llms[n] = llm = QuietLLM(
            str(path),
            dtype="float32",
            block_size=4,
            enable_prefix_caching=False,
            attention_backend="triton",
            kv_store_dir=str(path / "store"),
        )
        llm.generate([PROMPT], ONE, blend=CONFIGS["prophet"])  # chunks stored
    yield llms
    for llm in llms.values():
        llm.close()


def _count(llm: LLM, config: BlendConfig) -> dict:
    return count(lambda: llm.generate([PROMPT], ONE, blend=config), device_tensors(llm))


@pytest.fixture(scope="module")
def counted(engines) -> dict[str, dict[int, dict]]:
    """Per config, per number of layers: the counter's row for one blended request."""
    return {
        name: {n: _count(llm, cfg) for n, llm in engines.items()} for name, cfg in CONFIGS.items()
    }


@pytest.mark.parametrize("name", CONFIGS)
def test_blended_request_syncs_do_not_grow_with_layers(counted, name):
    syncs = {n: c["host_syncs"] for n, c in counted[name].items()}
    where = {n: c["syncs_at"] for n, c in counted[name].items()}
    assert syncs[2] == syncs[4], f"host syncs grow with layers: {where}"
    assert syncs[4] <= MAX_SYNCS, f"more than {MAX_SYNCS} host syncs: {where}"


def test_a_device_read_in_the_layer_loop_is_counted(engines, counted, monkeypatch):
    """The counter sees a ``.item()`` and a ``.tolist()`` of a device tensor in every layer:
    the test above fails when one slips into the loop."""
    forward = LlamaDecoderLayer.forward

    def reads(self, hidden_states, *args, **kwargs):
        hidden_states.sum().item()
        hidden_states[:1, :1].tolist()
        return forward(self, hidden_states, *args, **kwargs)

    monkeypatch.setattr(LlamaDecoderLayer, "forward", reads)
    for n, llm in engines.items():
        read = _count(llm, CONFIGS["prophet"])
        # ProphetKV's query pass and the fused forward each run every layer, two reads each
        assert read["host_syncs"] >= counted["prophet"][n]["host_syncs"] + 4 * n
        assert any("test_blend_syncs.py" in where for where in read["syncs_at"])
