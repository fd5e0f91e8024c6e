"""vllm-omni's connector configuration, accepted and honoured (omni_mesh/connectors/config/vllm_omni_keys.py).

Every key a vllm-omni connector of the same name reads is accepted under its name: read as our field
where the meaning is the same, accepted silently where we already do what it asks, otherwise accepted
with one warning saying it has no effect. A key neither knows is an error with a "did you mean".
Real connectors where they are cheap to build (SharedMemory, ZeroMQ, Mooncake TE over TCP with
P2PHANDSHAKE); `validate_config` (the same parse_config and check()) for the others.
"""

from __future__ import annotations

import dataclasses
import logging
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from omni_mesh.connectors import (
    ConnectorConfigError,
    available_connectors,
    connector_class,
    create_connector,
)
from omni_mesh.connectors.config import vllm_omni_keys as _vllm_omni_keys
from omni_mesh.connectors.config.fields import aliases as config_aliases
from omni_mesh.connectors.config.parse import parse_config
from omni_mesh.topology import TopologyError, parse_topology

BUILT_IN = [
    "SharedMemoryConnector",
    "MooncakeStoreConnector",
    "MooncakeConnector",
    "MooncakeTransferEngineConnector",
    "YuanrongConnector",
    "YuanrongTransferEngineConnector",
    "MoriTransferEngineConnector",
    "ZmqConnector",
]
TE_CONFIG = {"host": "127.0.0.1", "memory_pool_size": "8MiB", "prefault": False}


