"""Hugging Face interop: `init_from` a transformers GPT-2 directory, `export --format hf` back (float64 proofs).

One 4-rank group (tp2·pp2) builds three models: one imported under the interleaved schedule (v=2) in float64,
one imported in float32 and saved (the round trip), one randomly initialised, saved, and asked for its own greedy
text. The parent compares each with transformers. Tests needing transformers skip cleanly without it.
"""
from __future__ import annotations

import importlib.util
import json
import shutil
import zlib
from pathlib import Path

import pytest
import torch

from mlplat.errors import ConfigError
from mlplat.train import load_checked as load_config  # validate, then the init_from and data checks
from tests.helpers.cli import read_metrics, run_train
from tests.helpers.dist import run_distributed

needs_hf = pytest.mark.skipif(importlib.util.find_spec("transformers") is None
                              or importlib.util.find_spec("safetensors") is None,
                              reason="needs the [hf] extra (transformers, safetensors)")

VOCAB = 250  # padded to 256 at tp=1 and tp=2 (rows 250..255 are padding)
MODEL = dict(n_layers=4, hidden=32, n_heads=4, seq_len=32, vocab_size=VOCAB, dropout=0.0)
PROMPT = [5, 17, 42, 99, 3]
REL = 1e-10


def gpt2_dir(path: Path, dtype: torch.dtype, seed: int, vocab: int = VOCAB, activation: str = "gelu_new") -> Path:
    """A random tiny GPT2LMHeadModel saved with save_pretrained; LayerNorms and biases perturbed off 1 and 0."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=MODEL["n_layers"], n_embd=MODEL["hidden"], n_head=MODEL["n_heads"],
                     n_positions=MODEL["seq_len"], vocab_size=vocab, activation_function=activation,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(cfg).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(str(path))
    return path


def load_hf(path, dtype=None):
    """transformers' own loading, in the file's dtype unless `dtype` is given."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), **({"dtype": dtype} if dtype else {})).eval()


def hf_logits(path, tokens: torch.Tensor, dtype=None) -> torch.Tensor:
    with torch.no_grad():
        return load_hf(path, dtype)(tokens).logits


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def tokens_for_test() -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, MODEL["seq_len"]), generator=torch.Generator().manual_seed(11))


def mlplat_cfg(tp=1, pp=1, vpp=1, activation="gelu_tanh", init_from=None, precision="64-true", seq_len=None):
    return load_config({
        "model": dict(MODEL, activation=activation, seq_len=seq_len or MODEL["seq_len"]),
        "parallel": dict(tp=tp, pp=pp, vpp=vpp, dp=1, schedule="interleaved" if vpp > 1 else "1f1b",
                         micro_batch_size=2, global_batch_size=4),
        "kernels": dict(attention="math"), "trainer": dict(precision=precision), "logger": dict(name="none"),
        "init_from": None if init_from is None else str(init_from),
    }, world_size=tp * pp, check_data=False)  # token ids of its own


# ------------------------------------------------------------------------------------------------ worker helpers

def build(cfg, grid, dtype):
    """This rank's chunks built directly in `dtype` (as Lightning's 64-true does), imported when cfg.init_from."""
    from mlplat.step import TrainStep

    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return TrainStep(cfg, grid)
    finally:
        torch.set_default_dtype(saved)


def pipeline_logits(module, grid, tokens):
    """Full logits (real vocabulary) on the last stage, None elsewhere; one micro-batch through the schedule. Under
    context parallelism each rank runs its share of the window (mlplat.parallel.placement.place) and the last stage
    puts the cp ranks' shares back in window order."""
    from mlplat.parallel.placement import place
    from mlplat.parallel.tensor import gather_from_tensor_parallel

    outs = []
    s = module.cfg.model.seq_len
    with torch.no_grad():
        for mb in tokens.split(module.cfg.parallel.micro_batch_size):
            x, _, placed = place(mb, mb[:, :0], s, grid.cp, grid.cp_rank)
            module.engine.run([(x, None, placed)] * module.cfg.parallel.pipeline.min_micro_batches, forward_only=True)
            if grid.is_last_stage:
                mine = gather_from_tensor_parallel(module.engine.last_outputs[0], grid)[..., :VOCAB]
                outs.append(_whole_window(mine, grid, s) if grid.cp > 1 else mine.clone())
    return torch.cat(outs) if outs else None


