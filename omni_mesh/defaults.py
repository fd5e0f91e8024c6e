"""Values several modules and processes must agree on, kept in one module that imports nothing, so
that the CLI parses its flags with them without loading uvicorn, zmq or the coordinator, and nothing
has to repeat a value to stay light."""

from __future__ import annotations

#: Set to 1 to run a mesh without its keys (the launcher passes it on to every child).
ENV_INSECURE = "OMNI_MESH_INSECURE"
#: The coordinator's instance id, when the launcher or the deployment chooses it.
INSTANCE_ENV = "OMNI_MESH_INSTANCE"
#: What a connector's `host: auto` binds and advertises in this process (omni_mesh.connectors._addresses);
#: `omni-mesh up` sets it for its children: 127.0.0.1 unless `--connector-host` says otherwise.
CONNECTOR_HOST_ENV = "OMNI_MESH_CONNECTOR_HOST"
#: The replicas `omni-mesh up` runs on its host in all: its coordinator keeps autoscale targets within it.
HOST_CAP_ENV = "OMNI_MESH_HOST_REPLICA_CAP"
#: With several coordinators (`up --coordinators N`): this one's id (`c0`, `c1`, ...; it prefixes its
#: request ids and names it in X-Omni-Coordinator), and the directory where each writes its status line.
COORDINATOR_ID_ENV = "OMNI_MESH_COORDINATOR_ID"
COORDINATORS_DIR_ENV = "OMNI_MESH_COORDINATORS_DIR"

#: REST deadlines: the request's head from the connection's start, its body after the head, and an
#: answer's writes (a client that reads nothing for this long is cut off).
HEADER_TIMEOUT_S = 5.0
BODY_TIMEOUT_S = 10.0
WRITE_TIMEOUT_S = 10.0

#: A replica's heartbeat interval (the coordinator announces it at registration; replicas use it until then).
HEARTBEAT_S = 0.5
#: Silence after which the coordinator takes a replica out.
HEARTBEAT_TIMEOUT_S = 5.0
#: Silence after which `up` kills and restarts its coordinator.
COORDINATOR_UNRESPONSIVE_S = 60.0
