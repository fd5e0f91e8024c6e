"""The coordinator's HTTP room: the FastAPI app (`app.py`), its middleware (`access.py`, `auth.py`,
`hosts.py`, `limits.py`), its routers (`routes/`) and what they answer with (`envelope.py`,
`json_body.py`, `sse.py`). It calls the scheduling room; the scheduling room never imports it."""
