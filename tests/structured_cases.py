"""Fifty JSON Schemas over ten realistic texts, for the structured-output tests and benchmark.

Each domain gives five schemas, one per shape: flat scalars; a nested object with an enum;
bounded arrays; nullable, optional and bounded-number fields; ``$defs``/``$ref`` with string
formats. Together they cover what issue 3 lists: nested objects, arrays with bounds, enums,
numbers, integers, booleans, nullable and optional fields, ``$ref``/``$defs``, string formats.
"""

from __future__ import annotations

from typing import Any

# name, text, scalar fields (key, JSON type), enum (key, values), list field (key, item type),
# formatted field (key, format)
DOMAINS: list[dict[str, Any]] = [
    dict(
        name="person",
        text="Dr. Alice Wong, 34, is a cardiologist at St. Mary's Hospital in Boston. You can "
        "reach her at alice.wong@stmarys.example. She joined the hospital on 2019-06-01 and "
        "speaks English, Cantonese and French. She is not accepting new patients.",
        scalars=[("name", "string"), ("age", "integer"), ("city", "string"),
                 ("accepting_patients", "boolean")],
        enum=("specialty", ["cardiology", "neurology", "oncology", "pediatrics", "other"]),
        items=("languages", "string"),
        formatted=("email", "email"),
    ),
    dict(
        name="invoice",
        text="Invoice INV-2041 from Harbor Supplies Ltd to Greenleaf Cafe, issued 2024-02-14. "
        "12 bags of coffee beans at 18.50 each, 4 boxes of paper cups at 9.75 each. Total "
        "261.00 EUR, due within 30 days. Already paid: no.",
        scalars=[("invoice_number", "string"), ("total", "number"), ("due_days", "integer"),
                 ("paid", "boolean")],
        enum=("currency", ["EUR", "USD", "GBP"]),
        items=("products", "string"),
        formatted=("issue_date", "date"),
    ),
    dict(
        name="event",
        text="The Riverside Jazz Festival returns on 2024-08-23 at Millbrook Park, starting at "
        "17:00. Tickets cost 35 dollars; children under 12 enter free. Headliners are the "
        "Nina Cole Quartet and Brass Avenue. The event is outdoors and dogs are welcome.",
        scalars=[("title", "string"), ("ticket_price", "number"), ("free_under_age", "integer"),
                 ("outdoors", "boolean")],
        enum=("genre", ["jazz", "rock", "classical", "pop", "folk"]),
        items=("headliners", "string"),
        formatted=("date", "date"),
    ),
    dict(
        name="review",
        text="I bought the AeroBlend 500 blender three weeks ago. It crushes ice easily and is "
        "quieter than my old one, but the lid leaks a little. Price was $79.99. I'd give it 4 "
        "out of 5 stars and would recommend it to a friend.",
        scalars=[("product", "string"), ("price", "number"), ("stars", "integer"),
                 ("recommends", "boolean")],
        enum=("sentiment", ["positive", "mixed", "negative"]),
        items=("complaints", "string"),
        formatted=("product_page", "uri"),
    ),
    dict(
        name="weather",
        text="Forecast for Oslo on 2024-01-15: snow showers in the morning, clearing by "
        "afternoon. High of -3 degrees Celsius, low of -9. Wind from the north at 25 km/h. "
        "Chance of precipitation 70 percent. Roads may be icy.",
        scalars=[("city", "string"), ("high_c", "number"), ("precipitation_pct", "integer"),
                 ("icy_roads", "boolean")],
        enum=("wind_direction", ["north", "south", "east", "west"]),
        items=("conditions", "string"),
        formatted=("date", "date"),
    ),
    dict(
        name="recipe",
        text="Simple tomato soup for 4 people: sauté one onion and two garlic cloves in olive "
        "oil, add 800 g of canned tomatoes and 500 ml of stock, simmer for 20 minutes, then "
        "blend. Vegetarian. Preparation takes 30 minutes in total.",
        scalars=[("dish", "string"), ("servings", "integer"), ("minutes", "number"),
                 ("vegetarian", "boolean")],
        enum=("course", ["starter", "main", "dessert", "soup"]),
        items=("ingredients", "string"),
        formatted=("source", "uri"),
    ),
    dict(
        name="flight",
        text="Booking confirmed: passenger Marco Rossi, flight AZ 610 from Rome to New York JFK "
        "on 2024-05-03, departing 10:25. Seat 14C, economy class, one checked bag. Booking "
        "reference 7f3c2a1e-9b4d-4c8e-a2f1-5d6e7f8a9b0c. Total fare 642.30 euros.",
        scalars=[("passenger", "string"), ("fare", "number"), ("checked_bags", "integer"),
                 ("window_seat", "boolean")],
        enum=("cabin", ["economy", "premium", "business", "first"]),
        items=("cities", "string"),
        formatted=("booking_id", "uuid"),
    ),
    dict(
        name="job",
        text="Northwind Analytics is hiring a Senior Data Engineer in Lisbon (hybrid, 3 days in "
        "office). Requirements: 5+ years of Python, SQL and Spark experience. Salary 65,000 "
        "to 80,000 EUR per year. Apply by 2024-03-31 at careers@northwind.example.",
        scalars=[("title", "string"), ("min_years", "integer"), ("max_salary", "number"),
                 ("remote_possible", "boolean")],
        enum=("seniority", ["junior", "mid", "senior", "lead"]),
        items=("skills", "string"),
        formatted=("contact", "email"),
    ),
    dict(
        name="listing",
        text="For sale: bright two-bedroom apartment on the 3rd floor at 12 Elm Street, "
        "Springfield. 78 square meters, renovated kitchen, balcony facing south, no elevator. "
        "Asking price 240,000 dollars. Viewing on 2024-04-06.",
        scalars=[("address", "string"), ("area_m2", "number"), ("bedrooms", "integer"),
                 ("has_elevator", "boolean")],
        enum=("kind", ["apartment", "house", "studio", "land"]),
        items=("features", "string"),
        formatted=("viewing", "date"),
    ),
    dict(
        name="book",
        text="'The Silent Orchard' by Hannah Moretti, published 2021 by Lantern Press, is a "
        "382-page historical novel set in 1920s Tuscany. It won the Regional Fiction Prize. "
        "Available as hardcover and e-book; rated 4.3 by readers.",
        scalars=[("title", "string"), ("pages", "integer"), ("rating", "number"),
                 ("won_award", "boolean")],
        enum=("genre", ["historical", "mystery", "romance", "science fiction", "other"]),
        items=("formats", "string"),
        formatted=("published", "date"),
    ),
]  # fmt: skip


