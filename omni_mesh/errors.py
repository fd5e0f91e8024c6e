"""Errors a stage handler raises to say the request, not the stage, is at fault."""

from __future__ import annotations


class InvalidInput(ValueError):
    """The request's inputs or params are wrong (a missing prompt, a param out of range).

    Raise it from a handler with a message naming the field and what to send instead: the client
    should get 422 with that message and the stage's name, where any other exception is a 500 (a
    stage failure). It is a ValueError, so code that catches those keeps working.
    """
