"""Where the text comes from: the embedded Python reference (no download) or a user's files."""
from __future__ import annotations

from pathlib import Path


def pydoc_documents() -> list[str]:
    """The Python language reference that ships with CPython (about 1 MB of English and code), one document per
    topic."""
    from pydoc_data import topics

    # Sorted so that the corpus — and so every split and sample — is the same on every machine.
    return [topics.topics[key] for key in sorted(topics.topics)]


def text_documents(path: str | Path) -> list[str]:
    """A .txt file, or every .txt file under a folder (sorted, so runs are reproducible), one document per file."""
    path = Path(path)
    files = text_files(path)
    if path.is_dir() and not files:
        raise FileNotFoundError(f"data.path={path} holds no .txt files")
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def pydoc_corpus() -> str:
    return "\n\n".join(pydoc_documents())


def text_corpus(path: str | Path) -> str:
    return "\n\n".join(text_documents(path))


def text_files(path: str | Path) -> list[Path]:
    """The files `text_corpus` reads: the file itself, or every .txt file under a folder (sorted)."""
    path = Path(path)
    return sorted(path.rglob("*.txt")) if path.is_dir() else [path]


def text_corpus_tokens(path: str | Path) -> int:
    """How many byte tokens `text_corpus(path)` gives, from the file sizes alone (exact for UTF-8 files):
    lets a run refuse a too-small corpus before any process starts."""
    files = text_files(path)
    return sum(f.stat().st_size for f in files) + 2 * max(0, len(files) - 1)


def load_documents(name: str, path: str | None = None) -> list[str]:
    if name == "pydoc":
        return pydoc_documents()
    if name == "text":
        assert path is not None
        return text_documents(path)
    raise ValueError(f"data.name={name!r} is not one of pydoc, text")


def load_corpus(name: str, path: str | None = None) -> str:
    """The documents as one text, two newlines apart (unpacked training reads them as one stream)."""
    return "\n\n".join(load_documents(name, path))
