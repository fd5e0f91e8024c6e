"""Registered memory pools the connectors share: the allocator, pool growth, held regions and
zero-copy outputs. Private to `omni_mesh.connectors`."""
