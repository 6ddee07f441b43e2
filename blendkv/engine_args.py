"""Flat keyword options -> :class:`~blendkv.config.EngineConfig` (vLLM's ``EngineArgs`` idea).

``LLM(model, **kwargs)``, ``RAGPipeline(...)`` and the CLI take one flat set of names: the
engine's own fields and the blend connector's (:class:`BlendConnectorConfig`). This module
routes each name to its layer, so the engine config never names a connector's settings and a
user never has to build the nested configs by hand. The blend package is a plugin loaded by
name (importing blendkv does not load it), so its config class is imported when first needed.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

from blendkv.config import EngineConfig
from blendkv.errors import ConfigError

ENGINE_OPTIONS = tuple(f.name for f in fields(EngineConfig))


def connector_options() -> tuple[str, ...]:
    """The blend connector's option names (:class:`BlendConnectorConfig`'s fields)."""
    from blendkv.blend.config import BlendConnectorConfig

    return tuple(f.name for f in fields(BlendConnectorConfig))


def check_options(options: dict[str, Any], what: str = "LLM") -> None:
    """Raise :class:`ConfigError` naming every key of ``options`` that is no option at all."""
    unknown = sorted(set(options) - set(ENGINE_OPTIONS))
    if unknown:
        unknown = sorted(set(unknown) - set(connector_options()))
    if unknown:
        raise ConfigError(
            f"unknown {what} option(s) {', '.join(map(repr, unknown))}; valid: "
            f"{', '.join(ENGINE_OPTIONS)} (engine) and {', '.join(connector_options())} "
            "(blend connector)"
        )


def create_engine_config(**options: Any) -> EngineConfig:
    """The validated :class:`EngineConfig` for flat ``options``.

    A blend connector option (``kv_store_dir``, ``prefetch_kv``, ...) lands in
    ``kv_connector_config``, on top of a :class:`BlendConnectorConfig` given there if any. It is
    refused when ``kv_connector`` is None or another registered name (a factory may build a
    blend connector, so it gets them).
    """
    check_options(options)
    engine = {k: v for k, v in options.items() if k in ENGINE_OPTIONS}
    connector = {k: v for k, v in options.items() if k not in ENGINE_OPTIONS}
    if connector:
        from blendkv.blend.config import BlendConnectorConfig

        spec = engine.get("kv_connector", "blend")
        if spec is None or (isinstance(spec, str) and spec != "blend"):
            raise ConfigError(
                f"{', '.join(sorted(connector))}: option(s) of the blend KV connector, but "
                f"kv_connector is {spec!r}"
            )
        base = engine.get("kv_connector_config")
        if base is None:
            base = BlendConnectorConfig()
        elif not isinstance(base, BlendConnectorConfig):
            raise ConfigError(
                f"{', '.join(sorted(connector))} given beside kv_connector_config={base!r}, "
                "which is not a BlendConnectorConfig"
            )
        engine["kv_connector_config"] = replace(base, **connector)
    return EngineConfig(**engine)
