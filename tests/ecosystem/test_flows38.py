"""Whole user flows with third-party code, each against the same flow in plain PyTorch bit for bit:
a Hugging Face ``datasets`` dataset read through a catalog by DataLoader workers into training,
accelerate's ``Accelerator`` with ``tt.offload`` and ``OffloadedAdamW`` through
``save_state``/``load_state``, and what a loader's workers do when the catalog's directory goes.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import shutil

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import tensortier as tt
from tensortier.errors import CorruptDataError
from tests.ecosystem._hf import BATCH, SEQ, VOCAB, assert_same_params, batch, build, twin

datasets = pytest.importorskip("datasets")


# ----------------------------------------------------------------------------- data pipeline
def _hf_rows(n: int = 48) -> datasets.Dataset:
    """A tokenized dataset as ``map(tokenizer)`` leaves it: int32 ids, a mask, labels."""
    g = np.random.default_rng(3)
    ids = g.integers(0, VOCAB, (n, SEQ)).astype(np.int32)
    features = datasets.Features(
        {
            "input_ids": datasets.Sequence(datasets.Value("int32")),
            "attention_mask": datasets.Sequence(datasets.Value("int8")),
        }
    )
    rows = {"input_ids": ids.tolist(), "attention_mask": np.ones_like(ids).tolist()}
    return datasets.Dataset.from_dict(rows, features=features)


def collate(rows: list[dict]) -> dict[str, torch.Tensor]:
    """Module level (spawned workers pickle it): the model's int64 batch from either source."""
    ids = torch.stack([torch.as_tensor(np.asarray(r["input_ids"]), dtype=torch.long) for r in rows])
    mask = torch.stack(
        [torch.as_tensor(np.asarray(r["attention_mask"]), dtype=torch.long) for r in rows]
    )
    return {"input_ids": ids, "attention_mask": mask, "labels": ids}


def _fit(model: torch.nn.Module, batches) -> list[torch.Tensor]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    seen = []
    for b in batches:
        model(**b).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        seen.append(b["input_ids"])
    return seen


def test_hf_dataset_through_a_catalog_and_two_workers_trains_as_hf_itself(tmp_path):
    """HF ``datasets`` -> ``Catalog.build`` -> ``DataLoader(CatalogDataset, num_workers=2)``
    with a seeded shuffle, and ``cat.epochs(num_workers=2)``: the same batches, in the same
    order, as the HF dataset through the same sampler (or indexed by the epoch's indices), and
    a GPT-2 trained on them ends on the same bits."""
    hf = _hf_rows()
    cat = tt.data.Catalog.build(tmp_path / "tok", hf)
    try:

        def loader(ds, workers: int) -> DataLoader:
            g = torch.Generator().manual_seed(11)
            return DataLoader(ds, batch_size=BATCH, shuffle=True, generator=g, collate_fn=collate,
                              num_workers=workers, multiprocessing_context="fork" if workers else None)  # fmt: skip

        ref = build("gpt2")
        got = twin(ref)
        want = _fit(ref, loader(hf, 0))
        seen = _fit(got, loader(tt.data.CatalogDataset(cat), 2))
        assert len(seen) == len(want) == len(hf) // BATCH
        assert all(torch.equal(a, b) for a, b in zip(seen, want, strict=True))
        assert_same_params(got, ref)

        epoch = list(cat.epochs(batch=BATCH, seed=5, num_workers=2, collate=collate))
        order = np.concatenate([b.indices for b in epoch])
        assert sorted(order.tolist()) == list(range(len(hf)))
        for b in epoch:
            want_ids = collate([hf[int(i)] for i in b.indices])["input_ids"]
            assert torch.equal(b.data["input_ids"], want_ids)
    finally:
        cat.close()


@pytest.mark.parametrize("how", ["epoch_dataset", "catalog_dataset"])
def test_spawned_workers_of_a_deleted_catalog_raise_why(tmp_path, how):
    """Stop 36's lead: the catalog's directory removed while a loader trains on it; the next
    epoch's spawned workers reopen it by path. They died while unpickling, and the DataLoader
    said only "worker exited unexpectedly" seconds later; a forked worker already raised the
    ``CorruptDataError`` that names the cause (``test_catalog.py``). Now both do."""
    cat = tt.data.Catalog.build(tmp_path / "c", [{"x": np.arange(i, i + 8)} for i in range(64)])
    try:
        if how == "epoch_dataset":
            ds = tt.data.EpochDataset(cat, batch=8, seed=0)
            dl = DataLoader(ds, batch_size=None, num_workers=1, multiprocessing_context="spawn")
        else:
            dl = DataLoader(tt.data.CatalogDataset(cat), batch_size=8, num_workers=1,
                            multiprocessing_context="spawn", collate_fn=list)  # fmt: skip
        shutil.rmtree(tmp_path / "c")
        with pytest.raises(CorruptDataError, match="deleted or replaced after it was opened"):
            next(iter(dl))
    finally:
        cat.close()


