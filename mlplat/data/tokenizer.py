"""Tokenizers: `byte` (every UTF-8 byte is a token), `gpt2` (GPT-2's BPE), or any Hugging Face tokenizer.

`load_tokenizer(spec)` takes what `data.tokenizer` holds:

- `byte`: vocabulary 256, no files; the end-of-document token is 0 (the NUL byte, which text does not hold).
- `gpt2`: GPT-2's byte-level BPE (vocabulary 50257, end of document `<|endoftext|>` = 50256), built with the
  `tokenizers` library from GPT-2's vocabulary and merges, found by `mlplat.data.gpt2_files`.
- a `tokenizer.json` file, or a folder holding one (or any folder `transformers.AutoTokenizer` loads).
- a Hugging Face hub name (e.g. `EleutherAI/gpt-neox-20b`): from the local HF cache, or downloaded when online.

Every tokenizer has `vocab_size`, `eod`, `encode(text) -> list[int]` (no special tokens added) and
`decode(ids) -> str`; `spec` is the string that loads it again (worker processes and checkpoints use it).
"""
from __future__ import annotations

from pathlib import Path

# Tried in this order as a tokenizer's end-of-document token (GPT-2/NeoX, Llama/T5, others).
EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded; str() is one line naming data.tokenizer and what to do."""


class ByteTokenizer:
    spec = "byte"
    vocab_size = 256
    eod = 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizers.Tokenizer` (the Rust one, also the backend of transformers' fast tokenizers)."""

    def __init__(self, tokenizer, spec: str):
        self.tokenizer, self.spec = tokenizer, spec
        # Added tokens may sit above the base vocabulary: the model must have a row for every id.
        self.vocab_size = max(tokenizer.get_vocab_size(with_added_tokens=True),
                              1 + max(tokenizer.get_vocab(with_added_tokens=True).values()))
        eod = next((tokenizer.token_to_id(t) for t in EOD_CANDIDATES if tokenizer.token_to_id(t) is not None), None)
        if eod is None:
            raise TokenizerError(f"data.tokenizer={spec} has no end-of-document token (none of "
                                 f"{', '.join(EOD_CANDIDATES)}); add one to its tokenizer.json")
        self.eod = eod

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def gpt2_tokenizer() -> HFTokenizer:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from mlplat.data.gpt2_files import find_gpt2_files

    found = find_gpt2_files()
    if isinstance(found, Path):  # a complete tokenizer.json (e.g. from the HF cache)
        return HFTokenizer(Tokenizer.from_file(str(found)), "gpt2")
    vocab, merges = found
    tok = Tokenizer(models.BPE.from_file(str(vocab), str(merges)))
    # GPT-2's pre-tokenisation regex and byte-to-unicode map; no space is added in front of the text.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])  # already id 50256 in the vocabulary: marks it special
    return HFTokenizer(tok, "gpt2")


def _from_transformers(name: str) -> HFTokenizer:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise TokenizerError(f"data.tokenizer={name} needs the transformers package (pip install transformers), "
                             f"or give a tokenizer.json") from None
    try:
        auto = AutoTokenizer.from_pretrained(name)
    except Exception as e:  # offline, unknown name, no fast tokenizer files, ...
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise TokenizerError(f"data.tokenizer={name} is not byte, gpt2, a tokenizer.json, a tokenizer folder or a "
                             f"Hugging Face hub name that loads now ({first[:200]})") from None
    backend = getattr(auto, "backend_tokenizer", None)
    if backend is None:
        raise TokenizerError(f"data.tokenizer={name} has only a slow (Python) tokenizer; save a fast one "
                             f"(tokenizer.json) with transformers and point data.tokenizer at it")
    return HFTokenizer(backend, name)


def load_tokenizer(spec: str):
    """The tokenizer `data.tokenizer=spec` names (see the module docstring), or a one-line TokenizerError."""
    spec = str(spec)
    if spec == "byte":
        return ByteTokenizer()
    if spec == "gpt2":
        return gpt2_tokenizer()
    path = Path(spec).expanduser()
    if path.is_file():
        from tokenizers import Tokenizer

        try:
            return HFTokenizer(Tokenizer.from_file(str(path)), spec)
        except TokenizerError:
            raise
        except Exception as e:
            raise TokenizerError(f"data.tokenizer={spec} is not a readable tokenizer.json ({e})") from None
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return load_tokenizer(str(path / "tokenizer.json"))
    return _from_transformers(spec)
