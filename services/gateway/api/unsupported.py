"""Request fields an API defines that this server does not implement: declared, then refused.

Every field of a request model is either honoured or refused; none is ignored. A field for a
feature this server does not have (audio output, reasoning effort, background runs...) is declared
with ``refused(why, takes)``: any value is a 400 naming the field (``param``; the message starts
with the field's path, then ``why``) unless ``takes(value)`` says the value asks for what the server
does anyway (``service_tier: "auto"``, ``store: false`` on chat, ``truncation: "disabled"``). A
JSON ``null`` is the field left out. The top-level request models forbid fields they do not
declare (a 400 naming the field, as OpenAI's and Anthropic's APIs answer an unknown argument), so a
field a client adds cannot pass unseen either. docs/api_fields.md lists each API's fields.

The refusal is a validation error (``errors.validation_error`` renders it), raised while the body
is parsed, so nothing is tokenized or dispatched for a refused request.
"""

from __future__ import annotations

from typing import Annotated, Any, Callable

from pydantic import AfterValidator
from pydantic_core import PydanticCustomError


class Refused:
    """The mark ``refused`` leaves in a field's metadata (so a test can tell refused fields apart)."""

    def __init__(self, why: str):
        self.why = why


def refused(why: str, takes: Callable[[Any], bool] | None = None):
    """The annotation of a declared field this server does not implement: any JSON value but null
    fails validation with ``why`` (no braces: it is a message template), unless ``takes(value)``."""

    def check(value):
        if value is None or (takes is not None and takes(value)):
            return value
        raise PydanticCustomError("unsupported", why)

    return Annotated[Any, AfterValidator(check), Refused(why)]


# --- the values several APIs take --------------------------------------------------------------

OPENAI_TIERS = ("auto", "default")


def openai_tier(value) -> bool:
    """``service_tier``: one tier serves every request, the project's default one."""
    return value in OPENAI_TIERS


def implicit_cache(value) -> bool:
    """``prompt_cache_options``: implicit caching (the prefix cache caches every prompt's blocks by
    itself), with any ``ttl`` hint; not ``mode: "explicit"`` (breakpoints), ``prewarm`` (no output)
    or ``comparison_response_id`` (cache diagnostics)."""
    return (isinstance(value, dict) and set(value) <= {"mode", "ttl", "prewarm"}
            and value.get("mode", "implicit") == "implicit" and not value.get("prewarm"))


def no_reasoning(value) -> bool:
    """Responses ``reasoning``: nothing asked of it but ``effort: "none"``."""
    return (isinstance(value, dict) and value.get("effort") in (None, "none")
            and all(v is None for k, v in value.items() if k != "effort"))


def no_obfuscation(value) -> bool:
    """``stream_options`` of Responses: no ``include_obfuscation``, or false."""
    return isinstance(value, dict) and set(value) <= {"include_obfuscation"} and value.get(
        "include_obfuscation") in (None, False)


TIER = "only one service tier: 'auto' or 'default'"
REASONING = "reasoning is not supported (the model gives no reasoning); only 'none'"
CACHE_OPTIONS = ("only implicit prompt caching (every prompt's prefix is cached automatically); explicit "
                 "breakpoints, prewarm and cache diagnostics are not supported")
MODERATION = "moderation is not supported"
VERBOSITY = "verbosity is not supported"
OBFUSCATION = "stream obfuscation is not supported; only false"
IMAGE_DETAIL = ("image detail levels are not supported (the model's image processor has one resolution, which is "
                "what 'auto' picks); only 'auto'")
