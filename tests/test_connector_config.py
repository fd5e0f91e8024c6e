"""The connector config classes are typed models: parse_config still reads users' extra: mappings
(strings for numbers, sizes with units), and a config built in code with a wrong type fails."""

from __future__ import annotations

import dataclasses

import pydantic
import pytest

from omni_mesh.connectors import config


def test_a_config_built_in_code_is_checked_by_type() -> None:
    with pytest.raises(pydantic.ValidationError, match="port"):
        config.ZmqConfig(port="5555")  # type: ignore[arg-type]
    with pytest.raises(pydantic.ValidationError, match="copy_on_get"):
        config.SharedMemoryConfig(copy_on_get="yes")  # type: ignore[arg-type]
    assert config.ZmqConfig(ttl_s=1).ttl_s == 1.0


def test_parse_config_still_reads_what_users_write() -> None:
    cfg = config.parse_config(
        config.MooncakeStoreConfig,
        {"segment": "1GiB", "proto": "rdma", "ttl_s": "60"},
        owner="MooncakeStoreConnector",
    )
    assert (cfg.segment, cfg.protocol, cfg.ttl_s) == (1 << 30, "rdma", 60.0)
    with pytest.raises(config.ConnectorConfigError, match="did you mean 'memory_pool_size'"):
        config.parse_config(config.SharedMemoryConfig, {"memory_pool_sise": 1}, owner="SharedMemoryConnector")


def test_the_config_classes_are_still_dataclasses() -> None:
    """topology checks and vllm-omni's key tables read their fields with dataclasses.fields."""
    for name in config.__all__:
        value = getattr(config, name)
        if isinstance(value, type) and name.endswith("Config"):
            assert dataclasses.is_dataclass(value), name
            assert {f.name for f in dataclasses.fields(value)}, name
