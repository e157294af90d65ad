"""Tokenizers: `byte` (every UTF-8 byte is a token), `gpt2` (GPT-2's BPE), or any Hugging Face tokenizer.

`load_tokenizer(spec)` takes what `data.tokenizer` holds:

- `byte`: vocabulary 256, no files; the end-of-document token is 0 (the NUL byte, which text does not hold).
- `gpt2`: GPT-2's byte-level BPE (vocabulary 50257, end of document `<|endoftext|>` = 50256), built with the
  `tokenizers` library from GPT-2's vocabulary and merges, found by `mlplat.data.gpt2_files`.
- a `tokenizer.json` file, or a folder holding one (or any folder `transformers.AutoTokenizer` loads).
- a Hugging Face hub name (e.g. `EleutherAI/gpt-neox-20b`): from the local HF cache first; otherwise, unless
  `HF_HUB_OFFLINE` is set, downloaded once the hub has answered that the name exists (a typo or no network fails
  in about a second, in one line, instead of after the hub client's retries).

Every tokenizer has `vocab_size`, `eod`, `encode(text) -> list[int]` (no special tokens added) and
`decode(ids) -> str`; `spec` is the string that loads it again (worker processes and checkpoints use it).
"""
from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

from mlplat.data.gpt2_files import find_gpt2_files
from mlplat.errors import TokenizerError

__all__ = ["ByteTokenizer", "HFTokenizer", "TokenizerError", "load_tokenizer"]

HUB_TIMEOUT_S = 10  # the one request that asks the hub whether a name exists
CACHE_PROBES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")  # a cached hub tokenizer has one

# Tried in this order as a tokenizer's end-of-document token (GPT-2/NeoX, Llama/T5, others).
EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")


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


@contextlib.contextmanager
def _quiet_hub():
    """The hub client's and transformers' warnings and retry messages off: a failure is our one line."""
    loggers = [logging.getLogger(name) for name in ("huggingface_hub", "transformers")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _offline() -> bool:
    return any(os.environ.get(k, "").lower() in ("1", "true", "yes", "on") for k in ("HF_HUB_OFFLINE",
                                                                                 "TRANSFORMERS_OFFLINE"))


def _hub_refusal(name: str) -> str | None:
    """Why the hub will not give `name` (no such repository, or no network), asked once with a short timeout;
    None when it exists."""
    from huggingface_hub import model_info
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    try:
        model_info(name, timeout=HUB_TIMEOUT_S)
    except RepositoryNotFoundError:
        return "no such repository on the Hugging Face hub"
    except HfHubHTTPError as e:
        return f"the hub refused it: {(str(e).strip().splitlines() or [type(e).__name__])[0][:120]}"
    except Exception as e:  # no network, DNS, a proxy: the hub client would retry for a minute
        return f"the Hugging Face hub cannot be reached ({type(e).__name__}) and it is not in the local cache"
    return None


def _in_hub_cache(name: str) -> bool:
    """Whether the local Hugging Face cache holds some tokenizer file of `name` (asked without transformers,
    whose import alone takes seconds)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        return any(isinstance(try_to_load_from_cache(name, f), str) for f in CACHE_PROBES)
    except Exception:  # not a valid repository id
        return False


def _from_transformers(name: str) -> HFTokenizer:
    what = f"data.tokenizer={name} is not byte, gpt2, a tokenizer.json, a tokenizer folder or a Hugging Face hub name"
    try:
        import huggingface_hub  # noqa: F401  (transformers' own dependency)
    except ImportError:
        raise TokenizerError(f"data.tokenizer={name} needs the transformers package (pip install transformers), "
                             f"or give a tokenizer.json") from None
    cached = _in_hub_cache(name)
    # A name neither cached nor (asked once, briefly) on the hub fails here, before transformers is even imported.
    if not cached and _offline():
        raise TokenizerError(f"{what} in the local cache (HF_HUB_OFFLINE is set)")
    if not cached and (why := _hub_refusal(name)) is not None:
        raise TokenizerError(f"{what} ({why})")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise TokenizerError(f"data.tokenizer={name} needs the transformers package (pip install transformers), "
                             f"or give a tokenizer.json") from None
    with _quiet_hub():
        try:
            auto = AutoTokenizer.from_pretrained(name, local_files_only=cached or _offline())
        except Exception as e:  # it exists but has no tokenizer files, or the download broke
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise TokenizerError(f"{what} that loads now ({first[:200]})") from None
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
