"""Documents from files, one at a time (a corpus is never held in memory), for `mlplat.data.preprocess`.

- `.txt`: one document per file (`txt_documents="file"`), or one per block of text between blank lines
  (`"paragraph"`); read as UTF-8, undecodable bytes replaced.
- `.jsonl` / `.json`: JSON lines, one object per line; the document is the string under `json_key`.
- `.parquet` / `.arrow`: read with Hugging Face `datasets` in streaming mode; the document is column `json_key`.

A folder is searched recursively for those extensions, in sorted order, so the output is reproducible.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

TEXT, JSON, TABLE = (".txt",), (".jsonl", ".json"), (".parquet", ".arrow")
EXTENSIONS = TEXT + JSON + TABLE


class SourceError(ValueError):
    """Unreadable input; str() is one line naming the file and the rule."""


def input_files(inputs: list[str]) -> list[Path]:
    files: list[Path] = []
    for item in inputs:
        path = Path(item).expanduser()
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in EXTENSIONS)
            if not found:
                raise SourceError(f"--input {item} holds no {', '.join(EXTENSIONS)} files")
            files.extend(found)
        elif path.is_file():
            if path.suffix.lower() not in EXTENSIONS:
                raise SourceError(f"--input {item} is not one of {', '.join(EXTENSIONS)}")
            files.append(path)
        else:
            raise SourceError(f"--input {item} does not exist")
    return files


def _paragraphs(path: Path) -> Iterator[str]:
    block: list[str] = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.strip():
                block.append(line)
            elif block:
                yield "".join(block)
                block = []
    if block:
        yield "".join(block)


def _json_lines(path: Path, key: str) -> Iterator[str]:
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                raise SourceError(f"{path}:{n} is not a JSON object on one line (JSON lines are expected)") from None
            if not isinstance(record, dict) or not isinstance(record.get(key), str):
                raise SourceError(f"{path}:{n} has no string field --json-key {key}")
            yield record[key]


def _table(path: Path, key: str) -> Iterator[str]:
    try:
        import datasets
    except ImportError:
        raise SourceError(f"{path}: reading {path.suffix} needs the datasets package "
                          f"(pip install 'mlplat[data]')") from None
    builder = "parquet" if path.suffix.lower() == ".parquet" else "arrow"
    stream = datasets.load_dataset(builder, data_files=str(path), split="train", streaming=True)
    for n, record in enumerate(stream):
        if not isinstance(record.get(key), str):
            raise SourceError(f"{path}: row {n} has no string column --json-key {key}")
        yield record[key]


def documents(files: list[Path], json_key: str = "text", txt_documents: str = "file") -> Iterator[tuple[str, int]]:
    """(document text, its size in bytes on input) for every document of every file, in order."""
    for path in files:
        suffix = path.suffix.lower()
        if suffix in TEXT and txt_documents == "file":
            text = path.read_text(encoding="utf-8", errors="replace")
            yield text, path.stat().st_size
            continue
        docs = _paragraphs(path) if suffix in TEXT else _json_lines(path, json_key) if suffix in JSON \
            else _table(path, json_key)
        for text in docs:
            yield text, len(text.encode("utf-8"))
