"""The data rules that read files, checked by `mlplat.train.preflight` before any process starts.

`check_data_source` resolves the tokenizer (and with it `model.vocab_size=null`), checks that the data exists and
that its token ids belong to that tokenizer; `check_data_size` that it holds one global batch of windows for
training and one for validation. Each failure is a one-line ConfigError naming the key, the value and the rule.
"""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING

from mlplat.errors import ConfigError, TokenizerError

if TYPE_CHECKING:
    from mlplat.config import RunConfig

# Data written by other tools records no tokenizer: its ids are checked against the tokenizer's vocabulary over at
# most this many tokens from the start (enough to catch another tokenizer's ids, bounded for a large corpus).
ID_SCAN_TOKENS = 1 << 24


def _fail(message: str) -> None:
    raise ConfigError(message)


def recorded_tokenizer(prefix: str) -> dict | None:
    """PREFIX.meta.json, as mlplat.data.preprocess writes it (None for data written by other tools)."""
    meta = Path(prefix + ".meta.json")
    try:
        return json.loads(meta.read_text()) if meta.is_file() else None
    except (OSError, ValueError):
        return None


def data_sources(cfg: RunConfig) -> list[tuple[float, str]]:
    from mlplat.data.indexed_windows import parse_blend

    try:
        return parse_blend(cfg.data.prefix, cfg.data.blend)
    except ValueError as e:
        raise ConfigError(str(e)) from None


HF_TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer_config.json")


def check_data_source(cfg: RunConfig) -> None:
    d, m = cfg.data, cfg.model
    if d.name == "text":
        from mlplat.data.corpus import text_files

        if not os.path.exists(str(d.path)):
            _fail(f"data.path={d.path} does not exist")
        files = text_files(d.path)
        if not files:
            _fail(f"data.path={d.path} holds no .txt files")
        for f in files:  # a FIFO or a device blocks the read forever, or never ends: no time-out covers data loading
            mode = os.stat(f).st_mode
            if not stat.S_ISREG(mode):
                kind = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
                        stat.S_IFSOCK: "a socket"}.get(stat.S_IFMT(mode), "not a regular file")
                _fail(f"data.path={d.path}: {f} is {kind}; data=text reads regular files only")
    opened = {}
    if d.name == "indexed":
        from mlplat.data.indexed import IndexedFormatError, IndexedTokens
        from mlplat.data.indexed_windows import parse_split

        sources = data_sources(cfg)
        try:
            parse_split(d.split)
            for _, prefix in sources:
                opened[prefix] = IndexedTokens(prefix, "data.blend" if d.blend is not None else "data.prefix")
        except (IndexedFormatError, ValueError) as e:
            raise ConfigError(str(e)) from None
        if d.tokenizer is None:  # the tokenizer the data was made with
            metas = [recorded_tokenizer(p) for _, p in sources]
            specs = {meta["tokenizer"] for meta in metas if meta}
            if None in [meta and meta.get("tokenizer") for meta in metas] or len(specs) != 1:
                _fail(f"data.tokenizer=null needs every prefix to have one and the same tokenizer recorded in "
                      f"PREFIX.meta.json (found {sorted(specs) or 'none'}); set data.tokenizer=NAME_OR_PATH")
            d.tokenizer = specs.pop()
    if d.tokenizer is None and cfg.init_from is not None and any(
            os.path.exists(os.path.join(str(cfg.init_from), f)) for f in HF_TOKENIZER_FILES):
        d.tokenizer = str(cfg.init_from)  # fine-tuning: the checkpoint's own tokenizer, unless data.tokenizer is set
    if d.tokenizer is None and d.name in ("pydoc", "text"):
        d.tokenizer = "byte"
    if d.tokenizer is None:
        _fail(f"data.tokenizer=null: data={d.name} needs a tokenizer (byte, gpt2, a tokenizer.json or a hub name)")
    from mlplat.data.tokenizer import load_tokenizer

    try:
        tokenizer = load_tokenizer(d.tokenizer)
    except TokenizerError as e:
        raise ConfigError(str(e)) from None
    for prefix, tokens in opened.items():
        _check_ids_belong(cfg, prefix, tokens, tokenizer)
        if d.pack:
            _check_documents_end(cfg, prefix, tokens, tokenizer.eod)
    vocab = tokenizer.vocab_size
    if m.vocab_size is None:
        m.vocab_size = vocab
    elif m.vocab_size < vocab:
        _fail(f"model.vocab_size={m.vocab_size} is smaller than the vocabulary of data.tokenizer={d.tokenizer} "
              f"({vocab} tokens); set model.vocab_size=null to follow the tokenizer")


