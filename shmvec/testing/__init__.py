"""Helpers for tests and examples: a tiny chat model made on the spot (``tiny_llm``)."""
