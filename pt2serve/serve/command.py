"""`pt2serve serve-artifact` (being written)."""


def serve_artifact_command() -> None:
    """Serve an artifact over an OpenAI-compatible HTTP API."""
    raise SystemExit("serve-artifact is not available yet")
