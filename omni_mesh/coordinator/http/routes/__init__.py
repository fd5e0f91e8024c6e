"""The coordinator's routes, one router per module; http.app assembles them (with openai.routes)."""