def parsed(name: str, config: dict) -> object:
    cls = connector_class(name)
    return parse_config(cls.config_class, config, owner=cls.__name__)


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sees the first warning of each key again (they are once per process)."""
    monkeypatch.setattr(_vllm_omni_keys, "_warned", set())


def no_effect_records(caplog: pytest.LogCaptureFixture, key: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if f"{key!r} (vllm-omni's) has no effect" in r.getMessage()]


# --------------------------------------------------------------------------------------------------
# the table itself


def test_every_built_in_connector_has_a_table_and_its_aliases_are_on_its_fields() -> None:
    assert set(BUILT_IN) <= set(available_connectors())
    for name in BUILT_IN:
        cls = connector_class(name)
        fields = {f.name for f in dataclasses.fields(cls.config_class)}
        assert name in _vllm_omni_keys.KEYS, name
        for key, entry in _vllm_omni_keys.table_rows(name).items():
            assert key not in fields, f"{name}: {key} is our own field and needs no row"
            assert entry.note, f"{name}: {key} says nothing about what it does"
        for alias, target in config_aliases(cls.config_class).items():
            assert alias not in fields and target in fields, f"{name}: {alias} -> {target}"
            assert alias not in _vllm_omni_keys.table_rows(name), f"{name}: {alias} is a field's alias and a row"
    assert config_aliases(connector_class("MooncakeConnector").config_class) == {"proto": "protocol", "rdma": "device_name"}


@pytest.mark.parametrize("name", BUILT_IN)
def test_every_vllm_omni_key_is_accepted_by_every_connector_that_lists_it(name: str) -> None:
    samples = {"role": "receiver", "codec_chunk_ramp": [1, 4, 8], "codec_streaming": True}
    cls = connector_class(name)
    for key, entry in _vllm_omni_keys.table_rows(name).items():
        key = key.replace("*", "sleep_s")
        value = samples.get(key, "60" if entry.kind == "alias" and "ttl" in (entry.target or "") else 1)
        if entry.kind == "alias" and entry.target in ("protocol", "device_name"):
            value = {"protocol": "tcp", "device_name": "mlx5_0"}[entry.target]
        if key == "memory_pool_device":
            value = "cpu"
        cls.validate_config({key: value})  # raises if refused


# --------------------------------------------------------------------------------------------------
# mapped: read as our field, and it works as ours


def test_shm_threshold_bytes_is_inline_max_bytes_for_real_puts() -> None:
    small = {"x": b"a" * 100}
    with create_connector("SharedMemoryConnector", {"shm_threshold_bytes": 65536}) as inline:
        assert inline.config.inline_max_bytes == 65536
        ok, _, metadata = inline.put("0", "1", "r1", small)
        assert ok and "frame" in metadata  # the payload rides in its metadata
    with create_connector("SharedMemoryConnector", {"shm_threshold_bytes": "0"}) as pooled:
        assert pooled.config.inline_max_bytes == 0
        ok, _, metadata = pooled.put("0", "1", "r1", small)
        assert ok and "frame" not in metadata
        pooled.cleanup("r1")


def test_buffer_ttl_seconds_is_ttl_s_and_frees_unconsumed_payloads() -> None:
    producer = create_connector("MooncakeTransferEngineConnector", {**TE_CONFIG, "buffer_ttl_seconds": "0.3"})
    try:
        assert producer.config.ttl_s == 0.3
        ok, _, _ = producer.put("a", "b", "ttl/x", b"x" * 4096)
        assert ok and producer.health()["pool_in_use"] > 0
        deadline = time.monotonic() + 5.0
        while producer.health()["pool_in_use"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert producer.health()["pool_in_use"] == 0 and producer.health()["expired"] == 1
    finally:
        producer.close()


@pytest.mark.parametrize("name", ["MooncakeConnector", "MooncakeStoreConnector"])
def test_mooncake_store_takes_vllm_omnis_own_extra(name: str) -> None:
    # The extra of vllm-omni's stage configs, as written there.
    extra = {
        "host": "127.0.0.1",
        "metadata_server": "http://10.0.0.1:8080/metadata",
        "master": "10.0.0.1:50051",
        "segment": 512000000,
        "localbuf": 64000000,
        "proto": "tcp",
        "rdma": "",
    }
    config = parsed(name, extra)
    assert (config.protocol, config.segment, config.localbuf, config.device_name) == ("tcp", 512000000, 64000000, "")
    assert parsed(name, {"proto": "rdma", "rdma": "mlx5_0"}).device_name == "mlx5_0"
    assert parsed(name, {"segment": "512MiB"}).segment == 512 * 1024 * 1024


def test_alias_and_our_name_must_agree() -> None:
    with pytest.raises(ConnectorConfigError, match=r"'proto' \(vllm-omni's name for 'protocol'\) and 'protocol' disagree"):
        parsed("MooncakeConnector", {"proto": "rdma", "protocol": "tcp"})
    assert parsed("MooncakeConnector", {"proto": "tcp", "protocol": "tcp"}).protocol == "tcp"


def test_mooncake_connector_is_the_store_connector() -> None:
    assert connector_class("MooncakeConnector") is connector_class("MooncakeStoreConnector")


# --------------------------------------------------------------------------------------------------
# honoured: accepted silently, values checked as vllm-omni checks them


def test_stage_id_and_role_are_accepted_silently_by_a_real_connector(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="omni_mesh.connectors")
    for role in ("sender", "receiver", "dual"):
        with create_connector("ZmqConnector", {"host": "127.0.0.1", "stage_id": 1, "role": role}) as connector:
            ok, _, _ = connector.put("0", "1", "r", {"a": 1})  # a "receiver" can still put: every instance can
            assert ok
            connector.cleanup("r")
    assert not [r for r in caplog.records if "has no effect" in r.getMessage()]


def test_a_role_vllm_omni_refuses_is_refused() -> None:
    message = r"ZmqConnector: config key 'role' must be one of 'sender', 'receiver', 'dual', 'auto', got 'b"
    with pytest.raises(ConnectorConfigError, match=message):
        connector_class("ZmqConnector").validate_config({"role": "boss"})


def test_memory_pool_device_cpu_is_what_mooncake_te_does_anyway(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="omni_mesh.connectors")
    parsed("MooncakeTransferEngineConnector", {"memory_pool_device": "cpu"})
    assert not no_effect_records(caplog, "memory_pool_device")
    parsed("MooncakeTransferEngineConnector", {"memory_pool_device": "cuda:0"})
    assert len(no_effect_records(caplog, "memory_pool_device")) == 1


# --------------------------------------------------------------------------------------------------
# no effect: accepted, one warning per key and process


def test_no_effect_keys_warn_once_per_key(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="omni_mesh.connectors")
    extra = {
        "host": "127.0.0.1",
        "codec_chunk_frames": 25,
        "codec_left_context_frames": 72,
        "initial_codec_chunk_frames": 1,
        "connector_get_sleep_s": 0.01,
    }
    for _ in range(3):
        with create_connector("ZmqConnector", extra):
            pass
    for key in ("codec_chunk_frames", "codec_left_context_frames", "initial_codec_chunk_frames", "connector_get_sleep_s"):
        (record,) = no_effect_records(caplog, key)
        assert record.getMessage().startswith(f"ZmqConnector: config key {key!r}")


def test_sender_keys_of_mooncake_te_warn_on_a_real_connector(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="omni_mesh.connectors")
    config = {**TE_CONFIG, "sender_host": "10.0.0.2", "sender_zmq_port": "50051", "role": "receiver", "stage_id": 2}
    connector = create_connector("MooncakeTransferEngineConnector", config)
    connector.close()
    assert len(no_effect_records(caplog, "sender_host")) == 1
    assert len(no_effect_records(caplog, "sender_zmq_port")) == 1


# --------------------------------------------------------------------------------------------------
# unknown keys: an error with a "did you mean", for every connector


@pytest.mark.parametrize(
    ("name", "key", "suggestion"),
    [
        ("SharedMemoryConnector", "shm_treshold_bytes", "shm_threshold_bytes"),
        ("SharedMemoryConnector", "inline_max_byte", "inline_max_bytes"),
        ("MooncakeConnector", "metadata_sever", "metadata_server"),
        ("MooncakeStoreConnector", "local_buf", "localbuf"),
        ("MooncakeTransferEngineConnector", "buffer_ttl_second", "buffer_ttl_seconds"),
        ("MoriTransferEngineConnector", "qp_per_transfers", "qp_per_transfer"),
        ("YuanrongConnector", "get_sub_timeout", "get_sub_timeout_ms"),
        ("YuanrongTransferEngineConnector", "rpc_prot", "rpc_port"),
        ("ZmqConnector", "hots", "host"),
    ],
)
def test_unknown_key_names_the_key_with_a_suggestion(name: str, key: str, suggestion: str) -> None:
    with pytest.raises(ConnectorConfigError) as info:
        connector_class(name).validate_config({key: 1})
    message = str(info.value)
    assert f"unknown config key {key!r} in extra; did you mean {suggestion!r}?" in message
    assert "allowed:" in message and "vllm-omni's:" in message


def test_a_key_far_from_every_name_gets_the_lists_only() -> None:
    with pytest.raises(ConnectorConfigError, match=r"unknown config key 'zzzz' in extra; \(allowed: copy_on_get"):
        connector_class("SharedMemoryConnector").validate_config({"zzzz": 1})


def test_a_vllm_omni_key_of_another_connector_is_still_unknown() -> None:
    with pytest.raises(ConnectorConfigError, match="unknown config key 'shm_threshold_bytes'"):
        connector_class("ZmqConnector").validate_config({"shm_threshold_bytes": 65536})


# --------------------------------------------------------------------------------------------------
# values as vllm-omni reads them: numeric strings, $VAR / ${VAR}


@pytest.mark.parametrize(
    ("name", "config", "field", "value"),
    [
        ("YuanrongConnector", {"port": "35000"}, "port", 35000),
        ("YuanrongConnector", {"get_sub_timeout_ms": "1000"}, "get_sub_timeout_ms", 1000),
        ("ZmqConnector", {"ttl_s": "60"}, "ttl_s", 60.0),
        ("MooncakeTransferEngineConnector", {"zmq_port": "50051"}, "zmq_port", 50051),
        ("MooncakeTransferEngineConnector", {"memory_pool_size": "2147483648"}, "memory_pool_size", 2147483648),
        ("MooncakeTransferEngineConnector", {"buffer_ttl_seconds": "900"}, "ttl_s", 900.0),
        ("MoriTransferEngineConnector", {"qp_per_transfer": "2"}, "qp_per_transfer", 2),
        ("SharedMemoryConnector", {"shm_threshold_bytes": "65536"}, "inline_max_bytes", 65536),
    ],
)
def test_numeric_strings_are_numbers(name: str, config: dict, field: str, value: object) -> None:
    got = getattr(parsed(name, config), field)
    assert got == value and type(got) is type(value)


def test_a_string_that_is_not_a_number_is_still_refused() -> None:
    with pytest.raises(ConnectorConfigError, match=r"config key 'port' expects int, got 'x35000'"):
        connector_class("YuanrongConnector").validate_config({"port": "x35000"})


def test_variables_expand_in_a_config_given_straight_to_create_connector(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNI_TEST_HOST", "127.0.0.1")
    monkeypatch.setenv("OMNI_TEST_TTL", "42")
    monkeypatch.delenv("OMNI_TEST_UNSET", raising=False)
    with create_connector("ZmqConnector", {"host": "$OMNI_TEST_HOST", "ttl_s": "${OMNI_TEST_TTL}"}) as connector:
        assert connector.config.host == "127.0.0.1" and connector.config.ttl_s == 42.0
        ok, _, metadata = connector.put("0", "1", "r", b"x")
        assert ok and "127.0.0.1" in metadata["endpoint"]
        connector.cleanup("r")
    assert parsed("YuanrongConnector", {"port": "${OMNI_TEST_UNSET:-35000}"}).port == 35000
    assert parsed("YuanrongConnector", {"host": "${OMNI_TEST_UNSET}"}).host == "${OMNI_TEST_UNSET}"  # as written
    assert parsed("MooncakeConnector", {"proto": "${OMNI_TEST_UNSET:-rdma}"}).protocol == "rdma"


# --------------------------------------------------------------------------------------------------
# in a topology: used connectors strictly, unused ones as warnings; no-effect keys are warnings


def stage_config(extra_of_used: dict, extra_of_unused: dict) -> str:
    return textwrap.dedent(
        f"""
        stage_args:
          - stage_id: 0
            output_connectors: {{to_stage_1: used}}
          - stage_id: 1
            engine_input_source: [0]
            final_output: true
            input_connectors: {{from_stage_0: used}}
        runtime:
          connectors:
            used: {{name: SharedMemoryConnector, extra: {extra_of_used}}}
            spare: {{name: MooncakeTransferEngineConnector, extra: {extra_of_unused}}}
        """
    )


def test_mori_post_batch_size_is_a_count_not_a_size() -> None:
    """vllm-omni's MORI stage configs write post_batch_size: -1 (MORI's default): a count, despite its name."""
    assert parsed("MoriTransferEngineConnector", {"post_batch_size": -1}).post_batch_size == -1
    assert parsed("MoriTransferEngineConnector", {"post_batch_size": "8"}).post_batch_size == 8
    with pytest.raises(ConnectorConfigError, match="post_batch_size must be -1"):
        parsed("MoriTransferEngineConnector", {"post_batch_size": 0})


def test_unused_connectors_warn_and_used_ones_fail() -> None:
    topo = parse_topology(yaml.safe_load(stage_config({"shm_threshold_bytes": 65536}, {"zmq_prot": 1})), source="t.yaml")
    (warning,) = topo.warnings
    assert warning.startswith("connector 'spare' (used by no edge)") and "did you mean 'zmq_port'?" in warning
    assert "not an error: no edge uses it" in warning
    with pytest.raises(TopologyError, match=r"connector 'used' \(used by edge 0->1.*unknown config key 'zmq_prot'"):
        parse_topology(yaml.safe_load(stage_config({"zmq_prot": 1}, {})), source="t.yaml")


def test_no_effect_keys_are_validate_warnings() -> None:
    text = stage_config({"codec_chunk_frames": 25, "stage_id": 0}, {"sender_host": "10.0.0.2", "memory_pool_device": "cpu"})
    warnings = parse_topology(yaml.safe_load(text), source="t.yaml").warnings
    assert any(w.startswith("connector 'used' (used by edge 0->1") and "'codec_chunk_frames'" in w for w in warnings)
    assert any(w.startswith("connector 'spare' (used by no edge)") and "'sender_host'" in w for w in warnings)
    assert not any("stage_id" in w or "memory_pool_device" in w for w in warnings)


def test_docs_show_every_row_of_the_table() -> None:
    docs = (Path(__file__).parent.parent / "docs" / "connectors.md").read_text()
    section = docs.split("## vllm-omni's configuration keys", 1)[1].split("\n## ", 1)[0]
    for name, table in _vllm_omni_keys.KEYS.items():
        if name != "MooncakeConnector" and table:
            part = section.split(f"### {name}", 1)[1].split("\n### ", 1)[0]
            for key in table:
                assert f"| `{key}` |" in part, f"docs/connectors.md: {name} lacks {key}"
    for name in BUILT_IN:
        for alias, target in config_aliases(connector_class(name).config_class).items():
            part = section.split(f"### {name.replace('MooncakeConnector', 'MooncakeStoreConnector')}", 1)[1]
            part = part.split("\n### ", 1)[0]
            assert f"| `{alias}` | read as `{target}` |" in part, f"docs/connectors.md: {name} lacks {alias}"
    every_connector = (_vllm_omni_keys._EVERY_CONNECTOR, _vllm_omni_keys._CHUNK_ADAPTER)
    for key in [name for table in (*every_connector, _vllm_omni_keys._MODEL_CODE) for name in table]:
        assert f"| `{key}` |" in section, key


@pytest.mark.parametrize("name", BUILT_IN)
def test_config_values_are_checked_one_way(name: str) -> None:
    """parse_config calls the config dataclass's check() (where it has one); nothing checks another way."""
    cls = connector_class(name)
    assert "validate_config" not in vars(cls) and not hasattr(cls, "_check")
    assert "__post_init__" not in vars(cls.config_class)
    if "ttl_s" in {f.name for f in dataclasses.fields(cls.config_class)}:
        with pytest.raises(ConnectorConfigError, match=rf"^{cls.__name__}: ttl_s must"):  # check() ran
            cls.validate_config({"ttl_s": -1})
