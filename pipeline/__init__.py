"""Declarative builds of validated ExecuTorch LLM artifacts (see docs/design.md)."""