def _whole_window(mine, grid, seq_len):
    """[b, s, V] from each cp rank's [b, s/c, V] of its load-balanced places."""
    import torch.distributed as dist

    from mlplat.parallel.placement import local_index

    shares = [torch.empty_like(mine) for _ in range(grid.cp)]
    dist.all_gather(shares, mine.contiguous(), group=grid.cp_group)
    whole = mine.new_empty(mine.size(0), seq_len, mine.size(-1))
    for r, share in enumerate(shares):
        whole[:, local_index(seq_len, grid.cp, r)] = share
    return whole


@torch.no_grad()
def perturb(module, grid, seed, std=0.2):
    """Noise on every parameter, identical on every rank (a full tensor per name, sharded): biases and LayerNorms
    leave 0 and 1, and the model is sharp enough that greedy text varies. Vocabulary padding rows stay zero."""
    from mlplat.parallel.tensor import partition_dim_of, shard_of

    for chunk in module.chunks.values():
        for name, p in chunk.named_parameters():
            full_name = chunk.full_name(name)
            shape = list(p.shape)
            dim = partition_dim_of(p)
            if dim is not None:
                shape[dim] *= grid.tp
            gen = torch.Generator().manual_seed(seed + zlib.crc32(full_name.encode()))  # the same on every rank
            full = std * torch.randn(shape, generator=gen, dtype=p.dtype)
            if full_name == "embedding.word.weight":
                full[VOCAB:] = 0
            p.add_(shard_of(full, p, grid))


def _interop(rank, world_size, hf64, hf32, ckpt_root, tokens):
    from mlplat.checkpoint import io
    from mlplat.lightning.strategy import checkpoint_layout
    from mlplat.parallel.grid import ParallelGrid
    from mlplat.step.decode import generate

    grid = ParallelGrid(2, 2, 1)
    out = {}
    imported = build(mlplat_cfg(2, 2, 2, init_from=hf64), grid, torch.float64)
    out["import_logits"] = pipeline_logits(imported, grid, tokens)

    roundtrip = build(mlplat_cfg(2, 2, 2, init_from=hf32, precision="32-true"), grid, torch.float32)
    io.save(f"{ckpt_root}/roundtrip", roundtrip.chunks, None, grid, {"global_step": 0},
            checkpoint_layout(roundtrip.cfg, 1))

    own = build(mlplat_cfg(2, 2, activation="gelu"), grid, torch.float64)
    perturb(own, grid, 5)
    out["own_logits"] = pipeline_logits(own, grid, tokens)
    out["generated"] = generate(own, PROMPT, 20)
    io.save(f"{ckpt_root}/tp2pp2", own.chunks, None, grid, {"global_step": 0}, checkpoint_layout(own.cfg, 1))
    return out


# ------------------------------------------------------------------------------------------------ fixtures

@pytest.fixture(scope="module")
def gpt2_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return root, gpt2_dir(root / "gpt2_f64", torch.float64, seed=1), gpt2_dir(root / "gpt2_f32", torch.float32, seed=2)


@pytest.fixture(scope="module")
def interop(gpt2_dirs):
    root, hf64, hf32 = gpt2_dirs
    tokens = tokens_for_test()
    results = run_distributed(_interop, 4, str(hf64), str(hf32), str(root / "ckpt"), tokens, timeout=300)
    last = [r for r in results if r["import_logits"] is not None]
    assert len(last) == 2  # the two tp ranks of the last stage
    return {"root": root, "hf64": hf64, "hf32": hf32, "tokens": tokens, "results": results, "last": last}


