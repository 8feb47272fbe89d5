"""One request's chunks back to text.

``request_stream`` (``RequestStream``, ``Phase``, ``StreamError``) follows one choice of a request
from submit to its final chunk: subscription, worker liveness, handoff and failover; ``output``
turns its chunks into text through ``detokenizer`` (incremental, UTF-8 safe) and ``stop`` (stop
strings). The pipeline (``gateway.pipeline``) opens the streams and hands their chunks to the API
adapters. Data flows API adapter -> pipeline -> stream.
"""
