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


def test_vllm_omni_aliases_and_readers_are_declared_on_the_fields() -> None:
    """An alias is the field's (no table row), and the field's type reads what a file writes: a size
    with a unit under vllm-omni's name too, a negative size refused naming the key."""
    from omni_mesh.connectors.config.fields import aliases

    assert aliases(config.SharedMemoryConfig) == {"shm_threshold_bytes": "inline_max_bytes"}
    assert aliases(config.ZmqConfig) == {}  # buffer_ttl_seconds is a transfer-engine connector's key only
    cfg = config.parse_config(config.SharedMemoryConfig, {"shm_threshold_bytes": "4KiB"}, owner="shm")
    assert cfg.inline_max_bytes == 4096
    with pytest.raises(
        config.ConnectorConfigError, match=r"^shm: memory_pool_size must not be negative, got -1$"
    ):
        config.parse_config(config.SharedMemoryConfig, {"memory_pool_size": -1}, owner="shm")
    with pytest.raises(
        config.ConnectorConfigError, match=r"^shm: config key 'prefault' expects bool, got 'yes'$"
    ):
        config.parse_config(config.SharedMemoryConfig, {"prefault": "yes"}, owner="shm")


def test_a_third_party_plain_dataclass_is_read_by_the_same_rules() -> None:
    """A connector registered at run time may bring a plain dataclass: its fields are typed from their
    defaults (sizes by name), and the config comes back as that class."""

    @dataclasses.dataclass(frozen=True)
    class Plain:
        host: str = "h"
        buffer_bytes: int = 0
        retries: int = 1
        timeout_s: float = 1.0
        fast: bool = False

    cfg = config.parse_config(
        Plain, {"buffer_bytes": "2MiB", "retries": "3", "timeout_s": "0.5", "fast": True}, owner="Plain"
    )
    assert cfg == Plain("h", 2 << 20, 3, 0.5, True) and type(cfg) is Plain
    with pytest.raises(config.ConnectorConfigError, match=r"Plain: config key 'host' expects str, got 12"):
        config.parse_config(Plain, {"host": 12}, owner="Plain")
    with pytest.raises(config.ConnectorConfigError, match=r"did you mean 'retries'"):
        config.parse_config(Plain, {"retrys": 3}, owner="Plain")


def test_inline_payloads_are_bounded_by_the_control_message_they_ride() -> None:
    """A frame under `inline_max_bytes` travels in its metadata, on a control message of at most 1 MiB:
    a larger setting is refused when the topology is read, naming the key, instead of failing every
    request whose payload falls in between."""
    cfg = config.parse_config(config.SharedMemoryConfig, {"inline_max_bytes": "1MiB"}, owner="shm")
    assert cfg.inline_max_bytes == 1 << 20
    for key, value in (("inline_max_bytes", "2MiB"), ("shm_threshold_bytes", (1 << 20) + 1)):
        refused = rf"^shm: {key} must be at most 1048576 \(1 MiB\)"
        with pytest.raises(config.ConnectorConfigError, match=refused):
            config.parse_config(config.SharedMemoryConfig, {key: value}, owner="shm")
    with pytest.raises(pydantic.ValidationError, match="inline_max_bytes"):
        config.SharedMemoryConfig(inline_max_bytes=1 << 30)
