"""Byte-level text corpus, datasets, a deterministic rank-aware sampler and a LightningDataModule.

The default corpus is the Python standard library's own source (present on every machine, no
download). Tokenisation is the identity on bytes (vocabulary 256), or a ``transformers`` tokenizer from a local
directory (``tokenizer=``, what ``save_pretrained`` wrote: a Hugging Face model's own).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_zero.models.corpus import chunk_count, load_corpus, split_corpus
from lightning_zero.models.corpus import list_corpus_files as list_corpus_files  # the documented path
from lightning_zero.models.corpus import stdlib_path as stdlib_path

VOCAB_SIZE = 256


def markov_corpus(num_bytes: int, seed: int = 0, branching: int = 4) -> torch.Tensor:
    """A synthetic, learnable byte stream: a seeded Markov chain where each byte has ``branching`` successors.

    Its entropy rate is at most ``log(branching)`` nats, far below ``log(256)``, so a model learns it fast.
    """
    g = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, VOCAB_SIZE, (VOCAB_SIZE, branching), generator=g)
    choices = torch.randint(0, branching, (num_bytes,), generator=g).tolist()
    table = successors.tolist()
    out = [int(torch.randint(0, VOCAB_SIZE, (1,), generator=g))]
    for c in choices[1:]:
        out.append(table[out[-1]][c])
    return torch.tensor(out, dtype=torch.uint8)


class TokenChunkDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Contiguous chunks of ``seq_len + 1`` bytes at stride ``seq_len``; item = (inputs, inputs shifted by 1)."""

    def __init__(self, data: torch.Tensor, seq_len: int, max_samples: int | None = None) -> None:
        self.data = data
        self.seq_len = seq_len
        n = chunk_count(len(data), seq_len)
        if max_samples is not None and n > max_samples:
            self.starts = torch.linspace(0, n - 1, max_samples).long() * seq_len  # evenly spread subset
        else:
            self.starts = torch.arange(n) * seq_len

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = int(self.starts[i])
        chunk = self.data[s : s + self.seq_len + 1].long()
        return chunk[:-1], chunk[1:]


class RandomTokenDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Tiny uniformly random token sequences, fully determined by ``seed`` (for shape/throughput tests)."""

    def __init__(self, num_samples: int, seq_len: int, vocab_size: int = VOCAB_SIZE, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, vocab_size, (num_samples, seq_len + 1), generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tokens[i, :-1], self.tokens[i, 1:]


class DeterministicShardSampler(DistributedSampler):
    """Seeded, epoch-dependent, rank-sharded sampler.

    Each epoch the indices are permuted with ``torch.Generator().manual_seed(seed + epoch)`` (or kept in
    order if ``shuffle=False``), cut to a multiple of ``num_replicas`` (``drop_last``) or padded by
    wrapping around, and rank ``r`` takes positions ``r, r + W, r + 2W, ...``. Ranks are therefore
    disjoint and together cover the (trimmed) permutation, and the union of the ranks' ``k``-th
    micro-batches of size ``B`` is exactly the ``k``-th batch of size ``W * B`` of a single-process run:
    runs with different world sizes see the same global batches. It subclasses ``DistributedSampler``
    so Lightning neither replaces nor re-wraps it, and calls ``set_epoch`` on it every epoch.
    """

    def __init__(
        self,
        dataset_len: int,
        num_replicas: int = 1,
        rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
    ) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} not in [0, {num_replicas})")
        # deliberately not calling DistributedSampler.__init__: it needs a dataset and may query dist
        self.dataset_len = dataset_len
        self.dataset = range(dataset_len)  # for code that inspects ``sampler.dataset``
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        if drop_last:
            self.num_samples = dataset_len // num_replicas
        else:
            self.num_samples = math.ceil(dataset_len / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def global_order(self) -> list[int]:
        """The epoch's global index order (length ``total_size``) before sharding."""
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.dataset_len, generator=g).tolist()
        else:
            order = list(range(self.dataset_len))
        if self.total_size > len(order) and order:
            reps = math.ceil(self.total_size / len(order))
            order = (order * reps)[: self.total_size]
        return order[: self.total_size]

    def __iter__(self) -> Iterator[int]:
        return iter(self.global_order()[self.rank :: self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose permutation is used next."""
        self.epoch = epoch


class ResumableLoader(DataLoader):
    """A training DataLoader that resumes mid-epoch where its checkpoint was written.

    Note [resumable loader]: Lightning saves a loader's ``state_dict()`` with every checkpoint and hands
    it to ``load_state_dict`` before the resumed fit iterates; without them it restarts the epoch, so a
    resumed run sees other batches than the uninterrupted one. The state is the number of batches of
    this epoch the fit has processed, read from the trainer's progress (``batches_done``), not counted
    here: Lightning fetches a batch ahead, so the loader itself has yielded one more. The sampler's
    order is the same again (its epoch is restored), so skipping that many batches continues exactly.
    """

    def __init__(self, dataset: Dataset, *args: Any, batches_done: Callable[[], int] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(dataset, *args, **kwargs)
        self.batches_done = batches_done
        self._skip = 0

    def state_dict(self) -> dict[str, int]:
        return {"batches": int(self.batches_done()) if self.batches_done is not None else 0}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._skip = int(state.get("batches", 0))

    def __iter__(self) -> Any:
        iterator = super().__iter__()
        skip, self._skip = self._skip, 0  # once: the next epochs start at their beginning
        for _ in range(min(skip, len(self))):
            next(iterator)
        return iterator


def trainer_shard(module: LightningDataModule) -> tuple[int, int]:
    """(num_replicas, rank) of the data-parallel group from the attached trainer; (1, 0) without one."""
    trainer = getattr(module, "trainer", None)
    if trainer is None:
        return 1, 0
    kwargs = getattr(trainer, "distributed_sampler_kwargs", None)
    if kwargs:
        return int(kwargs.get("num_replicas", 1)), int(kwargs.get("rank", 0))
    return int(trainer.world_size), int(trainer.global_rank)


class ShardedDataModule(LightningDataModule):
    """The loaders of the experiments' DataModules: micro-batches of ``train_dataset`` /
    ``val_dataset`` (set in ``setup``), shuffled for training, or with ``deterministic_order`` our
    rank-aware :class:`DeterministicShardSampler` (Lightning leaves a loader with a sampler alone).

    Saves the hyperparameters: the subclass's ``__init__`` arguments (Lightning collects them from
    every ``__init__`` up the call chain).
    """

    def __init__(self, micro_batch_size: int, num_workers: int, seed: int, deterministic_order: bool) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.micro_batch_size = micro_batch_size
        self.num_workers = num_workers
        self.seed = seed
        self.deterministic_order = deterministic_order
        self.train_dataset: Dataset | None = None
        self.val_dataset: Dataset | None = None

    def _batches_done(self) -> int:
        """Batches of the current epoch the fit has processed (the training loader's resume point)."""
        trainer = getattr(self, "trainer", None)
        return 0 if trainer is None else int(trainer.fit_loop.epoch_loop.batch_progress.current.processed)

    def _loader(self, dataset: Dataset, sampler: DistributedSampler | None, shuffle: bool) -> DataLoader:
        extra = {"batches_done": self._batches_done} if shuffle else {}  # the training loader resumes
        return (ResumableLoader if shuffle else DataLoader)(
            dataset,
            batch_size=self.micro_batch_size,
            sampler=sampler,
            shuffle=shuffle if sampler is None else False,
            num_workers=self.num_workers,
            drop_last=shuffle,
            persistent_workers=self.num_workers > 0,
            **extra,
        )

    def _split_loader(self, train: bool) -> DataLoader:
        self.setup("fit" if train else "validate")
        dataset = self.train_dataset if train else self.val_dataset
        assert dataset is not None
        sampler = None
        if self.deterministic_order:  # training: shuffled, whole batches; validation: in order, padded
            world, rank = trainer_shard(self)
            sampler = DeterministicShardSampler(len(dataset), world, rank, shuffle=train, seed=self.seed,
                                                drop_last=train)
        return self._loader(dataset, sampler, shuffle=train)

    def train_dataloader(self) -> DataLoader:
        """Training loader; with ``deterministic_order`` it carries its own rank-aware sampler."""
        return self._split_loader(train=True)

    def val_dataloader(self) -> DataLoader:
        """Validation loader (in order; with ``deterministic_order`` sharded by our sampler, padded)."""
        return self._split_loader(train=False)

    def test_dataloader(self) -> DataLoader:
        """The held-out split again (``lightning-zero test``): there is no third split."""
        return self._split_loader(train=False)

    def predict_dataloader(self) -> DataLoader:
        """The held-out split (``lightning-zero predict``)."""
        return self._split_loader(train=False)


class TextDataModule(ShardedDataModule):
    """Byte-level language-modelling data: stdlib source (default), a user file/directory, or synthetic.

    Args:
        seq_len: tokens per sample (inputs); each sample reads ``seq_len + 1`` bytes.
        micro_batch_size: per-process batch size.
        num_workers: DataLoader workers.
        max_bytes: cap on the corpus size (bytes) read from disk.
        path: corpus file or directory; ``None`` = the Python standard library.
        val_fraction: last fraction of the corpus held out for validation.
        seed: seed of the train order (and of the synthetic corpus).
        deterministic_order: use :class:`DeterministicShardSampler` for training (exactly reproducible,
            world-size-consistent global batches) instead of Lightning's injected shuffled sampler.
        max_val_samples: evaluate on at most this many evenly spaced validation chunks (``None`` = all).
        synthetic: use :func:`markov_corpus` (``max_bytes`` bytes) instead of files.
        pattern: filename glob for directory corpora.
        tokenizer: a local directory holding a ``transformers`` tokenizer: the corpus (decoded as UTF-8) is its
            token ids, split and chunked like bytes (``None``: bytes).
    """

    def __init__(
        self,
        seq_len: int = 128,
        micro_batch_size: int = 8,
        num_workers: int = 0,
        max_bytes: int | None = 8_000_000,
        path: str | None = None,
        val_fraction: float = 0.05,
        seed: int = 0,
        deterministic_order: bool = False,
        max_val_samples: int | None = 128,
        synthetic: bool = False,
        pattern: str | None = None,
        tokenizer: str | None = None,
    ) -> None:
        super().__init__(micro_batch_size, num_workers, seed, deterministic_order)
        self.seq_len = seq_len
        self.max_bytes = max_bytes
        self.path = path
        self.val_fraction = val_fraction
        self.max_val_samples = max_val_samples
        self.synthetic = synthetic
        self.pattern = pattern
        self.tokenizer = tokenizer
        self.vocab_size = VOCAB_SIZE

    def setup(self, stage: str | None = None) -> None:
        """Load and split the corpus (idempotent)."""
        if self.train_dataset is not None:
            return
        if self.synthetic:
            data = markov_corpus(self.max_bytes or 1_000_000, seed=self.seed)
        else:
            data = load_corpus(self.path, self.max_bytes, self.pattern)
        if self.tokenizer is not None:
            data, self.vocab_size = tokenize(data, self.tokenizer)
        train, val = split_corpus(data, self.val_fraction)
        self.train_dataset = TokenChunkDataset(train, self.seq_len)
        self.val_dataset = TokenChunkDataset(val, self.seq_len, self.max_val_samples)


def tokenize(data: torch.Tensor, tokenizer: str) -> tuple[torch.Tensor, int]:
    """The token ids (``int32``) of a byte corpus decoded as UTF-8, by the tokenizer saved in directory
    ``tokenizer`` (no special tokens added), and the tokenizer's vocabulary size."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    ids = tok(bytes(data.numpy()).decode("utf-8", errors="replace"), add_special_tokens=False)["input_ids"]
    if len(ids) < 2:
        raise ValueError(f"the corpus is {len(ids)} token(s) long with the tokenizer of {tokenizer}")
    return torch.tensor(ids, dtype=torch.int32), len(tok)


def log_train_loss(module: Any, loss: torch.Tensor, batch_size: int) -> None:
    """``self.log("train_loss", ...)`` of the experiment modules: into ``callback_metrics`` always; into the
    loggers and the progress bar only when no ``ZeroStatsMonitor`` runs, since that one logs the training
    loss already (its mean over ranks, ``train/loss``), and one loss per dashboard is enough."""
    from lightning_zero.observability.callbacks import ZeroStatsMonitor

    trainer = module._trainer
    monitored = trainer is not None and any(isinstance(c, ZeroStatsMonitor) for c in trainer.callbacks)
    module.log("train_loss", loss, prog_bar=not monitored, logger=not monitored, batch_size=batch_size)


class NextTokenSteps:
    """The training and validation steps of the language models (a mixin of a LightningModule with
    ``loss(batch)``): the mean next-token loss of an ``(inputs, targets)`` batch, logged as ``train_loss``
    (:func:`log_train_loss`) and ``val_loss`` (synchronised over the ranks). Training minimises
    :meth:`training_loss` (the loss, plus what a model adds to it: the GPT's MoE router losses)."""

    def training_loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.loss(batch)  # type: ignore[attr-defined]

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.training_loss(batch)
        log_train_loss(self, loss, batch[0].size(0))
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)  # type: ignore[attr-defined]
        self.log("val_loss", loss, prog_bar=True, sync_dist=True, batch_size=batch[0].size(0))  # type: ignore[attr-defined]
        return loss
