"""A small chat template that renders tools, assistant tool calls and tool results, for the
tool-calling tests (stories260k has no template of its own)."""

TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}tools:{% for t in tools %} {{ t.function.name }}"
    "{{ t.function.parameters | tojson }}{% endfor %}{{ '\\n' }}{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}assistant calls:"
    "{% for c in m.tool_calls %} {{ c.function.name }}{{ c.function.arguments | tojson }}"
    "{% endfor %}"
    "{%- elif m.role == 'tool' %}tool[{{ m.tool_call_id }}]: {{ m.content }}"
    "{%- else %}{{ m.role }}: {{ m.content }}{%- endif %}{{ '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)

# For the live stories260k server (char-level tokens, 256-token context): tools by name only.
SHORT_TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}tools:{% for t in tools %} {{ t.function.name }}{% endfor %}{{ '\\n' }}"
    "{% endif %}"
    "{%- for m in messages %}{{ m.role }}: {{ m.content }}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {
                "zone": {"type": "string", "pattern": "^[A-Z][a-z]{2,8}/[A-Z][a-z]{2,8}$"}
            },
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
