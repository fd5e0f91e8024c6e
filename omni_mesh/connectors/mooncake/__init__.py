"""Mooncake: the store and transfer-engine plumbing behind MooncakeStoreConnector and
MooncakeTransferEngineConnector. Private to `omni_mesh.connectors`."""
