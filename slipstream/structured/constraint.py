"""What a request's output must match, as one frozen, comparable value.

A `Constraint` is part of `SamplingParams`: two requests merge only when their constraints are equal
(the merge key is the params' repr, which spells the whole constraint). The grammar text is
canonical (a JSON schema is stored as compact JSON, its key order kept: properties are generated
in that order) so equal constraints compare equal.
Import-light: nothing here loads the grammar library.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "choice", "grammar")


class ConstraintError(ValueError):
    """A constraint that cannot be compiled (bad schema, bad regex, unsupported grammar construct)."""

    def __init__(self, message: str, code: str = "invalid_grammar"):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Constraint:
    kind: Kind
    spec: str            # the schema as canonical JSON, the regex, the choices as a JSON list, the grammar

    @staticmethod
    def json_schema(schema: dict[str, Any] | bool) -> Constraint:
        if not isinstance(schema, (dict, bool)):
            raise ConstraintError("a JSON schema must be an object", "invalid_json_schema")
        # the key order is kept: properties are generated in it
        return Constraint("json_schema", json.dumps(schema, separators=(",", ":")))

    @staticmethod
    def json_object() -> Constraint:
        return Constraint("json_object", "")

    @staticmethod
    def regex(pattern: str) -> Constraint:
        try:
            re.compile(pattern)
        except re.error as e:
            raise ConstraintError(f"invalid regex: {e}") from None
        return Constraint("regex", pattern)

    @staticmethod
    def choice(options: list[str]) -> Constraint:
        if not options or not all(isinstance(o, str) for o in options):
            raise ConstraintError("a choice needs a non-empty list of strings")
        return Constraint("choice", json.dumps(list(options), separators=(",", ":")))

    @staticmethod
    def grammar(text: str) -> Constraint:
        if not text.strip():
            raise ConstraintError("the grammar is empty")
        return Constraint("grammar", text)

    @property
    def schema(self) -> Any:
        """The JSON schema (json_schema only)."""
        return json.loads(self.spec)

    def __repr__(self) -> str:   # the merge key holds it whole
        return f"Constraint({self.kind}, {self.spec!r})"