def export_hf(ckpt: Path, out: Path, *extra: str) -> Path:
    from mlplat.checkpoint.export import main as export_main

    assert export_main([str(ckpt), str(out), "--format", "hf", *extra]) == 0
    return out


# ------------------------------------------------------------------------------------------------ import

@needs_hf
def test_import_in_one_process_matches_transformers(interop):
    from mlplat.parallel.grid import ParallelGrid

    grid = ParallelGrid()
    module = build(mlplat_cfg(init_from=interop["hf64"]), grid, torch.float64)
    ours = pipeline_logits(module, grid, interop["tokens"])
    assert rel_err(ours, hf_logits(interop["hf64"], interop["tokens"])) <= REL
    # model.seq_len under n_positions: the first 16 learned positions are read.
    short = build(mlplat_cfg(init_from=interop["hf64"], seq_len=16), grid, torch.float64)
    assert short.chunks[0].embedding.position.weight.shape[0] == 16
    tokens = interop["tokens"][:, :16]
    assert rel_err(pipeline_logits(short, grid, tokens), hf_logits(interop["hf64"], tokens)) <= REL


@needs_hf
def test_each_tensor_parallel_rank_reads_only_its_shard(gpt2_dirs, monkeypatch):
    """tp=4 (one head per rank, vocabulary 250 padded to 512): every read returns at most the rank's shard, the
    four ranks together read each split tensor exactly once, and each shard is the slice of the one-process import."""
    from mlplat.checkpoint import hf
    from mlplat.model.decoder import DecoderChunk
    from mlplat.parallel.grid import ParallelGrid
    from mlplat.parallel.tensor import partition_dim_of, shard_of

    _, hf64, _ = gpt2_dirs
    reads: list[tuple[str, int]] = []
    real_slice = hf.HFWeights.slice

    class Counted:
        def __init__(self, sl, name):
            self.sl, self.name = sl, name

        def get_shape(self):
            return self.sl.get_shape()

        def __getitem__(self, index):
            t = self.sl[index]
            reads.append((self.name, t.numel()))
            return t

    monkeypatch.setattr(hf.HFWeights, "slice", lambda self, name: Counted(real_slice(self, name), name))
    whole = build(mlplat_cfg(init_from=hf64), ParallelGrid(), torch.float64).chunks[0]
    full = dict(whole.named_parameters())
    reads.clear()
    split_read: dict[str, int] = {}
    for rank in range(4):
        grid = ParallelGrid(4, 1, 1, rank=rank, virtual=True)
        chunk = DecoderChunk(mlplat_cfg().model, grid, 0, 1, device="meta", dtype=torch.float64)  # shapes only
        with hf.HFWeights(hf64, chunk.cfg) as src:
            for name, p in chunk.named_parameters():
                reads.clear()
                shard = src.read_shard(name, p, grid)
                assert sum(n for _, n in reads) <= p.numel(), name
                if partition_dim_of(p) is not None:
                    split_read[name] = split_read.get(name, 0) + sum(n for _, n in reads)
                assert torch.equal(shard, shard_of(full[name].detach(), p, grid)), (name, rank)
    for name, n in split_read.items():
        real = full[name][:VOCAB] if name == "embedding.word.weight" else full[name]
        assert n == real.numel(), name


@needs_hf
def test_import_under_tp2_pp2_interleaved_matches_transformers(interop):
    ref = hf_logits(interop["hf64"], interop["tokens"])
    for r in interop["last"]:
        assert rel_err(r["import_logits"], ref) <= REL


# ------------------------------------------------------------------------------------------------ export

@needs_hf
def test_export_of_a_tp2_pp2_checkpoint_matches_mlplat(interop):
    out = export_hf(interop["root"] / "ckpt" / "tp2pp2", interop["root"] / "export_tp2pp2")
    config = json.loads((out / "config.json").read_text())
    assert (config["vocab_size"], config["n_positions"], config["activation_function"]) == (VOCAB, 32, "gelu")
    assert config["bos_token_id"] is config["eos_token_id"] is None  # byte-level ids: no special tokens
    got = hf_logits(out, interop["tokens"])
    assert got.dtype == torch.float64
    assert rel_err(got, interop["last"][0]["own_logits"]) <= REL


