"""What the HTTP layer needs to know that the runner does not."""

from __future__ import annotations

from dataclasses import dataclass

from pt2serve.errors import Pt2ServeError


@dataclass(frozen=True)
class ServerConfig:
    model_name: str = "model"  # the id clients pass as `model`
    api_key: str | None = None  # None: no authentication
    max_queued: int = 256  # requests in the runner (running + waiting) before new ones get 429
    max_connections: int = 512  # open connections and requests in progress (connections.py says how)
    header_timeout_s: float = 10.0  # a connection that sends no whole request's headers for this long is closed
    body_timeout_s: float = 30.0  # a request whose body has not all arrived this long after its headers: 408
    drain_timeout_s: float = 30.0  # on SIGTERM/SIGINT, how long running requests may go on
    max_body_bytes: int = 4 * 1024 * 1024
    default_max_tokens: int | None = None  # without max_tokens: None runs to the end of the context
    retry_after_seconds: int = 1  # what a 429 tells the client to wait

    def __post_init__(self) -> None:
        if not self.model_name:
            raise Pt2ServeError("the model name must not be empty")
        if self.api_key is not None and not self.api_key:
            raise Pt2ServeError("the API key must not be empty (leave it out to turn authentication off)")
        if self.max_queued < 1:
            raise Pt2ServeError(f"max_queued must be at least 1, got {self.max_queued}")
        if self.max_connections <= self.max_queued:
            raise Pt2ServeError(f"max_connections ({self.max_connections}) must exceed max_queued ({self.max_queued}): "
                                "every queued request holds a connection, and a full queue must still answer 429")
        if not 0 < self.header_timeout_s <= 3600:
            raise Pt2ServeError(f"header_timeout_s must be in (0, 3600], got {self.header_timeout_s}")
        if not 0 < self.body_timeout_s <= 3600:
            raise Pt2ServeError(f"body_timeout_s must be in (0, 3600], got {self.body_timeout_s}")
        if not 0 <= self.drain_timeout_s <= 3600:
            raise Pt2ServeError(f"drain_timeout_s must be in [0, 3600], got {self.drain_timeout_s}")
        if self.max_body_bytes < 1024:
            raise Pt2ServeError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}")
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise Pt2ServeError(f"default_max_tokens must be at least 1, got {self.default_max_tokens}")
