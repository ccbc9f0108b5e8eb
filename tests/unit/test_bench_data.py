"""The benchmark corpus: fixed, disjoint train/validation split; same data order for every world size."""

import pytest
import torch

from shoal.bench.data import BLOCK, ByteCorpus, corpus_bytes, split_blocks
from shoal.errors import ConfigError


@pytest.fixture(scope="module")
def corpus() -> ByteCorpus:
    return ByteCorpus.load(window=129)


def test_corpus_is_python_docs_text() -> None:
    data = corpus_bytes()
    assert 300_000 < len(data) < 2_000_000
    assert b"The for statement" in data or b"for_stmt" in data


def test_split_is_disjoint_and_covers_every_block(corpus: ByteCorpus) -> None:
    train, val = set(corpus.train_ids), set(corpus.val_ids)
    assert not train & val
    assert train | val == set(range(corpus.blocks.shape[0]))
    assert 0.05 < len(val) / corpus.blocks.shape[0] < 0.15


def test_split_is_deterministic_and_independent_of_training_seed(corpus: ByteCorpus) -> None:
    again = ByteCorpus.load(window=65)  # another window, another process state
    torch.manual_seed(123)
    assert again.val_ids == corpus.val_ids
    assert split_blocks(200) == split_blocks(200)
    assert split_blocks(200)[1] != split_blocks(200, seed=1)[1]


def test_training_batches_never_read_validation_bytes(corpus: ByteCorpus) -> None:
    assert not corpus.source_offsets("val") & corpus.source_offsets("train")
    val_rows = {tuple(r.tolist()) for r in corpus.val_windows()}
    batch = corpus.train_batch(step=3, seed=7, global_batch=64, rank=0, world=1)
    assert not any(tuple(row.tolist()) in val_rows for row in batch)


def test_window_stays_inside_one_train_block(corpus: ByteCorpus) -> None:
    batch = corpus.train_batch(step=11, seed=2, global_batch=32, rank=0, world=1)
    blocks = corpus.blocks.long()
    for row in batch:
        found = False
        for b in corpus.train_ids:
            block = blocks[b]
            hits = (block[: BLOCK - 128] == row[0]).nonzero().flatten()
            if any(torch.equal(block[i : i + 129], row) for i in hits.tolist()):
                found = True
                break
        assert found, "a training window is not a slice of a single training block"


def test_rank_slices_concatenate_to_the_global_batch(corpus: ByteCorpus) -> None:
    whole = corpus.train_batch(step=5, seed=1, global_batch=32, rank=0, world=1)
    for world in (2, 4):
        parts = [corpus.train_batch(5, 1, 32, r, world) for r in range(world)]
        assert torch.equal(torch.cat(parts), whole)


def test_batches_depend_on_seed_and_step_only(corpus: ByteCorpus) -> None:
    a = corpus.train_batch(0, 1, 8, 0, 1)
    torch.manual_seed(999)  # the global RNG must not matter
    assert torch.equal(a, corpus.train_batch(0, 1, 8, 0, 1))
    assert not torch.equal(a, corpus.train_batch(1, 1, 8, 0, 1))
    assert not torch.equal(a, corpus.train_batch(0, 2, 8, 0, 1))


def test_validation_windows_fixed_and_subset_evenly_spaced(corpus: ByteCorpus) -> None:
    full = corpus.val_windows()
    sub = corpus.val_windows(16)
    assert sub.shape == (16, 129)
    assert torch.equal(sub[0], full[0]) and torch.equal(sub[-1], full[-1])
    assert torch.equal(sub, corpus.val_windows(16))


def test_bad_arguments_raise_config_errors(corpus: ByteCorpus) -> None:
    with pytest.raises(ConfigError, match="divisible"):
        corpus.train_batch(0, 0, 10, 0, 4)
    with pytest.raises(ConfigError, match="window"):
        ByteCorpus(corpus.blocks, corpus.train_ids, corpus.val_ids, window=BLOCK + 1)
    with pytest.raises(ConfigError):
        split_blocks(10, val_fraction=1.5)


def test_a_sample_stream_reads_the_same_windows_however_steps_cut_it(corpus: ByteCorpus) -> None:
    # 4 workers x 8, then 3 survivors x 11 (a global batch of 32 after a kill): the same windows in order.
    whole = corpus.samples(5, list(range(64)))
    cut = torch.cat([corpus.samples(5, list(range(a, b))) for a, b in ((0, 8), (8, 19), (19, 30), (30, 64))])
    assert torch.equal(whole, cut)
    assert whole.shape == (64, 129) and whole.dtype == torch.int64
    assert len({tuple(r.tolist()) for r in whole}) == 64   # distinct windows, not one repeated
    assert not torch.equal(whole, corpus.samples(6, list(range(64))))   # another stream, other windows
    val_rows = {tuple(r.tolist()) for r in corpus.val_windows()}
    assert not any(tuple(row.tolist()) in val_rows for row in whole)
    with pytest.raises(ConfigError, match="at least one"):
        corpus.samples(5, [])
    with pytest.raises(ConfigError, match=">= 0"):
        corpus.samples(5, [3, -1])
