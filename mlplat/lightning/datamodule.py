"""The LightningDataModule: text -> byte tokens -> windows, split across data-parallel ranks per global batch."""
from __future__ import annotations

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader

from mlplat.config import RunConfig
from mlplat.data.corpus import load_corpus
from mlplat.data.dataset import StageView, TokenWindows, split_tokens
from mlplat.data.sampler import DataParallelSampler
from mlplat.data.tokenizer import ByteTokenizer


class TextDataModule(pl.LightningDataModule):
    def __init__(self, cfg: RunConfig):
        super().__init__()
        self.cfg = cfg
        self.tokenizer = ByteTokenizer()

    def setup(self, stage: str | None = None) -> None:
        text = load_corpus(self.cfg.data.name, self.cfg.data.path)
        tokens = torch.tensor(self.tokenizer.encode(text), dtype=torch.long)
        train, val = split_tokens(tokens, self.cfg.data.val_fraction, self.cfg.model.seq_len)
        self.train_set = TokenWindows(train, self.cfg.model.seq_len)
        self.val_set = TokenWindows(val, self.cfg.model.seq_len)

    def _grid(self):
        strategy = self.trainer.strategy if self.trainer is not None else None
        return getattr(strategy, "grid", None)

    def _loader(self, dataset, shuffle: bool) -> DataLoader:
        p = self.cfg.parallel
        grid = self._grid()
        dp, dp_rank = (grid.dp, grid.dp_rank) if grid is not None else (p.dp or 1, 0)
        # Validation runs the same pipeline schedule, so it uses the same global batch (m micro-batches).
        global_batch = p.global_batch_size
        local_batch = global_batch // dp
        sampler = DataParallelSampler(len(dataset), global_batch, dp, dp_rank, shuffle=shuffle, seed=self.cfg.seed)
        if grid is not None and grid.pp > 1:  # only the first stage reads tokens, only the last reads labels
            dataset = StageView(dataset, tokens=grid.is_first_stage, labels=grid.is_last_stage)
        return DataLoader(dataset, batch_size=local_batch, sampler=sampler, drop_last=True,
                          num_workers=self.cfg.data.num_workers)

    def train_dataloader(self) -> DataLoader:
        loader = self._loader(self.train_set, shuffle=True)
        if self.trainer is not None and self.trainer.global_step > 0:
            # Resuming: continue the epoch where the checkpoint left it (Lightning restores the step and the
            # epoch; a plain sampler would start the epoch over and repeat data).
            sampler = loader.sampler
            sampler.skip_steps = self.trainer.global_step - sampler.steps_per_epoch * self.trainer.current_epoch
        return loader

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)
