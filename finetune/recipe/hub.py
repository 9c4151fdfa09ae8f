"""The `hub` section: where the adapter or model goes on the Hugging Face Hub."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from finetune.recipe.base import _Section


class HubSection(_Section):
    model_id: str | None = Field(None, description="`org/name` for the adapter or model.")
    private: bool = Field(True, description="Create private repos.")
    strategy: Literal["end", "every_save"] = Field(
        "end", description="Push at the end, or at every checkpoint too."
    )

    @field_validator("model_id")
    @classmethod
    def _repo_id(cls, value: str | None) -> str | None:
        if value is not None and (value.count("/") != 1 or not all(value.split("/"))):
            raise ValueError("expected `org/name`")
        return value
