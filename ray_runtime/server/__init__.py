"""An OpenAI-compatible HTTP server for AsyncLLM on Ray Serve (docs/api.md, "Serving").

  protocol.py  the request models and their checks, and OpenAI-shaped errors
  responses.py RequestOutputs -> OpenAI response bodies and stream chunks
  serving.py   one completion or chat request run on the engine (stream or not)
  metrics.py   /metrics: the Prometheus text of the cluster's Ray metrics export
  app.py       the FastAPI routes, the Serve deployment, build_app for `serve run`
"""
