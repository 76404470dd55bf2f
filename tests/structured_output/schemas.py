"""JSON schemas the structured-output tests constrain stories260k with.

Each one's smallest instances fit in a few dozen tokens of compact JSON, so a request with
``max_tokens`` of ``MAX_TOKENS`` finishes with ``stop``: strings have a ``maxLength`` (or an
enum, pattern or format), arrays a ``maxItems`` and integers bounds (the tiny model would
otherwise write digits or letters until the token limit).

Formats: ``uuid`` is exact in xgrammar. ``date`` and ``ipv4`` are not in this list: xgrammar's
grammars for them are looser than ``jsonschema``'s checks (``7000-02-30``; ``1.92.2.000`` with
its leading zeros), so ``test_date_format_has_the_date_shape`` checks the date's shape alone and
an IPv4 pattern stands in for the format. ``email`` and ``time`` are
left out because xgrammar ignores ``maxLength`` beside a format and the tiny model never ends
the string.
"""

STR = {"type": "string", "maxLength": 5}
INT = {"type": "integer", "minimum": 0, "maximum": 99}

SCHEMAS: list[dict] = [
    # scalars
    {"type": "boolean"},
    {"type": "null"},
    INT,
    {"type": "integer", "minimum": -20, "maximum": -3},
    {"type": "integer", "exclusiveMinimum": 5, "exclusiveMaximum": 9},
    STR,
    {"type": "string", "minLength": 2, "maxLength": 4},
    {"type": "string", "enum": ["red", "green", "blue"]},
    {"const": "fixed"},
    {"enum": [1, "two", None, True]},
    {"type": "string", "pattern": "^[a-z]{2,4}$"},
    {"type": "string", "pattern": "^\\d{3}-\\d{2}$"},
    {"type": "string", "pattern": "^[0-2]\\d:[0-5]\\d$"},
    {"type": "array", "items": {"type": "string", "format": "uuid"}, "maxItems": 1},
    {"type": "string", "format": "uuid"},
    {
        "type": "string",
        "pattern": "^(25[0-5]|2[0-4]\\d|1\\d\\d|[1-9]?\\d)(\\.(25[0-5]|2[0-4]\\d|1\\d\\d|[1-9]?\\d)){3}$",
    },
    # objects
    {"type": "object", "properties": {"a": INT}, "required": ["a"]},
    {"type": "object", "properties": {"name": STR, "age": INT}, "required": ["name", "age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"v": {"type": "null"}}, "required": ["v"]},
    {
        "type": "object",
        "properties": {"color": {"enum": ["red", "blue"]}, "n": INT},
        "required": ["color", "n"],
    },
    {"type": "object", "properties": {"a": INT, "b": STR}, "required": ["a"]},
    {"type": "object", "properties": {}, "additionalProperties": False},
    {
        "type": "object",
        "properties": {"d": {"type": "string", "pattern": "^\\d{4}-\\d{2}-\\d{2}$"}},
        "required": ["d"],
    },
    {
        "type": "object",
        "properties": {"id": {"type": "string", "format": "uuid"}},
        "required": ["id"],
    },
    {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"}},
        "required": ["code"],
    },
    # arrays
    {"type": "array", "items": INT, "maxItems": 3},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2},
    {"type": "array", "items": STR, "minItems": 1, "maxItems": 2},
    {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 3, "maxItems": 4},
    {"type": "array", "prefixItems": [INT, {"type": "boolean"}], "items": False},
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": STR, "maxItems": 2}},
        "required": ["tags"],
    },
    # nesting
    {
        "type": "object",
        "properties": {
            "p": {"type": "object", "properties": {"x": INT, "y": INT}, "required": ["x", "y"]}
        },
        "required": ["p"],
    },
    {
        "type": "array",
        "items": {"type": "object", "properties": {"k": INT}, "required": ["k"]},
        "minItems": 1,
        "maxItems": 2,
    },
    {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {
                    "b": {"type": "object", "properties": {"c": INT}, "required": ["c"]}
                },
                "required": ["b"],
            }
        },
        "required": ["a"],
    },
    {
        "type": "object",
        "properties": {
            "m": {
                "type": "array",
                "items": {"type": "array", "items": INT, "maxItems": 2},
                "maxItems": 2,
            }
        },
        "required": ["m"],
    },
    # $ref / $defs
    {
        "$defs": {"pt": {"type": "object", "properties": {"x": INT}, "required": ["x"]}},
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}},
        "required": ["a", "b"],
    },
    {
        "$defs": {"c": {"enum": ["on", "off"]}},
        "type": "array",
        "items": {"$ref": "#/$defs/c"},
        "minItems": 1,
        "maxItems": 3,
    },
    {
        "definitions": {"n": INT},
        "type": "object",
        "properties": {"v": {"$ref": "#/definitions/n"}},
        "required": ["v"],
    },
    {
        "$defs": {
            "leaf": {"type": "object", "properties": {"s": STR}, "required": ["s"]},
            "node": {
                "type": "object",
                "properties": {"leaf": {"$ref": "#/$defs/leaf"}},
                "required": ["leaf"],
            },
        },
        "$ref": "#/$defs/node",
    },
    # anyOf / oneOf / type unions
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "boolean"}]},
    {"anyOf": [{"type": "null"}, STR]},
    {"type": ["integer", "null"], "minimum": 0, "maximum": 9},
    {
        "type": "object",
        "properties": {"v": {"anyOf": [INT, {"enum": ["none"]}]}},
        "required": ["v"],
    },
    {
        "oneOf": [
            {"type": "object", "properties": {"kind": {"const": "a"}}, "required": ["kind"]},
            {
                "type": "object",
                "properties": {"kind": {"const": "b"}, "n": INT},
                "required": ["kind", "n"],
            },
        ]
    },
    # numbers with bounds
    {"type": "number", "minimum": 0, "maximum": 10},
    {
        "type": "object",
        "properties": {"price": {"type": "number", "minimum": 0, "maximum": 100}},
        "required": ["price"],
    },
    # mixed records
    {
        "type": "object",
        "properties": {
            "name": STR,
            "id": {"type": "string", "format": "uuid"},
        },
        "required": ["name"],
    },
    {
        "type": "object",
        "properties": {
            "title": STR,
            "done": {"type": "boolean"},
            "priority": {"enum": ["low", "high"]},
        },
        "required": ["title", "done", "priority"],
    },
    {
        "type": "object",
        "properties": {
            "when": {"type": "string", "pattern": "^\\d{4}-\\d{2}-\\d{2}$"},
            "count": INT,
        },
        "required": ["when", "count"],
    },
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": INT,
                    "roles": {"type": "array", "items": {"enum": ["r", "w"]}, "maxItems": 2},
                },
                "required": ["id", "roles"],
            }
        },
        "required": ["user"],
    },
    {
        "type": "object",
        "properties": {"a": {"type": "boolean"}, "b": {"type": "null"}, "c": {"const": 3}},
        "required": ["a", "b", "c"],
    },
    {
        "type": "object",
        "properties": {
            "xs": {
                "type": "array",
                "items": {"type": "number", "minimum": 0, "maximum": 1},
                "maxItems": 2,
            }
        },
        "required": ["xs"],
    },
    {
        "type": "object",
        "properties": {"s": {"type": "string", "enum": ['a"b', "c\\d", "é"]}},
        "required": ["s"],
    },
]
