"""What the tests share and the benchmarks do not (those parts are in omni_mesh/local_services/ and omni_mesh/procinfo.py).

Imported as modules (`from support.meshkit import ...`): meshkit (`omni-mesh up` meshes, polling),
servicekit (compose services as processes), docker_engine, netns (two hosts as network namespaces),
payloads (the payload catalogue and the one comparison), peer (a connector in another process).
Run as scripts by path: peer.py, shm_consumer.py. Copied next to a topology and imported there by
name (`handler: mesh_handlers:step`): mesh_handlers.py, scaling_handlers.py.
"""
