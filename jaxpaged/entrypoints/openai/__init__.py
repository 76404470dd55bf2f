"""OpenAI-compatible HTTP server (FastAPI): protocol, serving handlers, app."""
