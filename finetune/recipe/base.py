"""The pieces every recipe section shares: the pydantic base class and the cross-field problem list.

A section's cross-field rules live in its `_problems(ok)`, which returns every problem at once;
`_combination_error` turns them into one pydantic error that finetune.recipe.errors expands into a
line per problem. Rules only check: defaults that depend on other fields are filled in before
validation, in one visible step (finetune.recipe.defaults).
"""

from __future__ import annotations

import re
import typing
from collections.abc import Callable
from typing import Annotated, Any, ClassVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from finetune.recipe.overrides import _unwrap

Problem = tuple[str, Any, str]  # (dotted path relative to the section, bad value, message)

# Resume: a field marked `Field(..., **FIXED_ON_RESUME)` may not change when a run resumes from a
# checkpoint, because the run continues the checkpoint's optimizer state, LR schedule, data order or
# model (finetune.recipe.resume). A section whose `fixed_on_resume` class attribute is true has every
# field fixed except those marked `**FREE_ON_RESUME`.
FIXED_ON_RESUME: dict[str, Any] = {"json_schema_extra": {"fixed_on_resume": True}}
FREE_ON_RESUME: dict[str, Any] = {"json_schema_extra": {"fixed_on_resume": False}}


def _compiles(pattern: str) -> str:
    """A regex field's value, compiled here so that a bad pattern is a recipe error at validate time
    rather than a re.error traceback at the first evaluation, after the model was loaded."""
    try:
        re.compile(pattern)
    except re.error as e:
        raise PydanticCustomError(
            "regex",
            "is not a valid regular expression ({error}). Fix the pattern: a literal ( ) [ ] { } . * + ? | "
            "or backslash needs a backslash before it, and in YAML write the pattern in single quotes "
            "('#### (\\d+)') so that the backslashes reach the regex as written",
            {"error": str(e)},
        ) from None
    return pattern


Regex = Annotated[str, AfterValidator(_compiles)]
"""The type of every recipe field that holds a regular expression (Python's `re` syntax)."""


def number_kind(annotation: Any) -> str | None:
    """'an integer' or 'a number' when a field of type `annotation` takes numbers but no boolean.

    >>> from typing import Literal
    >>> number_kind(int | None), number_kind(float | Literal["auto"]), number_kind(bool | int), number_kind(str)
    ('an integer', 'a number', None, None)
    """
    alternatives = _unwrap(annotation)
    for alt in alternatives:
        if alt is bool or alt is Any or any(isinstance(v, bool) for v in typing.get_args(alt)):
            return None  # a boolean is one of its values
    if float in alternatives:
        return "a number"
    return "an integer" if int in alternatives else None


def _all_ok(*names: str) -> bool:
    return True


class _Section(BaseModel):
    # allow_inf_nan=False: `.inf` or `.nan` for a learning rate, epochs or an alpha cannot work.
    model_config = ConfigDict(
        extra="forbid", validate_default=True, use_attribute_docstrings=False, allow_inf_nan=False
    )
    fixed_on_resume: ClassVar[bool] = False  # every field fixed on resume (see FIXED_ON_RESUME)

    def _warnings(self) -> list[Problem]:
        """Settings of this section that work but are probably not what was meant (a warning at start,
        not an error: docs/CONTRIBUTING.md); same shape as `_problems`. Only called on valid recipes."""
        return []

    def _problems(self, ok: Callable[..., bool]) -> list[Problem]:
        """Cross-field problems of this section; override in sections that have rules.

        `ok(*names)` says whether those fields (dotted paths below this section) validated. It is
        always true during normal validation; when other fields of the section are invalid,
        `_salvage` runs the rules again on what did validate, so a rule must check `ok` for every
        field it reads. That is how a bad combination is reported together with a typo elsewhere.
        """
        return []

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        """Refuse true/false for a numeric field of any section.

        pydantic's lax mode takes a boolean as 1 or 0 for an int or float, so `beta: true` became
        1.0 and `loss_chunk_size: true` chunks of one token, silently; its strict mode would also
        refuse the strings a YAML recipe may hold ("1e-4"), and it has no setting for booleans
        alone, hence this check.
        """
        if isinstance(value, bool) and info.field_name is not None:
            kind = number_kind(cls.model_fields[info.field_name].annotation)
            if kind is not None:
                raise PydanticCustomError(
                    "bool_number",
                    "a boolean where {kind} is expected (it would count as {number}; YAML reads an unquoted "
                    "true/false/yes/no/on/off as a boolean): write the number you mean",
                    {"kind": kind, "number": int(value)},
                )
        return value

    @model_validator(mode="after")
    def _check_combinations(self):
        _combination_error(self._problems(_all_ok))
        return self


def _combination_error(problems: list[Problem]) -> None:
    """Raise one pydantic error that carries every cross-field problem of a section.

    Each problem is (field path relative to the section, bad value, message); list items are
    numeric parts (`datasets.0.type`). The error formatter in finetune.recipe.errors expands them
    into one line each with its full YAML path, so a user sees every bad combination at once
    instead of one per run.
    """
    if problems:
        raise PydanticCustomError(
            "combination",
            "; ".join(f"{path}: {msg}" for path, _, msg in problems),
            {"problems": problems},
        )


def tagged_members(annotation: Any) -> dict[str, type[BaseModel]] | None:
    """{tag: model} of a union discriminated by a function, as `Annotated[Annotated[A, Tag("a")] | ...,
    Discriminator(f)]` (the dataset entries, finetune.recipe.formats); None for any other annotation.

    pydantic puts the tag in an error's loc (`data.datasets.0.alpaca.field_x`): the error formatter
    and the loader use this to find the member a tag names, or the one a value validates as.
    """
    if typing.get_origin(annotation) is not Annotated:
        return None
    union, *metadata = typing.get_args(annotation)
    if not any(isinstance(m, Discriminator) for m in metadata):
        return None
    members = {}
    for member in typing.get_args(union):
        model, *tags = typing.get_args(member)
        members.update({t.tag: model for t in tags if isinstance(t, Tag)})
    return members


def union_member(annotation: Any, value: Any) -> type[BaseModel] | None:
    """The member of a tagged union (see `tagged_members`) that `value` validates as, or None."""
    members = tagged_members(annotation)
    if members is None:
        return None
    discriminator = next(m for m in typing.get_args(annotation)[1:] if isinstance(m, Discriminator))
    tag = discriminator.discriminator(value) if callable(discriminator.discriminator) else None
    return members.get(tag)
