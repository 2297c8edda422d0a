"""An OpenAI-compatible HTTP server over a Runner (`pt2serve serve-artifact`).

Modules import FastAPI and the runtime lazily from here: `pt2serve.serve.command` must stay cheap to
import, since the CLI registers it at start-up. Use `pt2serve.serve.app.create_app` to build an app.
"""
