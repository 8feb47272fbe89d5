"""Gateway: the mesh's OpenAI-compatible HTTP front door.

The folders show the design: ``api/`` holds the HTTP adapters and their wire formats, each an
adapter over the one generation path in ``pipeline/`` (admission to dispatch), which hands each
choice's chunks to a per-request stream in ``stream/`` (chunks back to text).

Request lifecycle in the gateway, stage by stage, and what moves a request on
(modules in brackets, named within their folder; a chat completion, the other APIs run the same
``pipeline.generation``):

 1. PARSE        [chat.parse_request, chat.validate_request] The JSON body
                 becomes a ``ChatCompletionRequest``; model, n, max_tokens
                 and every sampling knob (temperature, top_p, top_k, min_p,
                 penalties, logit_bias, min_tokens, logprobs) are checked.
                 Bad -> 400 / 404 (OpenAI error shape); good -> 2 with a
                 fresh ``request_id``.
 2. ADMIT        [generation.start_request] The worker registry (fed by LoadReport
                 heartbeats on ``deepinfer.load.>``) must know a live
                 tokenizer, prefill and decode worker, else 503. Before
                 submitting (step 4), [generation.admit, router, admission]
                 the prompt is routed (prefill workers ranked by predicted
                 finish time, a decode worker chosen) and held to the limits:
                 in-flight streams, per-worker queued prefill, TTFT SLO ->
                 429 with Retry-After.
 3. TOKENIZE     [chat.tokenize] ``EncodeChatRequest`` on TOKENIZER_ENCODE_CHAT.
                 EncodeChatReply -> 4; ErrorReply "bad_request" -> 400; no
                 tokenizer -> 503. The prompt length fixes max_tokens
                 (default: max model length - prompt) or fails with 400.
                 n > 1: steps 4-8 run once per choice, concurrently (own
                 request id ``<request_id>-<i>``, seed + i); every choice
                 must reach 6 before the response starts, and any choice
                 failing fails the request and aborts the others.
 4. SUBMIT       [request_stream.RequestStream.open] Subscribe
                 to ``deepinfer.stream.<request_id>`` first, then send the
                 ``PrefillRequest`` to the router's best prefill workers in
                 turn, then on PREFILL_SUBMIT [dispatch]. SubmitReply(accepted)
                 -> 5; no responders / refused / timeout -> 503.
 5. PREFILL WAIT [request_stream: Phase.PREFILL] Watching the prefill worker named in
                 the SubmitReply. Its first TokenChunk -> 6 (or 8 if final).
                 Worker dead / no output -> 503; the HTTP response has not
                 started yet, so this is still a plain HTTP error.
 6. HANDOFF      [request_stream: Phase.HANDOFF] First token in hand; streaming
                 responses start here (role chunk, then the token's text).
                 Still watching the prefill worker until the first chunk with
                 role "decode" -> 7. Nothing within the handoff timeout ->
                 error.
 7. DECODE       [request_stream: Phase.DECODE; output.OutputProcessor] Watching the
                 decode worker named by the chunks. Every chunk goes through
                 the incremental detokenizer (UTF-8 safe) and the stop-string
                 matcher (hold-back) and becomes an SSE delta or part of the
                 final text; its logprobs, if asked, become OpenAI
                 ``logprobs.content`` entries [logprobs]. A final chunk or
                 a matched stop string -> 8.
 8. FINISH       [chat._sse, chat._collect] Final SSE chunk (+ usage chunk)
                 and ``data: [DONE]``, or the ChatCompletion JSON. If the
                 worker is still running (stop string) it gets a final
                 ``AbortRequest``; the stream subscription is dropped.

Failure exits, from any of 5-7: the watched worker misses its heartbeats (3
intervals, at least 3 s), no chunk arrives for the inactivity timeout (60 s),
or the worker reports finish_reason "error" / "abort" -> HTTP 503 / 500 if
nothing was sent, else an SSE ``data: {"error": {...}}`` event and the stream
closes. The client disconnecting (or a stop string) -> a final ``AbortRequest``
broadcast on ``deepinfer.prefill.abort`` and ``deepinfer.decode.abort``: every
worker stops the request at its next step boundary wherever it is (queued,
running, mid-handoff) and refuses a submit of it that arrives later.

Modules, by folder: api/ (the HTTP adapters: chat / completions / responses / messages
(Anthropic) / tokenize parse, validate and render their wire format; common (what they share),
openai_schema (wire shapes), logprobs (token logprobs -> OpenAI entries), errors (OpenAI error
bodies), limits (413), tools / structured (tool calls, structured output), images / image_fetch,
unsupported (refused fields)); pipeline/ (generation: the one generation path every API runs:
start, admit, open the choices, chunks, respond; router (prefill / decode routing), admission
(429s), registry (worker liveness), dispatch (submit with fallbacks)); stream/ (request_stream:
one request's token stream and liveness; output / detokenizer / stop: tokens -> text). At the
top: app (routes, lifespan, root span), config (settings, model), metrics, response_store,
service (entry point).
"""
