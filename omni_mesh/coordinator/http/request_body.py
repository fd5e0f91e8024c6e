"""The body of `POST /v1/requests`. Whether its values can travel to a stage is admission's check
(scheduling.packable), made for the OpenAI route too."""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator
from pydantic_core import PydanticCustomError


class RequestBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    inputs: dict[str, Any] = Field(default_factory=dict, description="the entry stages' inputs")
    params: dict[str, Any] = Field(default_factory=dict, description="passed to every handler as ctx.params")
    timeout_s: Annotated[float, Field(gt=0, allow_inf_nan=False, strict=True)] | None = Field(
        default=None, description="deadline in seconds (a finite number > 0); the coordinator's default if unset"
    )
    stream: StrictBool = Field(default=False, description="answer with server-sent events as the final stage streams")

    @field_validator("timeout_s", mode="before")
    @classmethod
    def _finite_positive_seconds(cls, value: Any) -> Any:
        # Python's json reads NaN and Infinity, and pydantic would read `true` as 1 s: only a real,
        # finite, positive number is a deadline.
        if value is None:
            return value
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or not math.isfinite(value) or value <= 0:
            raise PydanticCustomError("timeout_s", "must be a finite number of seconds > 0, e.g. 30")
        return value