@needs_hf
def test_greedy_generation_matches_transformers(interop):
    model = load_hf(export_hf(interop["root"] / "ckpt" / "tp2pp2", interop["root"] / "export_gen"))
    assert_greedy_text_matches(model, interop["results"])


def assert_greedy_text_matches(model, results: list[dict], key: str = "generated", new_tokens: int = 20) -> None:
    """Every rank's greedy continuation of PROMPT (`new_tokens` tokens, through mlplat's pipeline; results[rank][key])
    is transformers'."""
    with torch.no_grad():
        theirs = model.generate(torch.tensor([PROMPT]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    ours = results[0][key]
    assert len(ours) == len(PROMPT) + new_tokens and len(set(ours[len(PROMPT):])) > new_tokens // 4  # not a repeat
    assert theirs[0].tolist() == ours
    assert all(r[key] == ours for r in results)


def assert_same_tensors(original: Path, out: Path) -> dict[str, torch.Tensor]:
    """`out`'s model.safetensors holds `original`'s tensors, names and float32 values bit for bit; returns them."""
    from safetensors.torch import load_file

    before = load_file(str(original / "model.safetensors"))
    after = load_file(str(out / "model.safetensors"))
    assert sorted(before) == sorted(after)
    for name in before:
        assert before[name].dtype == after[name].dtype == torch.float32, name
        assert torch.equal(before[name], after[name]), name
    return after


@needs_hf
def test_round_trip_hf_mlplat_hf_is_bit_identical_in_float32(interop):
    out = export_hf(interop["root"] / "ckpt" / "roundtrip", interop["root"] / "export_roundtrip")
    assert_same_tensors(interop["hf32"], out)


@needs_hf
def test_export_streams_one_tensor_at_a_time_into_shards(interop, monkeypatch):
    """Each DCP read asks for one entry; tensors are copied out in blocks of rows (64 bytes here, to cross many
    block edges); above --max-shard-gb the files are shards with the index transformers reads."""
    from mlplat.checkpoint import hf_export

    loads: list[list[str]] = []
    real_load = hf_export.dcp.load
    monkeypatch.setattr(hf_export.dcp, "load", lambda sd, **kw: (loads.append(list(sd)), real_load(sd, **kw))[1])
    monkeypatch.setattr(hf_export, "WRITE_BLOCK_BYTES", 64)
    out = export_hf(interop["root"] / "ckpt" / "tp2pp2", interop["root"] / "export_sharded", "--max-shard-gb", "1e-5")
    assert len(loads) == 4 * 12 + 4 and all(len(keys) == 1 for keys in loads)  # 12 tensors per layer, 4 outside
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and not (out / "model.safetensors").exists()
    assert rel_err(hf_logits(out, interop["tokens"]), interop["last"][0]["own_logits"]) <= REL


@needs_hf
def test_export_copies_a_hugging_face_tokenizer_and_refuses_a_checkpoint_without_model_config(interop, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok_dir = interop["root"] / "tokenizer"
    words = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2, "<|endoftext|>": 3}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]", bos_token="<|endoftext|>",
                            eos_token="<|endoftext|>").save_pretrained(str(tok_dir))
    ckpt = interop["root"] / "ckpt_tok"
    shutil.copytree(interop["root"] / "ckpt" / "roundtrip", ckpt)
    manifest = json.loads((ckpt / "mlplat.json").read_text())
    assert manifest["layout"]["tokenizer"] == "byte"  # what this branch's runs record
    manifest["layout"]["tokenizer"] = str(tok_dir)  # what a run with data.tokenizer=DIR records
    (ckpt / "mlplat.json").write_text(json.dumps(manifest))
    out = export_hf(ckpt, interop["root"] / "export_tok")
    assert AutoTokenizer.from_pretrained(str(out))("hello world")["input_ids"] == [1, 2]
    assert "tokenizer: copied" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (3, 3)  # the tokenizer's, by name

    del manifest["layout"]["model"]  # a checkpoint saved before the manifest recorded the model
    (ckpt / "mlplat.json").write_text(json.dumps(manifest))
    from mlplat.checkpoint.export import main as export_main

    assert export_main([str(ckpt), str(interop["root"] / "nope"), "--format", "hf"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: checkpoint ") and "records no model config" in err and "\n" not in err


# ------------------------------------------------------------------------------------------------ refusals

def _write_config(path: Path, **overrides) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "gpt2", "n_layer": 4, "n_embd": 32, "n_head": 4, "n_positions": 32,
              "vocab_size": VOCAB, "n_inner": None, "activation_function": "gelu_new", **overrides}
    (path / "config.json").write_text(json.dumps(config))
    (path / "model.safetensors").touch()
    return path


def test_init_from_is_checked_against_the_config_in_one_line(tmp_path, monkeypatch):
    good = _write_config(tmp_path / "good")
    check = dict(check_data=False)  # these configs feed their own token ids (VOCAB < the byte tokenizer's 256)
    assert load_config({"model": dict(MODEL, activation="gelu_tanh"), "init_from": str(good)},
                       **check).init_from == str(good)
    # The directory alone is enough: every architecture key comes from its config.json, seq_len kept under
    # n_positions (its first seq_len learned positions are read).
    alone = load_config({"model": {"seq_len": 16, "n_layers": 4}, "init_from": str(good)}, **check).model
    assert (alone.n_layers, alone.hidden, alone.n_heads, alone.vocab_size, alone.ffn_hidden, alone.seq_len,
            alone.activation, alone.arch, alone.tie_embeddings) == (4, 32, 4, VOCAB, 128, 16, "gelu_tanh", "gpt", True)
    assert load_config({"init_from": str(good)}, **check).model.seq_len == 32  # the default 128, cut to n_positions
    cases = {
        "hidden": ({"model": dict(MODEL, hidden=64)}, good,
                   f"model.hidden=64 does not match n_embd=32 in init_from={good}/config.json; drop model.hidden "
                   f"(init_from sets it)"),
        "activation": ({"model": dict(MODEL, activation="gelu")}, good,
                       f"model.activation=gelu does not match activation_function=gelu_new in "
                       f"init_from={good}/config.json; drop model.activation (init_from sets it)"),
        "missing": ({"model": dict(MODEL)}, tmp_path / "absent",
                    f"init_from={tmp_path / 'absent'} is not a directory (a transformers model directory with "
                    f"config.json)"),
        "ffn": ({"model": dict(MODEL, ffn_hidden=64)}, good,
                f"model.ffn_hidden=64 does not match n_inner=null (4·n_embd=128) in init_from={good}/config.json; "
                f"drop model.ffn_hidden (init_from sets it)"),
        "seq_len": ({"model": dict(MODEL, seq_len=64)}, good,
                    f"model.seq_len=64 exceeds n_positions=32 in init_from={good}/config.json; set model.seq_len "
                    f"<= 32"),
        "relu": ({"model": dict(MODEL)}, _write_config(tmp_path / "relu", activation_function="relu"),
                 f"init_from={tmp_path / 'relu'}: activation_function='relu' in config.json is not one of gelu, "
                 f"gelu_new, gelu_pytorch_tanh"),
    }
    for name, (raw, path, message) in cases.items():
        with pytest.raises(ConfigError) as refused:
            load_config({**raw, "init_from": str(path)}, **check)
        assert str(refused.value) == message, name
    from mlplat.checkpoint import hf_config

    real_find_spec = hf_config.importlib.util.find_spec
    monkeypatch.setattr(hf_config.importlib.util, "find_spec",
                        lambda name, *a: None if name == "safetensors" else real_find_spec(name, *a))
    with pytest.raises(ConfigError) as refused:
        load_config({"model": dict(MODEL, activation="gelu_tanh"), "init_from": str(good)}, **check)
    assert str(refused.value) == f"init_from={good} needs the safetensors package: pip install -e '.[hf]'"
    monkeypatch.undo()
    (good / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="has no model.safetensors"):
        load_config({"model": dict(MODEL, activation="gelu_tanh"), "init_from": str(good)}, **check)


def test_init_from_brings_its_tokenizer_unless_data_tokenizer_is_set(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    model = dict(MODEL, activation="gelu_tanh", vocab_size=None)
    plain = _write_config(tmp_path / "plain", vocab_size=256)
    assert load_config({"model": model, "init_from": str(plain)}).data.tokenizer == "byte"  # no tokenizer files
    with_tok = _write_config(tmp_path / "with_tok", vocab_size=8)
    vocab = {w: i for i, w in enumerate(["[UNK]", "a", "b", "c", "d", "e", "f", "<|endoftext|>"])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.save(str(with_tok / "tokenizer.json"))
    cfg = load_config({"model": model, "init_from": str(with_tok)})
    assert cfg.data.tokenizer == str(with_tok) and cfg.model.vocab_size == 8
    # data.tokenizer set: it wins over the directory's (and here its 256 ids do not fit the model's 8).
    with pytest.raises(ConfigError, match="smaller than the vocabulary of data.tokenizer=byte"):
        load_config({"model": dict(model, vocab_size=8), "init_from": str(with_tok), "data": {"tokenizer": "byte"}})


# ------------------------------------------------------------------------------------------------ end to end

@needs_hf
@pytest.mark.slow
def test_fine_tune_from_gpt2_under_3d_then_export_matches_val_loss(tmp_path):
    """init_from -> 10 steps under the default t2·p2(v2)·d2 layout (CLI, float64) -> export --format hf: the step-1
    loss equals transformers' loss of the imported model on that batch (the run starts from its weights), and the
    exported model's loss on the held-out batch equals the run's val_loss."""
    import torch.nn.functional as F

    from mlplat.data.sampler import DataParallelSampler
    from mlplat.lightning.datamodule import TextDataModule

    hf = gpt2_dir(tmp_path / "gpt2", torch.float32, seed=3, vocab=256)  # byte-level ids of the pydoc corpus
    model = ["model.n_layers=4", "model.hidden=32", "model.n_heads=4", "model.seq_len=32", "model.vocab_size=256",
             "model.activation=gelu_tanh"]
    run = tmp_path / "run"
    run_train(run, f"init_from={hf}", *model, "trainer.precision=64-true", "trainer.max_steps=10",
              "checkpoint.every_steps=10", "trainer.val_check_interval=10", "trainer.limit_val_batches=1",
              "logger=none", "sample.max_new_tokens=0")
    out = export_hf(run / "checkpoints" / "step-10", tmp_path / "export")
    rows = read_metrics(run)

    batch = 32  # parallel=3d_cpu's global batch
    cfg = load_config({"model": {"seq_len": 32}, "parallel": {"global_batch_size": batch}})  # data and seed: defaults
    data = TextDataModule(cfg)
    data.setup()

    def loss(path, windows) -> float:
        x = torch.stack([w[0] for w in windows])
        y = torch.stack([w[1] for w in windows])
        logits = hf_logits(path, x, torch.float64)  # the float32 original computed in float64, as the run did
        return float(F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1)))

    first = list(DataParallelSampler(len(data.train_set), batch, 1, 0, shuffle=True, seed=cfg.seed))[:batch]
    step1 = float(rows[0]["train_loss"])
    assert abs(loss(hf, [data.train_set[i] for i in first]) - step1) <= 1e-12 * step1
    val = float(rows[-1]["val_loss"])
    assert abs(loss(out, [data.val_set[i] for i in range(batch)]) - val) <= 1e-12 * val
