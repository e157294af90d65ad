"""mlplat.data.preprocess: text, JSON lines and parquet into the indexed format, with end-of-document tokens."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from mlplat.data.indexed import IndexedTokens
from mlplat.data.preprocess import main as preprocess_main
from mlplat.data.tokenizer import ByteTokenizer


def _docs(prefix: str) -> list[list[int]]:
    data = IndexedTokens(prefix)
    return [data.document(i).tolist() for i in range(data.num_documents)]


def test_preprocess_formats_workers_and_end_of_document(tmp_path, capsys):
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.txt").write_text("first file\n\nstill the first file")
    (folder / "b.jsonl").write_text(json.dumps({"text": "from json"}) + "\n\n" + json.dumps({"text": "x"}) + "\n")
    out = str(tmp_path / "byte")
    assert preprocess_main(["--input", str(folder), "--output-prefix", out, "--tokenizer", "byte", "--quiet"]) == 0
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert summary.startswith(f"wrote {out}.bin/.idx: 3 documents") and "MB/s" in summary and "tokens/s" in summary
    tok = ByteTokenizer()
    expected = [tok.encode(t) + [0] for t in ("first file\n\nstill the first file", "from json", "x")]
    assert _docs(out) == expected
    assert json.loads(Path(out + ".meta.json").read_text())["tokenizer"] == "byte"
    para = str(tmp_path / "para")
    assert preprocess_main(["--input", str(folder / "a.txt"), "--output-prefix", para, "--txt-documents",
                            "paragraph", "--workers", "2", "--quiet"]) == 0
    assert _docs(para) == [tok.encode("first file\n") + [0], tok.encode("still the first file") + [0]]
    assert preprocess_main(["--input", str(tmp_path / "missing"), "--output-prefix", para]) == 2
    assert capsys.readouterr().err.strip().startswith("error: --input")


def test_preprocess_parquet_through_datasets(tmp_path):
    pytest.importorskip("datasets")
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"body": ["one doc", "two"]}), tmp_path / "t.parquet")
    out = str(tmp_path / "pq")
    assert preprocess_main(["--input", str(tmp_path / "t.parquet"), "--output-prefix", out, "--json-key", "body",
                            "--quiet"]) == 0
    assert _docs(out) == [list(b"one doc") + [0], list(b"two") + [0]]


@pytest.mark.parametrize("offline", [True, False])
def test_unknown_tokenizer_name_is_one_line_and_fast(tmp_path, capfd, monkeypatch, offline):
    """A typo in a hub name: the local cache is asked first, then (unless HF_HUB_OFFLINE) the hub once, briefly;
    one line comes out, not the hub client's retries and warnings (once 23 lines and 46 s offline)."""
    pytest.importorskip("huggingface_hub")
    (tmp_path / "a.txt").write_text("some text")
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    start = time.monotonic()
    code = preprocess_main(["--input", str(tmp_path / "a.txt"), "--output-prefix", str(tmp_path / "out"),
                            "--tokenizer", "nosuchtok-typo", "--quiet"])
    elapsed = time.monotonic() - start
    out, err = capfd.readouterr()
    lines = (out + err).strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: data.tokenizer=nosuchtok-typo is not byte, gpt2, a tokenizer.json")
    assert elapsed < 20, f"{elapsed:.1f} s to refuse"  # one request with a 10 s timeout at most
