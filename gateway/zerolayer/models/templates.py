"""Tools and tool calls as a chat template sees them, for models with and without tool training.

- ``Tool``: a function definition (name, description, JSON Schema parameters).
- ``template_supports_tools``: whether a template renders a ``tools`` variable itself;
  ``template_tools`` / ``tools_of_template``: the definitions as that variable takes them.
- ``system_prompt``: the generic rendering, in the system turn, for a template without tools.
- ``plain_history``: calls and results as Hermes text, for a template without tools.
- ``merge_system``: the conversation without system messages, for a template that refuses them.

Parsing the model's output back into calls is the HTTP door's (``zerolayer.http.tools``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]


def template_supports_tools(template_source: str | None) -> bool:
    """Whether a chat template renders a ``tools`` variable itself."""
    return bool(template_source) and "tools" in str(template_source)


def system_prompt(tools: list[Tool]) -> str:
    """The generic rendering: tool signatures and the Hermes call format, for the system turn."""
    lines = [
        "You may call one or more functions to assist with the user query.",
        "Function signatures, in JSON:",
        "<tools>",
    ]
    for t in tools:
        spec = {"name": t.name, "description": t.description, "parameters": t.parameters}
        lines.append(json.dumps({"type": "function", "function": spec}))
    lines += [
        "</tools>",
        "For each call, answer with a JSON object holding the function name and arguments "
        f"between {HERMES_OPEN} and {HERMES_CLOSE} tags:",
        f'{HERMES_OPEN}{{"name": <function-name>, "arguments": <args-json-object>}}{HERMES_CLOSE}',
    ]
    return "\n".join(lines)


# -- history -----------------------------------------------------------------------------------
#
# A chat's messages, door-neutral (what both HTTP doors parse their history into, and what the
# chat template renders), in Hugging Face's chat-template convention: ``{"role", "content"}``,
# plus for an assistant's calls ``"tool_calls": [{"id", "type": "function", "function":
# {"name", "arguments": {...}}}]`` (arguments as an object: templates apply ``tojson``), for a
# tool's result ``{"role": "tool", "content", "tool_call_id", "name"}``, and a message's
# optional ``"name"``.


def template_tools(tools: list[Tool]) -> list[dict[str, Any]]:
    """The definitions as a chat template's ``tools`` variable takes them."""
    return [
        {
            "type": "function",
            "function": {"name": t.name, "description": t.description, "parameters": t.parameters},
        }
        for t in tools
    ]


def tools_of_template(value: list[dict[str, Any]]) -> list[Tool]:
    """``template_tools`` read back (the input processor renders from the request's copy)."""
    return [
        Tool(f["function"]["name"], f["function"]["description"], f["function"]["parameters"])
        for f in value
    ]


def plain_history(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The history for a chat template that knows no tools: an assistant's calls as Hermes
    ``<tool_call>`` text after its content, tool results as a user turn of ``<tool_response>``
    blocks (consecutive results in one turn), as Qwen's and Hermes' templates write them."""
    out: list[dict[str, str]] = []
    results = False  # the last turn out holds tool results
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        was_results, results = results, role == "tool"
        if role == "assistant" and m.get("tool_calls"):
            parts = [content] if content else []
            for call in m["tool_calls"]:
                fn = call["function"]
                body = json.dumps({"name": fn["name"], "arguments": fn["arguments"]})
                parts.append(f"{HERMES_OPEN}\n{body}\n{HERMES_CLOSE}")
            out.append({"role": "assistant", "content": "\n".join(parts)})
        elif role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if was_results:
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
        else:
            out.append({"role": role, "content": content})
    return out


def merge_system(messages: list[dict[str, Any]], system: str | None) -> list[dict[str, Any]]:
    """The conversation without system messages, for a chat template that refused them: each
    system message's text (``system``, the leading one, first) is prefixed to the next user
    message, a blank line between; with no user message after it, appended to the previous
    one; with neither (no user message at all), they become one user message at the end.
    Messages are copied, never changed in place (docs/http.md, "System messages")."""
    out: list[dict[str, Any]] = []
    waiting: list[str] = [system] if system else []  # system texts for the next user message
    for m in messages:
        if m["role"] == "system":
            waiting.append(m.get("content") or "")
        elif m["role"] == "user" and waiting:
            out.append({**m, "content": "\n\n".join([*waiting, m.get("content") or ""])})
            waiting = []
        else:
            out.append(m)
    if waiting:
        last = next((i for i in range(len(out) - 1, -1, -1) if out[i]["role"] == "user"), None)
        if last is None:
            out.append({"role": "user", "content": "\n\n".join(waiting)})
        else:
            joined = "\n\n".join([out[last].get("content") or "", *waiting])
            out[last] = {**out[last], "content": joined}
    return out
