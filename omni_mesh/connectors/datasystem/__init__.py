"""openYuanrong datasystem: the key mapping, client logs and errors behind YuanrongConnector and
YuanrongTransferEngineConnector. Private to `omni_mesh.connectors` (a `yuanrong/` package would shadow
the public `yuanrong.py` module)."""
