"""`python -m mlplat.data.preprocess --input FILE_OR_DIR... --output-prefix PREFIX --tokenizer NAME_OR_PATH`

Tokenizes documents (see `mlplat.data.sources` for what a document is in each input format), appends the
tokenizer's end-of-document token to each, and writes PREFIX.bin + PREFIX.idx in Megatron-Core's indexed
format (`mlplat.data.indexed`) plus PREFIX.meta.json (the tokenizer, so training and sampling use the same).

Documents stream through: a bounded number of batches is in flight, so memory does not grow with the corpus.
With --workers N > 1, N processes tokenize while this one reads and writes, in input order.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from collections import deque
from pathlib import Path

import numpy as np

from mlplat.data.indexed import IndexedWriter, token_dtype
from mlplat.data.sources import SourceError, documents, input_files
from mlplat.data.tokenizer import TokenizerError, load_tokenizer

BATCH_BYTES = 1 << 20  # documents are sent to workers in batches of about this much text

_worker_tokenizer = None  # one per worker process, set by its initializer


def _init_worker(spec: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = load_tokenizer(spec)


def _encode(tokenizer, texts: list[str], dtype) -> list[np.ndarray]:
    batch = tokenizer.encode_batch(texts) if hasattr(tokenizer, "encode_batch") else map(tokenizer.encode, texts)
    return [np.array([*ids, tokenizer.eod], dtype=dtype) for ids in batch]


def _encode_in_worker(texts: list[str], dtype) -> list[np.ndarray]:
    return _encode(_worker_tokenizer, texts, dtype)


def _batches(docs, limit: int = BATCH_BYTES):
    texts: list[str] = []
    size = 0
    for text, nbytes in docs:
        texts.append(text)
        size += nbytes
        if size >= limit:
            yield texts, size
            texts, size = [], 0
    if texts:
        yield texts, size


def preprocess(inputs: list[str], prefix: str, tokenizer_spec: str, workers: int = 1, json_key: str = "text",
               txt_documents: str = "file", progress: bool = True) -> dict:
    """Write PREFIX.bin/.idx/.meta.json; returns the summary (documents, tokens, bytes, seconds)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # N workers means N cores, not N × all cores
    files = input_files(inputs)
    tokenizer = load_tokenizer(tokenizer_spec)
    dtype = token_dtype(tokenizer.vocab_size)
    total_bytes = sum(f.stat().st_size for f in files)
    from tqdm import tqdm

    bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenizing", disable=not progress,
               file=sys.stderr, mininterval=0.5)
    start = time.perf_counter()
    in_bytes = 0
    batches = _batches(documents(files, json_key, txt_documents))
    with IndexedWriter(prefix, dtype) as writer:
        def write(arrays: list[np.ndarray], nbytes: int) -> None:
            nonlocal in_bytes
            for ids in arrays:
                writer.add_document(ids)
            in_bytes += nbytes
            bar.update(nbytes)
            bar.set_postfix_str(f"{writer.tokens / max(time.perf_counter() - start, 1e-9):,.0f} tokens/s",
                                refresh=False)

        if workers <= 1:
            for texts, nbytes in batches:
                write(_encode(tokenizer, texts, dtype), nbytes)
        else:
            ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
            with ctx.Pool(workers, initializer=_init_worker, initargs=(tokenizer.spec,)) as pool:
                pending: deque = deque()
                for texts, nbytes in batches:
                    pending.append((pool.apply_async(_encode_in_worker, (texts, dtype)), nbytes))
                    if len(pending) >= 2 * workers:  # bounded: reading never runs far ahead of tokenizing
                        result, size = pending.popleft()
                        write(result.get(), size)
                while pending:
                    result, size = pending.popleft()
                    write(result.get(), size)
        n_docs, n_tokens = len(writer.lengths), writer.tokens
    bar.close()
    seconds = time.perf_counter() - start
    meta = {"tokenizer": tokenizer.spec, "vocab_size": tokenizer.vocab_size, "eod": tokenizer.eod,
            "dtype": np.dtype(dtype).name, "documents": n_docs, "tokens": n_tokens, "input_bytes": in_bytes}
    Path(prefix + ".meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return {**meta, "seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mlplat.data.preprocess", description=__doc__.splitlines()[0])
    ap.add_argument("--input", nargs="+", required=True, help=".txt/.jsonl/.json/.parquet/.arrow files or folders")
    ap.add_argument("--output-prefix", required=True, help="writes PREFIX.bin, PREFIX.idx, PREFIX.meta.json")
    ap.add_argument("--tokenizer", default="byte", help="byte, gpt2, a tokenizer.json or folder, or a hub name")
    ap.add_argument("--workers", type=int, default=1, help="tokenizing processes (default 1)")
    ap.add_argument("--json-key", default="text", help="the text field of .jsonl/.json/.parquet/.arrow records")
    ap.add_argument("--txt-documents", choices=("file", "paragraph"), default="file",
                    help=".txt: one document per file (default) or per block between blank lines")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    if args.workers < 1:
        print(f"error: --workers {args.workers} must be at least 1", file=sys.stderr)
        return 2
    try:
        s = preprocess(args.input, args.output_prefix, args.tokenizer, args.workers, args.json_key,
                       args.txt_documents, progress=not args.quiet)
    except (SourceError, TokenizerError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    mb = s["input_bytes"] / 1e6
    print(f"wrote {args.output_prefix}.bin/.idx: {s['documents']:,} documents, {s['tokens']:,} tokens ({s['dtype']}, "
          f"tokenizer {s['tokenizer']}) from {mb:,.1f} MB in {s['seconds']:.1f} s: "
          f"{mb / s['seconds']:,.2f} MB/s, {s['tokens'] / s['seconds']:,.0f} tokens/s with {args.workers} worker(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
