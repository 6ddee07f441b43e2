"""Configuration by layer: the engine's own fields in ``EngineConfig``, the blend connector's in
``BlendConnectorConfig``, and one flat set of keywords (``LLM``, ``RAGPipeline``) routed to both."""

from __future__ import annotations

from dataclasses import fields

import pytest
from helpers import QuietLLM

from blendkv.config import EngineConfig
from blendkv.connector.config import BlendConnectorConfig, blend_connector_config
from blendkv.engine_args import connector_options, create_engine_config
from blendkv.errors import ConfigError


def test_engine_config_keeps_only_the_engines_fields():
    names = {f.name for f in fields(EngineConfig)}
    # deterministic, blend_audit_rate and max_graph_rows are the engine's (its forward, its
    # schedule, its graphs).
    assert len(names) <= 23, sorted(names)
    assert not names & set(connector_options())
    assert {"kv_connector", "kv_connector_config"} <= names
    moved = {"kv_store_dir", "anchor_system", "pipeline_kv_load", "prefetch_kv"}
    assert moved <= {f.name for f in fields(BlendConnectorConfig)}


def test_flat_options_land_in_their_layer():
    config = create_engine_config(dtype="float32", kv_store_dir="/s", prefetch_kv=False)
    assert config.dtype == "float32"
    assert config.kv_connector_config == BlendConnectorConfig(kv_store_dir="/s", prefetch_kv=False)
    assert create_engine_config().kv_connector_config is None  # the connector's defaults
    # A flat option goes on top of a given connector config.
    base = BlendConnectorConfig(anchor_system="sys", kv_store_memory_bytes=1)
    config = create_engine_config(kv_connector_config=base, kv_store_memory_bytes=2)
    assert config.kv_connector_config == BlendConnectorConfig(
        anchor_system="sys", kv_store_memory_bytes=2
    )


def test_connector_options_are_validated_with_their_messages():
    with pytest.raises(ConfigError, match="prefetch_kv_bytes must be an integer > 0"):
        create_engine_config(prefetch_kv_bytes=0)
    with pytest.raises(ConfigError, match="kv_store_memory_bytes must be a positive integer"):
        BlendConnectorConfig(kv_store_memory_bytes=0)
    with pytest.raises(ConfigError, match="kv_store_max_bytes must be a positive integer"):
        BlendConnectorConfig(kv_store_max_bytes=-1)


def test_unknown_options_are_a_config_error_naming_them_and_the_valid_ones(tmp_path):
    from blendkv.rag import RAGPipeline

    with pytest.raises(ConfigError, match=r"unknown LLM option\(s\) 'kv_store'.*kv_store_dir"):
        QuietLLM("no-such-model", kv_store="x")  # refused before any model is looked for
    with pytest.raises(ConfigError, match=r"unknown RAGPipeline option\(s\) 'dtyp'.*dtype"):
        RAGPipeline(tmp_path / "store", dtyp="float32")
    assert not (tmp_path / "store").exists()
    with pytest.raises(ConfigError, match="apply only to the model the pipeline loads"):
        RAGPipeline(tmp_path / "store", llm=object(), dtype="float32")


def test_connector_options_need_the_blend_connector():
    with pytest.raises(ConfigError, match="kv_store_dir: option.* of the blend KV connector"):
        create_engine_config(kv_connector=None, kv_store_dir="/s")
    with pytest.raises(ConfigError, match="not a BlendConnectorConfig"):
        create_engine_config(kv_connector_config={"kv_store_dir": "/s"}, prefetch_kv=True)
    with pytest.raises(ConfigError, match="kv_connector_config needs a kv_connector"):
        EngineConfig(kv_connector=None, kv_connector_config=BlendConnectorConfig())


def test_the_blend_connector_checks_what_it_is_given():
    assert blend_connector_config(None) == BlendConnectorConfig()
    given = BlendConnectorConfig(prefetch_kv=True)
    assert blend_connector_config(given) is given
    with pytest.raises(ConfigError, match="takes kv_connector_config=BlendConnectorConfig"):
        blend_connector_config({"prefetch_kv": True})
