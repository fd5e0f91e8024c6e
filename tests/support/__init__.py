"""What the tests share and the benchmarks do not (those parts are in omni_mesh/testing/).

Imported as modules: meshkit (`omni-mesh up` meshes), servicekit (compose services as processes),
docker_engine, netns (two hosts as network namespaces), mooncake_fixtures (payload catalogue, peer).
Run as scripts by path: mooncake_fixtures.py (the peer), shm_consumer.py. Copied next to a topology and
imported there by name (`handler: mesh_handlers:step`): mesh_handlers.py, scaling_handlers.py.
"""
