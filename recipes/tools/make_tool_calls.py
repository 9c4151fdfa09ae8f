"""Tool-calling conversations for SFT: a user asks, the assistant calls a function, the tool answers,
the assistant replies. Rows are in the OpenAI form (``content: null``, ``arguments`` a JSON string,
9-character call ids that Mistral's template also accepts) with the tool definitions in a ``tools``
column as a JSON string (schemas differ in their keys from row to row).

    python recipes/tools/make_tool_calls.py      # writes recipes/tools/data/tool_calls.jsonl

>>> row = conversation(random.Random(0), 0)
>>> [m["role"] for m in row["messages"]]
['system', 'user', 'assistant', 'tool', 'assistant']
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
CITIES = ["Paris", "Rome", "Oslo", "Lima", "Tokyo", "Cairo", "Quito", "Dakar", "Hanoi", "Perth"]
SKIES = ["sunny", "cloudy", "rainy", "windy", "snowy"]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city name."}},
            "required": ["city"],
        },
    },
}
MULTIPLY = {
    "type": "function",
    "function": {
        "name": "multiply",
        "description": "The product of two numbers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
            "required": ["a", "b"],
        },
    },
}


def conversation(rng: random.Random, index: int) -> dict[str, str | list]:
    """One row: a weather or a multiplication question answered through a tool call."""
    call_id = f"call{index:05d}"
    if rng.random() < 0.5:
        city, temp, sky = rng.choice(CITIES), rng.randint(-5, 35), rng.choice(SKIES)
        question, name, args = f"What is the weather like in {city}?", "get_weather", {"city": city}
        output, reply = (
            json.dumps({"temperature_c": temp, "sky": sky}),
            f"It is {temp} C and {sky} in {city}.",
        )
    else:
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        question, name, args = f"What is {a} times {b}?", "multiply", {"a": a, "b": b}
        output, reply = str(a * b), f"{a} times {b} is {a * b}."
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
    messages = [
        {"role": "system", "content": "You are a helpful assistant. Use the tools when they help."},
        {"role": "user", "content": question},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": output},
        {"role": "assistant", "content": reply},
    ]
    return {"messages": messages, "tools": json.dumps([WEATHER, MULTIPLY])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=HERE / "data" / "tool_calls.jsonl")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        for i in range(args.rows):
            f.write(json.dumps(conversation(rng, i)) + "\n")
    print(f"wrote {args.rows} conversations to {args.out}")


if __name__ == "__main__":
    main()
