"""The gateway's HTTP APIs: each one an adapter over the one generation pipeline.

An adapter (``chat``, ``completions``, ``responses``, ``messages`` for Anthropic's Messages API,
``tokenize``) parses and validates its body into its own wire model (``openai_schema``, or the
module's own), hands a prompt and ``SamplingParams`` to ``pipeline.generation`` and renders the
text that each choice's stream (``stream.request_stream``, ``stream.output``) gives back in its
own wire format. Beside them, what they share: ``common`` (tokenize, assemble items / blocks),
``errors`` (OpenAI error bodies), ``limits`` (413), ``logprobs``, ``tools`` (tool-call grammars
and parsing), ``structured`` (structured-output specs), ``images`` / ``image_fetch`` (image parts
to bytes) and ``unsupported`` (fields refused). Data flows API adapter -> pipeline -> stream.
"""
