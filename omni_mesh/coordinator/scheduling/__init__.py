"""The coordinator's scheduling room: the one way in (`admission.py`), the replicas (`registry.py`),
the requests and where their work goes (`dispatch.py`), the control plane they go over (`service.py`,
`connection_cap.py`), reconciling after a dropped connection (`reconcile.py`), the autoscaler's
targets (`autoscaler.py`), and a request's events and failures (`events.py`, `failures.py`).
It imports nothing from the HTTP room or its libraries (tests/test_import_walls.py)."""
