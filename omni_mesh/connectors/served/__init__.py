"""The served side channel: a producer serves its payloads over ZeroMQ ROUTER/DEALER, consumers pull them
(ZmqConnector, the Mooncake transfer engine and the engine-pull connectors). Private to `omni_mesh.connectors`."""
