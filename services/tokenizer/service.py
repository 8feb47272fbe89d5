"""Tokenizer service: chat template rendering and control-token-safe encoding.

Lifecycle of a request in this service:
  1. ``deepinfer.tokenizer.encode_chat`` (queue group ``tokenizer``: any
     replica answers): an ``EncodeChatRequest`` arrives from the gateway.
  2. It waits for one of ``--threads`` worker threads (the event loop keeps
     receiving meanwhile); there ``deepinfer.recipe.ChatRecipe`` renders the
     model's chat template and encodes it, control tokens only from the
     template. ``tokenizers`` releases the GIL and encodes a
     request's text segments in parallel (Rust threads).
  3. The reply is an ``EncodeChatReply`` with the prompt's token ids (vision-language models:
     each image part rendered by the template as the image token, expanded to the model's
     tokens per image, and each image's (offset, length, content hash)), or an
     ``ErrorReply(kind="bad_request")`` (the gateway's 400) when the messages
     are malformed, the template refuses them, or text contains the request's
     placeholder nonce.

Scaling: run more replicas (they share the queue group); benchmark:
``benchmarks/bench_tokenizer.py``.
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor

from opentelemetry import trace

from deepinfer.mesh import Service, run_service
from deepinfer.mesh.args import service_parser
from deepinfer.models.convert import resolve_model
from deepinfer.protocol import EncodeChatReply, EncodeChatRequest, ErrorReply, subjects
from deepinfer.recipe import ChatRecipe
from deepinfer.telemetry import get_logger

log = get_logger(__name__)


class TokenizerService(Service):
    role = "tokenizer"

    def __init__(self, nats_url: str, model_dir: str, worker_id: str | None = None, threads: int = 2,
                 chunk_chars: int = 8192):
        super().__init__(nats_url, worker_id)
        self.recipe = ChatRecipe.from_pretrained(model_dir, chunk_chars=chunk_chars)
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="tokenize")

    async def setup(self) -> None:
        await self.mesh.subscribe(subjects.TOKENIZER_ENCODE_CHAT, self.on_encode_chat,
                                  queue=subjects.TOKENIZER_GROUP, span_name="tokenizer.encode_chat")

    async def on_encode_chat(self, req: EncodeChatRequest):
        try:
            ids, images = await asyncio.get_running_loop().run_in_executor(self.pool, self.encode_chat, req)
        except ValueError as e:
            return ErrorReply(error=str(e), kind="bad_request")
        trace.get_current_span().set_attribute("gen_ai.usage.input_tokens", len(ids))
        log.info("tokenized", messages=len(req.messages), prompt_tokens=len(ids), images=len(images))
        return EncodeChatReply(request_id=req.request_id, token_ids=ids, images=[list(i) for i in images])

    def encode_chat(self, req: EncodeChatRequest) -> tuple[list[int], list[tuple[int, int, str]]]:
        """The prompt's ids and its images' (offset, length, hash) (none for a text-only model);
        raises ValueError for messages the recipe or the template refuses."""
        return self.recipe.encode_chat_images(req.messages, req.tools, req.add_generation_prompt)

    async def teardown(self) -> None:
        self.pool.shutdown(wait=False)


def main(argv: list[str] | None = None) -> None:
    p = service_parser("tokenizer", "Chat template rendering and control-token-safe encoding")
    p.add_argument("--threads", type=int, default=2, help="requests encoded at once")
    p.add_argument("--chunk-chars", type=int, default=8192,
                   help="cut longer text segments into pieces of about this many characters, encoded in parallel "
                        "(0 = never)")
    p.add_argument("--no-parallel", dest="parallel", action="store_false",
                   help="encode a request's text segments one after another (default: in parallel)")
    args = p.parse_args(argv)
    # NOTE: the launcher turns tokenizers' Rust thread pool off for every service
    # (TOKENIZERS_PARALLELISM=false); parallel segment encoding is this service's job.
    # tokenizers reads the variable at each batch call, so setting it here is enough.
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if args.parallel else "false"
    service = TokenizerService(args.nats, str(resolve_model(args.model)), args.worker_id, args.threads,
                               args.chunk_chars)
    run_service(service, args.log_level, metrics_port=args.metrics_port)
