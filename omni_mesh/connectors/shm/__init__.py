"""Shared memory: segments, pools, slots, the host-wide index and the tiny-payload cells behind
SharedMemoryConnector. Private to `omni_mesh.connectors`: outside it, use the connector and its lifecycle."""
