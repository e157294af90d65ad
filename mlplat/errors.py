"""The errors a user sees as one line: str() names the key, the value and the rule.

A leaf module (it imports nothing of mlplat), so the config, the data checks, the Hugging Face config reader and
the tokenizers all raise the same types without importing each other.
"""
from __future__ import annotations


class ConfigError(ValueError):
    """An invalid configuration; str() is the one line shown to the user."""


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded; str() is one line naming data.tokenizer and what to do."""


class DivergenceError(RuntimeError):
    """optim.max_skipped_steps optimizer steps in a row skipped for an inf/NaN loss or gradient norm; str() is the one
    line naming the step and the count."""
