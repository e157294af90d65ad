"""The LightningDataModule: text or indexed data -> token windows, split across data-parallel ranks per global batch.

- data=pydoc / data=text: the text is tokenized (data.tokenizer) into one stream; its last val_fraction is
  validation; each epoch is a seeded permutation of the windows (mlplat.data.sampler).
- data=indexed: the run's samples are the first max_steps·global_batch rows of a cached sample index
  (mlplat.data.indexed_windows), read in order: one pass covers the whole run, the index does the shuffling.

The data position is saved in every checkpoint as `consumed_samples` (the global batches already drawn), so a
resumed run continues with exactly the samples the uninterrupted run would have drawn next; the global order
does not depend on the data-parallel degree, so that holds across a change of dp too.
"""
from __future__ import annotations

import csv
from pathlib import Path

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader

from mlplat.config import RunConfig
from mlplat.data.corpus import load_corpus
from mlplat.data.dataset import StageView, TokenWindows, split_tokens
from mlplat.data.sampler import DataParallelSampler
from mlplat.data.tokenizer import load_tokenizer


class RecordingSampler(torch.utils.data.Sampler[int]):
    """Passes a sampler's ids through and appends each local batch to DIR/samples.csv as `step,id id ...`."""

    def __init__(self, sampler: DataParallelSampler, path: Path, one_pass: bool):
        # one_pass (indexed data): the run is one pass, whatever epoch number Lightning restores.
        self.sampler, self.path, self.one_pass = sampler, path, one_pass

    def __len__(self) -> int:
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __iter__(self):
        s = self.sampler
        epoch = 0 if self.one_pass else s.epoch
        step = s.steps_per_epoch * (epoch + 1) - len(s) // s.local_batch  # the step before the first one drawn
        batch = []
        for i in s:
            batch.append(i)
            if len(batch) == s.local_batch:  # recorded when drawn, before the loader hands the batch on
                step += 1
                with open(self.path, "a", newline="") as f:
                    csv.writer(f).writerow([step, " ".join(map(str, batch))])
                yield from batch
                batch = []


class TextDataModule(pl.LightningDataModule):
    def __init__(self, cfg: RunConfig):
        super().__init__()
        self.cfg = cfg
        self.tokenizer = load_tokenizer(cfg.data.tokenizer)
        self.consumed_samples: int | None = None  # from a checkpoint

    def setup(self, stage: str | None = None) -> None:
        d, m = self.cfg.data, self.cfg.model
        if d.name == "indexed":
            from mlplat.data.checks import data_sources
            from mlplat.data.indexed_windows import indexed_samples

            gb = self.cfg.parallel.global_batch_size
            sources = data_sources(self.cfg)
            self.train_set = indexed_samples(sources, d.split, "train", m.seq_len, self.cfg.trainer.max_steps * gb,
                                             self.cfg.seed, d.cache_dir)
            val_batches = max(1, self.cfg.trainer.limit_val_batches)
            self.val_set = indexed_samples(sources, d.split, "valid", m.seq_len, val_batches * gb, self.cfg.seed,
                                           d.cache_dir)
            return
        text = load_corpus(d.name, d.path)
        tokens = torch.tensor(self.tokenizer.encode(text), dtype=torch.long)
        train, val = split_tokens(tokens, d.val_fraction, m.seq_len)
        self.train_set = TokenWindows(train, m.seq_len)
        self.val_set = TokenWindows(val, m.seq_len)

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
        sampler = DataParallelSampler(len(dataset), global_batch, dp, dp_rank, shuffle=shuffle, seed=self.cfg.seed)
        if train and self.trainer is not None and self.trainer.global_step > 0:
            # Resuming: continue where the checkpoint left off (a plain sampler would start over and repeat data).
            consumed = self.consumed_samples
            if consumed is None:  # a checkpoint from before consumed_samples was saved
                consumed = self.trainer.global_step * global_batch
            sampler.skip_steps = consumed // global_batch
            if self.cfg.data.name != "indexed":  # text data: epochs of windows; indexed data: one pass per run
                sampler.skip_steps -= sampler.steps_per_epoch * self.trainer.current_epoch
        if grid is not None and grid.pp > 1:  # only the first chunk's rank reads tokens, the last chunk's labels
            layout = self.cfg.parallel.pipeline
            dataset = StageView(dataset, tokens=grid.pp_rank == layout.owner(0),
                                labels=grid.pp_rank == layout.owner(layout.last_chunk))
        if train and self.cfg.data.record_samples and (grid is None or grid.rank == 0):
            sampler = RecordingSampler(sampler, Path(self.trainer.default_root_dir) / "samples.csv",
                                       one_pass=self.cfg.data.name == "indexed")
        return DataLoader(dataset, batch_size=local_batch, sampler=sampler, drop_last=True,
                          num_workers=self.cfg.data.num_workers)

    def train_dataloader(self) -> DataLoader:
        # Indexed data is already in its (cached, shuffled) order: read it as it is.
        return self._loader(self.train_set, shuffle=self.cfg.data.name != "indexed", train=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)

    # -- the data position, in every checkpoint ----------------------------------------------------------
    def state_dict(self) -> dict:
        step = self.trainer.global_step if self.trainer is not None else 0
        return {"consumed_samples": step * self.cfg.parallel.global_batch_size}

    def load_state_dict(self, state: dict) -> None:
        self.consumed_samples = state.get("consumed_samples")
