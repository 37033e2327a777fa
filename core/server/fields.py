"""Field types of the request schemas: what each value may be, stated once for both the validation
and the published OpenAPI schema.

* ``Text``: a string that is valid Unicode (a lone UTF-16 surrogate such as ``"\\ud800"``, which JSON
  escapes can carry, is rejected with code ``invalid_unicode``).
* ``TokenId``: an integer >= 0; the upper bound (the vocabulary) is known per app, so the schema
  carries the marker ``x-token-id`` that ``openapi.py`` replaces with ``maximum: vocab_size - 1``.
* ``Choices``: ``n``; ``x-choices`` becomes its per-app maximum (``MAX_N`` or the queue bound).
* ``only(value, name)``: a field accepted for compatibility whose only supported value is
  ``value``; anything else is ``unsupported_parameter``.

The request models are strict (``ConfigDict(strict=True)``): ``true`` is not a token id, ``"5"``
is not an integer, ``1.5`` is not an integer (``5.0`` is, as in JSON Schema); and non-finite
numbers (JSON ``NaN``, ``Infinity``) are rejected (``allow_inf_nan=False``). ``seed`` is any
integer, used modulo 2**64.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, ConfigDict, Field
from pydantic_core import PydanticCustomError

MAX_N = 128
MAX_TOP_LOGPROBS = 20
SEED_MOD = 2**64

STRICT = ConfigDict(strict=True, allow_inf_nan=False)

TOKEN_ID_MARK = "x-token-id"
CHOICES_MARK = "x-choices"


def _valid_unicode(s: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PydanticCustomError("invalid_unicode", "lone UTF-16 surrogate at position {pos}", {"pos": e.start}) from None
    return s


def _integral(v):
    """``5.0`` is the integer 5 (JSON Schema's view); other floats stay floats and fail."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


def integer(**limits):
    """An integer field with JSON Schema limits (``ge``, ``le``, ...) that also takes ``5.0``."""
    return Annotated[int, Field(**limits), BeforeValidator(_integral)]


Int = integer()
Text = Annotated[str, AfterValidator(_valid_unicode)]
PromptText = Annotated[str, AfterValidator(_valid_unicode), Field(min_length=1)]
TokenId = integer(ge=0, json_schema_extra={TOKEN_ID_MARK: True})
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Choices = integer(ge=1, le=MAX_N, json_schema_extra={CHOICES_MARK: True})
Seed = Annotated[Int, AfterValidator(lambda v: v % SEED_MOD)]
Temperature = Annotated[float, Field(ge=0, le=2)]
TopP = Annotated[float, Field(gt=0, le=1)]
TopK = integer(ge=-1, json_schema_extra={"not": {"const": 0}})  # -1 = off
MinP = Annotated[float, Field(ge=0, le=1)]
Penalty = Annotated[float, Field(ge=-2, le=2)]
RepetitionPenalty = Annotated[float, Field(gt=0)]
MaxTokens = integer(ge=1)
TopLogprobs = integer(ge=0, le=MAX_TOP_LOGPROBS)


def only(name: str, *values: Any):
    """A validator and its schema: ``values`` are the supported values of the field ``name``."""

    def check(v):
        if v not in values:
            raise PydanticCustomError("unsupported_parameter", f"{name}={v!r} is not supported")
        return v

    return AfterValidator(check), Field(json_schema_extra={"enum": list(values)})


def empty(name: str):
    """A validator: the collection must be empty (the feature is not supported)."""

    def check(v):
        if v:
            raise PydanticCustomError("unsupported_parameter", f"{name} is not supported")
        return v

    return AfterValidator(check)
