"""Named extraction templates: an instruction, a JSON Schema and a few worked examples.

An ``extract`` job may name a template instead of writing a long instruction (and may leave out
its schema too). The worked examples go into the prompt as earlier chat turns, which is what
lets a small model fill the fields the way the examples do. A few are built in; users register
their own (``vqueue templates add FILE``), which live in Redis for every worker to read.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from .jobs import NAME_PATTERN, _check_json_schema


class Example(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: str = Field(min_length=1, max_length=8000)
    output: Any  # the JSON the text should give


class Template(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=NAME_PATTERN)
    description: str = Field(default="", max_length=500)
    instruction: str = Field(min_length=1, max_length=4000)
    json_schema: dict[str, Any]
    examples: list[Example] = Field(min_length=1, max_length=5)

    @field_validator("json_schema")
    @classmethod
    def _schema_ok(cls, v: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        # a stored template's schema passed the grammar check when it was added
        return _check_json_schema(v, grammar=not (info.context or {}).get("stored"))

    @model_validator(mode="after")
    def _examples_fit(self, info: ValidationInfo) -> Template:
        """A worked example that breaks the schema would teach the model to break it.

        Checked where a template is made, not where a stored one is read back
        (``context={"stored": True}``): a schema's ``pattern`` is matched by Python's ``re``,
        which a pattern like ``^(a+)+$`` can keep busy for minutes. Registering a template
        runs this check under a time limit (``protocol.store.BatchStore.add_template``)."""
        if (info.context or {}).get("stored"):
            return self
        problem = examples_problem(self)
        if problem:
            raise ValueError(problem)
        return self


def examples_problem(template: Template) -> str | None:
    """Why a template's worked examples do not fit its schema, if they do not."""
    import jsonschema

    check = jsonschema.validators.validator_for(template.json_schema)(template.json_schema)
    for i, ex in enumerate(template.examples):
        error = jsonschema.exceptions.best_match(check.iter_errors(ex.output))
        if error is not None:
            return f"example {i + 1}'s output does not fit json_schema: {error.message}"
    return None


def _builtin(**fields: Any) -> Template:
    """A built-in template, made at import without the checks of user input: its schema and
    examples are tested (tests/test_schemas.py), and no child process is started on import."""
    return Template.model_validate(fields, context={"stored": True})


_CONTACT = _builtin(
    name="contact",
    description="A person's name, role, organisation and how to reach them.",
    instruction="Extract the contact details of the person the text is about. Use null for "
    "anything the text does not say.",
    json_schema={
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "role": {"type": ["string", "null"]},
            "organization": {"type": ["string", "null"]},
            "email": {"type": ["string", "null"]},
            "phone": {"type": ["string", "null"]},
        },
        "required": ["name", "role", "organization", "email", "phone"],
        "additionalProperties": False,
    },
    examples=[
        Example(
            text="Please contact Maria Lopez, head of procurement at Brightline Foods, at "
            "maria.lopez@brightline.example or +44 20 7946 0958.",
            output={
                "name": "Maria Lopez",
                "role": "head of procurement",
                "organization": "Brightline Foods",
                "email": "maria.lopez@brightline.example",
                "phone": "+44 20 7946 0958",
            },
        ),  # fmt: skip
        Example(
            text="Thanks for the call yesterday. -- Tom Becker, Becker & Sons",
            output={
                "name": "Tom Becker",
                "role": None,
                "organization": "Becker & Sons",
                "email": None,
                "phone": None,
            },
        ),  # fmt: skip
    ],
)

_INVOICE = _builtin(
    name="invoice",
    description="Invoice number, dates, parties, line items and total.",
    instruction="Extract the invoice. Amounts are numbers without currency signs; dates are "
    "YYYY-MM-DD.",
    json_schema={
        "type": "object",
        "properties": {
            "invoice_number": {"type": "string"},
            "issue_date": {"type": "string", "format": "date"},
            "seller": {"type": "string"},
            "buyer": {"type": "string"},
            "currency": {"type": "string", "enum": ["EUR", "USD", "GBP", "other"]},
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 20,
                "items": {
                    "type": "object",
                    "properties": {
                        "description": {"type": "string"},
                        "quantity": {"type": "integer", "minimum": 1},
                        "amount": {"type": "number"},
                    },
                    "required": ["description", "quantity", "amount"],
                    "additionalProperties": False,
                },
            },
            "total": {"type": "number"},
        },
        "required": [
            "invoice_number",
            "issue_date",
            "seller",
            "buyer",
            "currency",
            "items",
            "total",
        ],
        "additionalProperties": False,
    },  # fmt: skip
    examples=[
        Example(
            text="INVOICE 2024-117, 3 March 2024. From Nordic Print AB to Lumen Studio. "
            "500 flyers: EUR 120.00. 2 posters: EUR 30.00. Total due EUR 150.00.",
            output={
                "invoice_number": "2024-117",
                "issue_date": "2024-03-03",
                "seller": "Nordic Print AB",
                "buyer": "Lumen Studio",
                "currency": "EUR",
                "items": [
                    {"description": "flyers", "quantity": 500, "amount": 120.0},
                    {"description": "posters", "quantity": 2, "amount": 30.0},
                ],
                "total": 150.0,
            },
        ),  # fmt: skip
        Example(
            text="Bill #A-9 dated 2023-11-30, Acme Tools Ltd to J. Smith: one cordless drill, "
            "$89.99. Amount payable: $89.99",
            output={
                "invoice_number": "A-9",
                "issue_date": "2023-11-30",
                "seller": "Acme Tools Ltd",
                "buyer": "J. Smith",
                "currency": "USD",
                "items": [{"description": "cordless drill", "quantity": 1, "amount": 89.99}],
                "total": 89.99,
            },
        ),  # fmt: skip
    ],
)

_EVENT = _builtin(
    name="event",
    description="What happens, when, where, and who is invited.",
    instruction="Extract the event the text announces.",
    json_schema={
        "type": "object",
        "properties": {
            "title": {"type": "string"},
            "date": {"type": "string", "format": "date"},
            "start_time": {"type": ["string", "null"]},
            "location": {"type": ["string", "null"]},
            "online": {"type": "boolean"},
            "audience": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        },
        "required": ["title", "date", "start_time", "location", "online", "audience"],
        "additionalProperties": False,
    },
    examples=[
        Example(
            text="Join us for the Spring Data Meetup on 2024-04-18 at 18:30 in Hall B of the "
            "Science Park. Open to students and engineers.",
            output={
                "title": "Spring Data Meetup",
                "date": "2024-04-18",
                "start_time": "18:30",
                "location": "Hall B of the Science Park",
                "online": False,
                "audience": ["students", "engineers"],
            },
        ),  # fmt: skip
        Example(
            text="Webinar: Tax changes for freelancers, 2 May 2024, streamed online for all "
            "members.",
            output={
                "title": "Tax changes for freelancers",
                "date": "2024-05-02",
                "start_time": None,
                "location": None,
                "online": True,
                "audience": ["members"],
            },
        ),  # fmt: skip
        Example(
            text="The annual staff picnic is on 2024-07-06 at Riverside Park.",
            output={
                "title": "annual staff picnic",
                "date": "2024-07-06",
                "start_time": None,
                "location": "Riverside Park",
                "online": False,
                "audience": ["staff"],
            },
        ),  # fmt: skip
    ],
)

BUILTIN: dict[str, Template] = {t.name: t for t in (_CONTACT, _INVOICE, _EVENT)}
