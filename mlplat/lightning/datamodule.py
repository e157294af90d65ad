"""The LightningDataModule: text or indexed data -> token windows, split across data-parallel ranks per global batch.

- data=pydoc / data=text: the text is tokenized (data.tokenizer) into one stream; its last val_fraction is
  validation; each epoch is a seeded permutation of the windows (mlplat.data.sampler).
- data=indexed: the run's samples are the first max_steps·global_batch rows of a cached sample index
  (mlplat.data.indexed_windows), read in order: one pass covers the whole run, the index does the shuffling.
- data.pack=true: each document ends with the tokenizer's end-of-document token in the stream (indexed data is
  written so), and every window comes with its tokens' documents (mlplat.data.packing).

The data position is saved in every checkpoint as `consumed_samples` (the samples of the global batches already
trained on, all ranks together), so a resumed run continues with exactly the samples the uninterrupted run would
have drawn next, at every step and across any number of epoch ends; the global order does not depend on the
data-parallel degree, so that holds across a change of dp too. The training DataLoader is resumable in
Lightning's sense (`state_dict`/`load_state_dict`, saved with the fit loop's state): Lightning restores the
batch index within the epoch and ends the epoch when it reaches len(loader), so the sampler keeps a full
epoch's length and its first pass after a resume starts at the restored step (mlplat.data.sampler).
"""
from __future__ import annotations

import csv
import logging
from pathlib import Path
from typing import Callable

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader

from mlplat.config import RunConfig
from mlplat.data.corpus import load_corpus, load_documents
from mlplat.data.dataset import StageView, TokenWindows, split_tokens
from mlplat.data.packing import PackedWindows
from mlplat.data.sampler import DataParallelSampler
from mlplat.data.tokenizer import load_tokenizer

log = logging.getLogger("mlplat")


class RecordingSampler(torch.utils.data.Sampler[int]):
    """Passes a sampler's ids through and appends each local batch to DIR/samples.csv as `step,id id ...`, with
    the run's global step (from 1) of the batch, also in a resumed run and across epochs."""

    def __init__(self, sampler: DataParallelSampler, path: Path):
        self.sampler, self.path = sampler, path

    def __len__(self) -> int:
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def resume(self, consumed_samples: int) -> None:
        self.sampler.resume(consumed_samples)

    def __iter__(self):
        for step, batch in self.sampler.batches():
            with open(self.path, "a", newline="") as f:  # recorded when drawn, before the loader hands it on
                csv.writer(f).writerow([step, " ".join(map(str, batch))])
            yield from batch


class TrainLoader(DataLoader):
    """The training DataLoader, resumable in Lightning's sense: the fit loop saves `state_dict()` in every
    checkpoint (`loops.fit_loop.state_dict.combined_loader`) and, on resume, calls `load_state_dict` after
    `train_dataloader()` and before the first batch is drawn. The state is the run's global data position
    (`consumed_samples`, from the trainer's step count, not from what the sampler has drawn ahead), the same
    on every rank and under any data-parallel degree."""

    def __init__(self, dataset, consumed_samples: Callable[[], int], **kwargs):
        super().__init__(dataset, **kwargs)
        self.consumed_samples = consumed_samples

    def state_dict(self) -> dict:
        return {"consumed_samples": int(self.consumed_samples())}

    def load_state_dict(self, state_dict: dict) -> None:
        self.sampler.resume(int(state_dict["consumed_samples"]))