def _check_ids_belong(cfg: RunConfig, prefix: str, tokens, tokenizer) -> None:
    """Refuse indexed data made with another tokenizer than data.tokenizer: its ids would name other tokens (the
    run would train, on noise). PREFIX.meta.json says which tokenizer wrote it; and whatever it says (a meta file
    copied from another prefix, a .bin rewritten in place), the ids read must fall inside the vocabulary: past it
    a vocabulary-parallel embedding (t >= 2) would look them up as zero rows without a word."""
    key = "data.blend" if cfg.data.blend is not None else "data.prefix"
    meta = recorded_tokenizer(prefix)
    if meta and "vocab_size" in meta:
        theirs = (int(meta["vocab_size"]), meta.get("eod", tokenizer.eod))
        if theirs != (tokenizer.vocab_size, tokenizer.eod):
            _fail(f"data.tokenizer={cfg.data.tokenizer} is not the tokenizer {prefix} was preprocessed with "
                  f"({meta.get('tokenizer')}: vocabulary {theirs[0]}, end of document {theirs[1]}, in "
                  f"{prefix}.meta.json; {cfg.data.tokenizer}: {tokenizer.vocab_size}, {tokenizer.eod}); set "
                  f"data.tokenizer=null to use the recorded one")
    head = tokens.tokens[:ID_SCAN_TOKENS]
    top = int(head.max()) if len(head) else -1
    if top >= tokenizer.vocab_size:
        _fail(f"{key}: {prefix} holds token id {top}, outside the vocabulary of data.tokenizer={cfg.data.tokenizer} "
              f"({tokenizer.vocab_size} tokens); set data.tokenizer to the tokenizer the data was made with")


def _check_documents_end(cfg: RunConfig, prefix: str, tokens, eod: int) -> None:
    """data.pack=true tells documents apart by their end-of-document token: data without one would pack nothing."""
    head = tokens.tokens[:ID_SCAN_TOKENS]
    if len(head) and not (head == eod).any():
        key = "data.blend" if cfg.data.blend is not None else "data.prefix"
        _fail(f"data.pack=true: {key} {prefix} holds no end-of-document token (id {eod}) in its first {len(head):,} "
              f"tokens, so no document boundary is known; write it with python -m mlplat.data.preprocess (which "
              f"ends each document with it) or set data.pack=false")


def _text_tokens(cfg: RunConfig) -> int:
    from mlplat.data.corpus import load_corpus, text_corpus_tokens

    d = cfg.data
    if d.tokenizer == "byte" and d.name == "text":
        return text_corpus_tokens(d.path)  # file sizes suffice: no need to read a large corpus here
    from mlplat.data.tokenizer import load_tokenizer

    return len(load_tokenizer(d.tokenizer).encode(load_corpus(d.name, d.path)))


def check_data_size(cfg: RunConfig) -> None:
    """One global batch of windows for training and, unless validation is off, for validation."""
    d, seq, batch = cfg.data, cfg.model.seq_len, cfg.parallel.global_batch_size
    need_val = cfg.trainer.limit_val_batches != 0
    advice = "use more data or a smaller parallel.global_batch_size or model.seq_len"
    if d.name == "indexed":
        from mlplat.data.indexed_windows import open_sources

        windows = open_sources(data_sources(cfg), d.split, seq)
        for which, key in (("train", "training"), ("valid", "validation")):
            count = sum(w.count for w in windows[which])
            if count < batch and (which == "train" or need_val):
                what = f"data.prefix={d.prefix}" if d.blend is None else f"data.blend={list(d.blend)}"
                _fail(f"{what} is too small: its {key} split (data.split={d.split}) gives {count} windows of "
                      f"model.seq_len={seq}, and a step needs parallel.global_batch_size={batch}; {advice}")
        return
    n = _text_tokens(cfg)
    n_val = max(int(n * d.val_fraction), seq + 1)  # mirrors mlplat.data.dataset.split_tokens / TokenWindows
    train_windows = max(0, n - n_val - 1) // seq
    val_windows = (min(n, n_val) - 1) // seq
    if not (train_windows >= batch and (val_windows >= batch or not need_val)):
        what = f"data.path={d.path}" if d.name == "text" else f"data={d.name} (the embedded corpus)"
        _fail(f"{what} is too small: its {n} tokens give {train_windows} training and {val_windows} validation "
              f"windows of model.seq_len={seq}, and a step needs parallel.global_batch_size={batch} of each "
              f"(data.val_fraction={d.val_fraction}); {advice}")
