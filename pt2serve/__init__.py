"""pt2serve: ship a decoder-only language model as one AOTInductor-compiled .pt2 and serve it."""

__version__ = "0.1.0"
