"""Tokenizer service (the "recipe"): chat template rendering and encoding.

Lifecycle of a request in this service:
  1. ``deepinfer.tokenizer.encode_chat`` (queue group ``tokenizer``): an
     ``EncodeChatRequest`` arrives from the gateway.
  2. The chat template is rendered and encoded on a worker thread (so the
     event loop keeps serving other requests).
  3. The reply is an ``EncodeChatReply`` with the prompt's token ids, or an
     ``ErrorReply(kind="bad_request")`` when the messages cannot be rendered.

Control-token-safe segment encoding (TECHNIQUES §1) arrives with issue #5;
today the template is rendered and tokenized by ``transformers``.
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor

from deepinfer.mesh import Service, run_service
from deepinfer.mesh.args import service_parser
from deepinfer.models.convert import resolve_model
from deepinfer.protocol import EncodeChatReply, EncodeChatRequest, ErrorReply, subjects

ROLES = {"system", "developer", "user", "assistant", "tool"}


def _text(content) -> str:
    """Message content as text: a string, or a list of ``{"type": "text", "text": ...}`` parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    if content is None:
        return ""
    raise ValueError("message content must be a string or a list of text parts")


class TokenizerService(Service):
    role = "tokenizer"

    def __init__(self, nats_url: str, model_dir: str, worker_id: str | None = None, threads: int = 2):
        super().__init__(nats_url, worker_id)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="tokenize")

    async def setup(self) -> None:
        await self.mesh.subscribe(subjects.TOKENIZER_ENCODE_CHAT, self.on_encode_chat,
                                  queue=subjects.TOKENIZER_GROUP, span_name="tokenizer.encode_chat")

    async def on_encode_chat(self, req: EncodeChatRequest):
        try:
            ids = await asyncio.get_running_loop().run_in_executor(self.pool, self.encode_chat, req)
        except ValueError as e:
            return ErrorReply(error=str(e), kind="bad_request")
        return EncodeChatReply(request_id=req.request_id, token_ids=ids)

    def encode_chat(self, req: EncodeChatRequest) -> list[int]:
        """Render and encode; raises ValueError for messages the template cannot take."""
        messages = []
        for m in req.messages:
            if not isinstance(m, dict) or m.get("role") not in ROLES:
                raise ValueError(f"bad message role: {m.get('role') if isinstance(m, dict) else m!r}")
            messages.append({"role": m["role"], "content": _text(m.get("content"))})
        try:
            ids = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=req.add_generation_prompt, tokenize=True, return_dict=False
            )
        except Exception as e:  # jinja raises TemplateError for unsupported conversations
            raise ValueError(f"chat template failed: {e}") from e
        return list(ids)

    async def teardown(self) -> None:
        self.pool.shutdown(wait=False)


def main(argv: list[str] | None = None) -> None:
    p = service_parser("tokenizer", "Chat template rendering and encoding")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    run_service(TokenizerService(args.nats, str(resolve_model(args.model)), args.worker_id, args.threads), args.log_level)