def _flat(d: dict[str, Any]) -> dict[str, Any]:
    props = {k: {"type": t} for k, t in d["scalars"]}
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False}  # fmt: skip


def _nested(d: dict[str, Any]) -> dict[str, Any]:
    (k1, t1), (k2, t2), (k3, t3), _ = d["scalars"]
    ek, values = d["enum"]
    inner = {"type": "object", "properties": {k1: {"type": t1}, k2: {"type": t2}},
             "required": [k1, k2], "additionalProperties": False}  # fmt: skip
    return {
        "type": "object",
        "properties": {"subject": inner, ek: {"type": "string", "enum": values},
                       "details": {"type": "object", "properties": {k3: {"type": t3}},
                                   "required": [k3], "additionalProperties": False}},
        "required": ["subject", ek, "details"],
        "additionalProperties": False,
    }  # fmt: skip


def _arrays(d: dict[str, Any]) -> dict[str, Any]:
    lk, it = d["items"]
    (k1, t1), *_ = d["scalars"]
    return {
        "type": "object",
        "properties": {
            k1: {"type": t1},
            lk: {"type": "array", "items": {"type": it, "maxLength": 60}, "minItems": 1,
                 "maxItems": 4},
            "facts": {"type": "array", "maxItems": 3, "items": {
                "type": "object", "properties": {"fact": {"type": "string", "maxLength": 80},
                                                 "certain": {"type": "boolean"}},
                "required": ["fact", "certain"], "additionalProperties": False}},
        },
        "required": [k1, lk, "facts"],
        "additionalProperties": False,
    }  # fmt: skip


def _nullable(d: dict[str, Any]) -> dict[str, Any]:
    (k1, t1), (k2, t2), (k3, t3), (k4, t4) = d["scalars"]
    num = {"type": t2, "minimum": 0, "maximum": 1_000_000}
    return {
        "type": "object",
        "properties": {k1: {"type": [t1, "null"]}, k2: num, k3: {"type": [t3, "null"]},
                       k4: {"type": t4}, "notes": {"type": ["string", "null"], "maxLength": 120}},
        "required": [k1, k2, k3],  # k4 and notes are optional
        "additionalProperties": False,
    }  # fmt: skip


def _refs(d: dict[str, Any]) -> dict[str, Any]:
    (k1, t1), *_ = d["scalars"]
    fk, fmt = d["formatted"]
    ek, values = d["enum"]
    return {
        "$defs": {
            "label": {"type": "string", "enum": values},
            "entry": {"type": "object", "properties": {k1: {"type": t1},
                                                       fk: {"type": "string", "format": fmt}},
                      "required": [k1, fk], "additionalProperties": False},
        },
        "type": "object",
        "properties": {"entry": {"$ref": "#/$defs/entry"}, ek: {"$ref": "#/$defs/label"},
                       "checked_at": {"type": "string", "format": "date-time"}},
        "required": ["entry", ek],
        "additionalProperties": False,
    }  # fmt: skip


SHAPES = {"flat": _flat, "nested": _nested, "arrays": _arrays, "nullable": _nullable,
          "refs": _refs}  # fmt: skip


def cases() -> list[dict[str, Any]]:
    """Fifty extract jobs: ``id`` is DOMAIN-SHAPE."""
    return [
        {"id": f"{d['name']}-{shape}", "type": "extract", "text": d["text"],
         "json_schema": make(d)}
        for d in DOMAINS
        for shape, make in SHAPES.items()
    ]  # fmt: skip
