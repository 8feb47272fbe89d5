"""One generation request from admission to dispatch, the same for every HTTP API.

``generation`` is the path every API adapter (``gateway.api``) runs: start the request, admit and
route its choices (``admission``, ``router``, over the live workers of ``registry``), open one
per-request stream each (``gateway.stream``, which submits through ``dispatch``), merge their
chunks and respond. Data flows API adapter -> pipeline -> stream.
"""
