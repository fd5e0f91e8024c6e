"""Everything OpenAI in the coordinator: `routes.py` (/v1/chat/completions, /v1/models), `request.py`
(a chat request into the mesh's inputs), `reply.py` and `audio.py` (final outputs into a reply), and
`answer.py` (the reply, whole or as chunk events). The topology's `openai:` section that configures
it is read with the rest of the file (omni_mesh.topology.openai_spec, omni_mesh.topology.openai)."""
