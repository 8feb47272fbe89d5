"""OpenAI-shaped chat messages -> what Hugging Face chat templates take.

* role: system, developer, user, assistant or tool. ``developer`` becomes
  ``system`` unless the template names ``developer`` itself.
* content: a string, a list of ``{"type": "text", "text": ...}`` parts (joined
  with "\\n", as vLLM does) or None (-> "").
* assistant ``tool_calls``: ``[{"id", "type": "function", "function": {"name",
  "arguments"}}]``; ``arguments`` is OpenAI's JSON string and is parsed into a
  dict, the form HF templates render with ``| tojson`` (vLLM does the same).
* tool messages: ``tool_call_id`` and optional ``name`` are passed on.
* ``tools``: OpenAI function tool schemas, passed on as they are.

Every error is a ValueError with a message fit for a 400 reply.
"""

from __future__ import annotations

import json

ROLES = ("system", "developer", "user", "assistant", "tool")


def template_messages(messages, developer_role: bool, images: list[str] | None = None) -> list[dict]:
    """Validated copies of ``messages`` in the shape chat templates expect.

    developer_role: the template knows a ``developer`` role (else it is mapped to ``system``).
    images: None = text only (an image part is a ValueError); a list = the model takes images:
    each image part (``{"type": "image", "image_hash": <hex>}``, as the gateway sends them once
    the vision service has the image) becomes ``{"type": "image"}`` in a list content (a message
    with images keeps its parts in order, text parts as ``{"type": "text", "text"}``), and its
    hash is appended to ``images``, in prompt order.
    Raises ValueError for a bad role, content, tool call or field type.
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list")
    return [_message(i, m, developer_role, images) for i, m in enumerate(messages)]


def template_tools(tools) -> list[dict] | None:
    """``tools`` checked to be a list of dicts (None or empty -> None). Raises ValueError."""
    if not tools:
        return None
    if not isinstance(tools, (list, tuple)) or not all(isinstance(t, dict) for t in tools):
        raise ValueError("tools must be a list of tool schema objects")
    return [dict(t) for t in tools]


def _message(i: int, m, developer_role: bool, images: list[str] | None = None) -> dict:
    if not isinstance(m, dict):
        raise ValueError(f"messages[{i}] must be an object")
    role = m.get("role")
    if role not in ROLES:
        raise ValueError(f"messages[{i}].role must be one of {', '.join(ROLES)}; got {role!r}")
    if role == "developer" and not developer_role:
        role = "system"
    content = m.get("content")
    if images is not None and _has_image(content):
        out = {"role": role, "content": image_content(content, f"messages[{i}].content", images)}
    else:
        out = {"role": role, "content": content_text(content, f"messages[{i}].content")}
    if m.get("tool_calls"):
        if role != "assistant":
            raise ValueError(f"messages[{i}]: only assistant messages carry tool_calls")
        out["tool_calls"] = [_tool_call(f"messages[{i}].tool_calls[{j}]", c) for j, c in enumerate(m["tool_calls"])]
    for key in ("tool_call_id", "name"):
        if m.get(key) is not None:
            if not isinstance(m[key], str):
                raise ValueError(f"messages[{i}].{key} must be a string")
            out[key] = m[key]
    return out


def content_text(content, where: str = "content") -> str:
    """Message content as one string. Raises ValueError for anything but text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"{where}: only text content parts are supported")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ValueError(f"{where} must be a string or a list of text parts")


def _has_image(content) -> bool:
    return isinstance(content, (list, tuple)) and any(isinstance(p, dict) and p.get("type") == "image"
                                                      for p in content)


def image_content(content, where: str, images: list[str]) -> list[dict]:
    """A list content with image parts -> template parts (text and ``{"type": "image"}``); each
    image's hash appended to ``images``. Raises ValueError for another part or a bad hash."""
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            out.append({"type": "text", "text": part["text"]})
        elif kind == "image":
            h = part.get("image_hash")
            if not isinstance(h, str) or len(h) != 64 or any(c not in "0123456789abcdef" for c in h):
                raise ValueError(f"{where}[{j}]: an image part needs the vision service's image_hash")
            out.append({"type": "image"})
            images.append(h)
        else:
            raise ValueError(f"{where}[{j}]: only text and image content parts are supported")
    return out


def _tool_call(where: str, call) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError(f"{where} must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}")
    args = fn.get("arguments")
    if args is None or args == "":
        args = {}
    elif isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}.function.arguments is not valid JSON: {e.msg}") from None
    if not isinstance(args, dict):
        raise ValueError(f"{where}.function.arguments must be a JSON object")
    out = {"type": call.get("type") or "function", "function": {"name": fn["name"], "arguments": args}}
    if call.get("id") is not None:
        if not isinstance(call["id"], str):
            raise ValueError(f"{where}.id must be a string")
        out["id"] = call["id"]
    return out


TOOLS_PREAMBLE = (
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>"
)


def inline_tools(msgs: list[dict], tools: list[dict] | None) -> list[dict]:
    """For a template that ignores ``tools`` (and tool calls): write them into the messages as
    text, in the Hermes / Qwen2.5 format the gateway's tool-call parser reads.

    The tool schemas become a system preamble (merged into the first system message);
    an assistant turn's ``tool_calls`` become ``<tool_call>`` JSON after its content; a
    tool result stays a ``tool`` message. Without this, such a template (SmolLM2's)
    drops the tools silently and the model never learns they exist.
    """
    out = [dict(m) for m in msgs]
    if tools:
        preamble = TOOLS_PREAMBLE.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] == "system":
            out[0]["content"] = out[0]["content"] + "\n\n" + preamble if out[0]["content"] else preamble
        else:
            out.insert(0, {"role": "system", "content": preamble})
    for m in out:
        calls = m.pop("tool_calls", None)
        if calls:
            text = "".join(f"<tool_call>\n{json.dumps({'name': c['function']['name'], 'arguments': c['function']['arguments']}, ensure_ascii=False)}\n</tool_call>"  # noqa: E501
                           for c in calls)
            m["content"] = (m["content"] + "\n" if m["content"] else "") + text
    return out
