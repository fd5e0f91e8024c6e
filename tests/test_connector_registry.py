"""The registry: the load-order rule (connectors of backends whose native libraries must load first,
Mooncake before openYuanrong, sort first wherever one process creates several), and connector types
read for topology checks without importing a built-in connector."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from omni_mesh.connectors import (
    ConnectorConfigError,
    OmniConnectorBase,
    connector_type,
    creation_rank,
    registry,
)
from omni_mesh.connectors import (
    config as configs,
)


def test_mooncake_connectors_are_created_before_the_others() -> None:
    names = ["YuanrongConnector", "SharedMemoryConnector", "MooncakeTransferEngineConnector",
             "YuanrongTransferEngineConnector", "MooncakeStoreConnector", "ZmqConnector"]
    ordered = sorted(names, key=creation_rank)
    assert ordered[:2] == ["MooncakeTransferEngineConnector", "MooncakeStoreConnector"]  # stable otherwise
    assert ordered[2:] == ["YuanrongConnector", "SharedMemoryConnector", "YuanrongTransferEngineConnector",
                           "ZmqConnector"]


def test_the_rule_follows_the_backend_module_not_the_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """An alias or a class registered at run time ranks by the module it lives in."""
    class Local(OmniConnectorBase):  # abstract is fine: it is only ranked
        pass

    registered = {"AliasOfTheStore": "omni_mesh.connectors.mooncake_store:MooncakeStoreConnector",
                  "MooncakeLookalike": "omni_mesh.connectors.zmq:ZmqConnector", "Local": Local}
    for name, target in registered.items():
        monkeypatch.setitem(registry.registered, name, target)  # not left behind for other tests
    assert creation_rank("AliasOfTheStore") == 0
    assert creation_rank("MooncakeLookalike") == 1
    assert creation_rank("Local") == 1
    assert creation_rank("NoSuchConnector") == 1  # create_connector is the one that reports it


# ---------------------------------------------------------------------- types checked without importing them


def test_each_built_in_type_is_what_its_class_says() -> None:
    """The light table topology checks read holds each built-in class's own config class and scope,
    and no built-in checks its config beyond the base class's `validate_config` (so the light check
    is the whole check)."""
    for record in registry.BUILT_INS:
        module_name, _, class_name = record.path.partition(":")
        cls = getattr(importlib.import_module(module_name), class_name)
        assert getattr(configs, record.config) is cls.config_class, record
        assert record.scope == cls.scope, record
        assert cls.validate_config.__func__ is OmniConnectorBase.validate_config.__func__, record
        assert registry.lifecycle_of(class_name) is cls.lifecycle, record
        for name in record.names:
            assert registry.connector_class(name) is cls, name
    registered = {t if isinstance(t, str) else f"{t.__module__}:{t.__name__}" for t in registry.registered.values()}
    built_in = {path for path in registered if path.startswith("omni_mesh.connectors.")}
    assert built_in == {record.path for record in registry.BUILT_INS}, "a built-in without its record"


def test_a_type_that_is_not_built_in_is_read_from_its_class(monkeypatch: pytest.MonkeyPatch) -> None:
    class Picky(OmniConnectorBase):  # abstract is fine: it is only checked
        config_class = configs.ZmqConfig
        scope = "host"

        @classmethod
        def validate_config(cls, config: dict | None) -> None:
            raise ConnectorConfigError("Picky: no config pleases it")

    monkeypatch.setitem(registry.registered, "Picky", Picky)
    kind = connector_type("Picky")
    assert (kind.name, kind.config_class, kind.scope, kind.cls) == ("Picky", configs.ZmqConfig, "host", Picky)
    with pytest.raises(ConnectorConfigError, match="no config pleases it"):
        kind.validate_config({})
    with pytest.raises(ValueError, match="unknown connector 'NoSuchConnector'"):
        connector_type("NoSuchConnector")


CHECK_EVERY_TOPOLOGY = """
import glob, sys
from omni_mesh import launcher
from omni_mesh.cli import export
from omni_mesh.connectors import available_connectors, connector_type
from omni_mesh.topology import load_topology
for path in sorted(glob.glob("compose/*.yaml")) + sorted(glob.glob("tests/topologies/vllm_omni*.yaml")):
    load_topology(path)
for name in available_connectors():
    connector_type(name).validate_config({})
    try:
        connector_type(name).validate_config({"no_such_key": 1})
    except ValueError:
        continue
    raise SystemExit(f"{name}: an unknown key passed its check")
print(" ".join(sorted(m for m in ("torch", "mooncake", "yr", "mori", "numpy") if m in sys.modules)))
"""


def test_checking_a_topology_imports_no_backend_and_no_torch() -> None:
    """`validate`, `up` and `export` read topologies and check every connector type's config without
    the 2 s of `import torch` or any backend library."""
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", CHECK_EVERY_TOPOLOGY], cwd=root, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [], f"imported: {done.stdout.strip()}"
