"""The registry's load-order rule: connectors of backends whose native libraries must load first
(Mooncake before openYuanrong) sort first wherever one process creates several."""

from __future__ import annotations

import pytest

from omni_mesh import connectors
from omni_mesh.connectors import OmniConnectorBase, creation_rank


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
        monkeypatch.setitem(connectors._REGISTRY, name, target)  # not left behind for other tests
    assert creation_rank("AliasOfTheStore") == 0
    assert creation_rank("MooncakeLookalike") == 1
    assert creation_rank("Local") == 1
    assert creation_rank("NoSuchConnector") == 1  # create_connector is the one that reports it