class TextDataModule(pl.LightningDataModule):
    def __init__(self, cfg: RunConfig):
        super().__init__()
        self.cfg = cfg
        self.tokenizer = load_tokenizer(cfg.data.tokenizer)
        self.consumed_samples: int | None = None  # from a checkpoint

    def setup(self, stage: str | None = None) -> None:
        d = self.cfg.data
        self.train_set, self.val_set, line = self._indexed_sets() if d.name == "indexed" else self._text_sets()
        if d.pack:
            self.train_set = PackedWindows(self.train_set, self.tokenizer.eod)
            self.val_set = PackedWindows(self.val_set, self.tokenizer.eod)
            line += (f"; packed: documents end at token {self.tokenizer.eod}, positions restart and attention stays "
                     f"inside each")
        self._say(line)

    def _indexed_sets(self):
        from mlplat.data.checks import data_sources
        from mlplat.data.indexed_windows import indexed_samples

        d, m = self.cfg.data, self.cfg.model
        gb = self.cfg.parallel.global_batch_size
        sources = data_sources(self.cfg)
        train = indexed_samples(sources, d.split, "train", m.seq_len, self.cfg.trainer.max_steps * gb, self.cfg.seed,
                                d.cache_dir, m.vocab_size)
        val_batches = max(1, self.cfg.trainer.limit_val_batches)
        val = indexed_samples(sources, d.split, "valid", m.seq_len, val_batches * gb, self.cfg.seed, d.cache_dir,
                              m.vocab_size)
        names = ", ".join(prefix for _, prefix in sources)
        return train, val, (f"data: indexed {names}: {len(train):,} training and {len(val):,} validation samples of "
                            f"{m.seq_len} tokens")

    def _text_sets(self):
        d, m = self.cfg.data, self.cfg.model
        if d.pack:  # each document ended by the end-of-document token, as mlplat.data.preprocess writes them
            eod = self.tokenizer.eod
            ids = [i for doc in load_documents(d.name, d.path) for i in (*self.tokenizer.encode(doc), eod)]
        else:
            ids = self.tokenizer.encode(load_corpus(d.name, d.path))
        tokens = torch.tensor(ids, dtype=torch.long)
        train, val = split_tokens(tokens, d.val_fraction, m.seq_len)
        train, val = TokenWindows(train, m.seq_len), TokenWindows(val, m.seq_len)
        source = "the embedded corpus (Python's documentation)" if d.name == "pydoc" else d.path
        return train, val, (f"data: {source}, tokenizer {d.tokenizer}: {len(tokens):,} tokens, {len(train):,} "
                            f"training and {len(val):,} validation windows of {m.seq_len}")

    def _say(self, line: str) -> None:
        if self.trainer is None or self.trainer.is_global_zero:
            log.info(line)

    def _grid(self):
        strategy = self.trainer.strategy if self.trainer is not None else None
        return getattr(strategy, "grid", None)

    def _loader(self, dataset, shuffle: bool, train: bool = False) -> DataLoader:
        p = self.cfg.parallel
        grid = self._grid()
        dp, dp_rank = (grid.dp, grid.dp_rank) if grid is not None else (p.dp or 1, 0)
        # Validation runs the same pipeline schedule, so it uses the same global batch (m micro-batches).
        global_batch = p.global_batch_size
        local_batch = global_batch // dp
        # Text data: epochs of seeded permutations of the windows; indexed data: one pass over the cached order.
        one_pass = self.cfg.data.name == "indexed"
        sampler = DataParallelSampler(len(dataset), global_batch, dp, dp_rank, shuffle=shuffle, seed=self.cfg.seed,
                                      one_pass=train and one_pass)
        if train and self.trainer is not None and self.trainer.global_step > 0:
            # Resuming: continue where the checkpoint left off (a plain sampler would start over and repeat data).
            # The loader's own state, restored by Lightning next, says the same; checkpoints written before the
            # loader was resumable hold only this one.
            consumed = self.consumed_samples
            if consumed is None:  # a checkpoint from before consumed_samples was saved
                consumed = self.trainer.global_step * global_batch
            sampler.resume(consumed)
        if grid is not None and grid.pp > 1:  # only the first chunk's rank reads tokens, the last chunk's labels
            layout = self.cfg.parallel.pipeline
            dataset = StageView(dataset, tokens=grid.pp_rank == layout.owner(0),
                                labels=grid.pp_rank == layout.owner(layout.last_chunk), packed=self.cfg.data.pack)
        if train and self.cfg.data.record_samples and (grid is None or grid.rank == 0):
            sampler = RecordingSampler(sampler, Path(self.trainer.default_root_dir) / "samples.csv")
        if train:
            return TrainLoader(dataset, self._consumed_samples, batch_size=local_batch, sampler=sampler,
                               drop_last=True, num_workers=self.cfg.data.num_workers)
        return DataLoader(dataset, batch_size=local_batch, sampler=sampler, drop_last=True,
                          num_workers=self.cfg.data.num_workers)

    def train_dataloader(self) -> DataLoader:
        # Indexed data is already in its (cached, shuffled) order: read it as it is.
        return self._loader(self.train_set, shuffle=self.cfg.data.name != "indexed", train=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)

    # -- the data position, in every checkpoint ----------------------------------------------------------
    def _consumed_samples(self) -> int:
        # One optimizer step = one global batch; at a save (after step N's batch) N global batches are consumed.
        step = self.trainer.global_step if self.trainer is not None else 0
        return step * self.cfg.parallel.global_batch_size

    def state_dict(self) -> dict:
        return {"consumed_samples": self._consumed_samples()}

    def load_state_dict(self, state: dict) -> None:
        self.consumed_samples = state.get("consumed_samples")
