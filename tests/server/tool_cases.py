"""The weather tool the API tests call, in each dialect's shape (the same function, so its calls render
the same prompt through every route)."""

WEATHER_FUNCTION = {
    "name": "get_weather",
    "description": "Weather of a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Oslo"]}, "metric": {"type": "boolean"}},
        "required": ["city", "metric"],
        "additionalProperties": False,
    },
}
CHAT_WEATHER = {"type": "function", "function": WEATHER_FUNCTION}  # chat completions
RESPONSES_WEATHER = {"type": "function", **WEATHER_FUNCTION}  # the Responses API
MESSAGES_WEATHER = {  # Anthropic's Messages API
    "name": WEATHER_FUNCTION["name"],
    "description": WEATHER_FUNCTION["description"],
    "input_schema": WEATHER_FUNCTION["parameters"],
}