def _run_from(model, cat, spill_dir, *, workers: int, ck_dir=None, stop: int = 16) -> list[float]:
    """A user's loop over ``cat.epochs`` for 16 steps (two epochs), with dropout: plain (no
    ``ck_dir``: fused AdamW, nothing offloaded) or tensortier's (``OffloadedAdamW``, the forward
    under ``tt.offload``, a ``Checkpointer`` keeping the loader's state in ``extra``, restored
    first when it holds a step) up to step ``stop``. The losses."""
    plain = ck_dir is None
    if plain:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    else:
        opt = tt.OffloadedAdamW(model.parameters(), lr=1e-2, tier="disk", spill_dir=spill_dir)
    loader = cat.epochs(batch=BATCH, seed=3, num_workers=workers, collate=collate,
                        multiprocessing_context="fork" if workers else None)  # fmt: skip
    ck = None if plain else tt.Checkpointer(ck_dir, keep=2, every=5)
    off = contextlib.nullcontext() if plain else tt.offload(tier="disk", spill_dir=spill_dir)
    torch.manual_seed(0)  # dropout; a restore puts back the saved step's RNG state
    state = None if plain else ck.restore(model=model, optimizer=opt)
    step = 0 if state is None else state.step
    if state is not None:
        loader.load_state_dict(state.extra["loader"])
    losses = []
    try:
        while step < stop:
            for b in itertools.islice(loader, stop - step):
                with off:
                    loss = model(**b.data).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(loss.item())
                if ck is not None:
                    ck.maybe_save(step, model=model, optimizer=opt,
                                  extra={"loader": loader.state_dict()})  # fmt: skip
                step += 1
    finally:
        for c in (ck, off, opt):
            getattr(c, "close", lambda: None)()
    return losses


def test_a_loader_with_workers_resumed_mid_epoch_trains_on_with_the_same_dropout(
    tmp_path, spill_dir
):
    """Catalog batches from two DataLoader workers, a GPT-2 with dropout under ``tt.offload`` and
    ``OffloadedAdamW``, checkpointed with the loader's state, stopped mid-epoch and resumed from
    the checkpoint: the same losses and weights as plain training over the same loader read in
    this process. Every epoch's DataLoader drew its worker seed from torch's global generator,
    so with workers the dropout masks after a resume (and those of any run with workers against
    one without) were other masks: README's "exact resume, any num_workers"."""
    cat = tt.data.Catalog.build(tmp_path / "tok", _hf_rows(32))
    try:
        ref = build("gpt2", dropout=0.1)
        got = twin(ref)
        want = _run_from(ref, cat, spill_dir, workers=0)
        first = _run_from(got, cat, spill_dir, workers=2, ck_dir=tmp_path / "ck", stop=10)
        rest = _run_from(got, cat, spill_dir, workers=2, ck_dir=tmp_path / "ck")
    finally:
        cat.close()
    assert (len(first), len(rest)) == (10, 6)  # resumed 2 batches into epoch 1
    assert first + rest == want
    assert_same_params(got, ref)


# ----------------------------------------------------------------------------- accelerate
@pytest.fixture
def accelerate_state():
    """accelerate keeps one process-wide state (mixed precision included) that an earlier
    Trainer set: reset it before (bf16 is refused otherwise) and after (for the next Trainer)."""
    state = pytest.importorskip("accelerate.state")
    state.AcceleratorState._reset_state(reset_partial_state=True)
    yield
    state.AcceleratorState._reset_state(reset_partial_state=True)


def _accelerated(model, opt, spill_dir, *, save=None, load=None) -> list[float]:
    """The accelerate README loop on CPU under bf16 mixed precision: ``prepare``, accumulation
    over two batches, ``clip_grad_norm_`` on the synced step, ``save_state`` at the end or
    ``load_state`` first; with ``spill_dir``, each forward under ``tt.offload``. Losses and
    gradient norms."""
    from accelerate import Accelerator

    acc = Accelerator(cpu=True, gradient_accumulation_steps=2, mixed_precision="bf16")
    rows = [{k: v[i] for k, v in batch("llama", j).items()} for j in range(3) for i in range(BATCH)]
    dl = DataLoader(rows, batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(0))
    model, opt, dl = acc.prepare(model, opt, dl)
    if load is not None:
        acc.load_state(load)
    off = tt.offload(tier="disk", spill_dir=spill_dir) if spill_dir else contextlib.nullcontext()
    torch.manual_seed(7)
    out = []
    try:
        for b in dl:
            with acc.accumulate(model):
                with off:
                    loss = model(**b).loss
                acc.backward(loss)
                if acc.sync_gradients:
                    out.append(acc.clip_grad_norm_(model.parameters(), 0.5).item())
                opt.step()
                opt.zero_grad()
            out.append(loss.item())
    finally:
        getattr(off, "close", lambda: None)()
    if save is not None:
        acc.save_state(save)
    return out


def test_accelerate_bf16_accumulation_clipping_and_state_round_trip(
    tmp_path, spill_dir, accelerate_state
):
    """accelerate's ``Accelerator`` (no test used it directly) with ``OffloadedAdamW`` prepared and
    the forward under ``tt.offload``: the same losses, norms and weights as with fused AdamW, and
    after ``save_state`` / ``load_state`` into fresh models and optimizers, again."""
    ref = build("llama", dropout=0.1)
    got = twin(ref)
    fused = functools.partial(torch.optim.AdamW, lr=1e-2, fused=True)
    offloaded = functools.partial(tt.OffloadedAdamW, lr=1e-2, tier="disk", spill_dir=spill_dir)
    want = _accelerated(ref, fused(ref.parameters()), None, save=tmp_path / "ref")
    with offloaded(got.parameters()) as opt:
        assert _accelerated(got, opt, spill_dir, save=tmp_path / "tt") == want
    assert_same_params(got, ref)
    ref2, got2 = twin(ref), twin(ref)
    want = _accelerated(ref2, fused(ref2.parameters()), None, load=tmp_path / "ref")
    with offloaded(got2.parameters()) as opt:
        assert _accelerated(got2, opt, spill_dir, load=tmp_path / "tt") == want
    assert_same_params(got2, ref2)
