"""The README's vocabulary table matches the code (issue 26 #4): each public entry point takes
the new names, maps the old ones (for 0.1) through ``_renamed.renamed``, and no public signature
still uses an old name."""

import inspect
import os
import pathlib

import pytest

import tensortier as tt
from tensortier import data, rl
from tensortier.checkpoint import Checkpointer
from tensortier.data import Catalog, EpochConfig, EpochDataset, Loader
from tensortier.errors import ConfigError
from tensortier.planner.runtime import planned_offload
from tensortier.rl.param_store import ParamReader
from tensortier.tiers import DiskStore, RemoteStore

README = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
TABLE = README.split("## Vocabulary: one name per concept", 1)[1].split("\n## ", 1)[0]

OFFLOADER = {
    "to": "tier",
    "disk_capacity": "disk_budget",
    "max_inflight": "inflight_budget",
    "prefetch": "prefetch_budget",
    "disk_io_threads": "io_threads",
}
BUFFER = {"capacity": "max_items", "ram_budget": "host_budget", "spill": "tier"}
RENAMED = {  # entry point -> {old: new}
    tt.Offloader.__init__: OFFLOADER,
    tt.offload: OFFLOADER,
    tt.offload_module: OFFLOADER,
    planned_offload: {
        "to": "tier",
        "prefetch": "prefetch_budget",
        "max_inflight": "inflight_budget",
    },
    tt.TransferEngine.__init__: {"max_inflight": "inflight_budget", "threads": "io_threads"},
    tt.DiskStore.__init__: {"capacity": "budget"},
    RemoteStore.__init__: {"capacity": "budget"},
    RemoteStore.prefetch: {"window": "prefetch_budget"},
    tt.OffloadedAdamW.__init__: {"states": "tier", "disk_capacity": "disk_budget"},
    rl.ReplayBuffer.__init__: BUFFER,
    rl.MemoryBank.__init__: BUFFER,
    rl.ReplayBuffer.save: {"dirname": "directory"},
    rl.ReplayBuffer.load: {"dirname": "directory", "ram_budget": "host_budget"},
    rl.ParamStore.__init__: {"shm_dir": "spill_dir"},
    rl.ParamStore.attach: {"path": "directory"},
    Catalog.__init__: {"path": "directory"},
    Catalog.build: {"path": "directory", "writers": "io_threads"},
    Catalog.open: {"path": "directory"},
    Catalog.epochs: {"prefetch": "prefetch_budget"},
    Loader.__init__: {"prefetch": "prefetch_budget"},
    EpochDataset.__init__: {"prefetch": "prefetch_budget"},
    EpochConfig.__init__: {"prefetch": "prefetch_budget"},
}
TAKES_KWARGS = {
    tt.offload,
    tt.offload_module,
    Catalog.epochs,
    Loader.__init__,
    EpochDataset.__init__,
}
# prefetch= (batches) stays; window= of a catalog's shuffle counts blocks (RemoteStore's was bytes)
OLD = {old for m in RENAMED.values() for old in m} - {"prefetch", "window"}


def test_the_counts_of_an_epoch_order_keep_their_names_and_take_ints_only():
    """``window=`` of a block shuffle counts blocks (not bytes, not items a store holds): the
    table's "item count limit" rule does not apply, it stays as its row says."""
    row = next(line for line in TABLE.splitlines() if line.startswith("| counts in an epoch"))
    params = inspect.signature(EpochConfig).parameters
    for name in ("batch", "block", "window"):
        assert f"`{name}=`" in row and name in params, name
    with pytest.raises(ConfigError, match=r"window='1MiB' must be an int"):
        EpochConfig(batch=8, shuffle="block", window="1MiB").checked(100, 100)


ATTRIBUTES = {  # class -> {old attribute: new}
    Checkpointer: {"root": "directory"},
    DiskStore: {"root": "directory"},
    rl.ParamStore: {"path": "directory"},
    ParamReader: {"path": "directory"},
}


@pytest.mark.parametrize("cls", ATTRIBUTES, ids=lambda c: c.__name__)
def test_each_renamed_attribute_reads_the_new_one_with_a_warning(cls, tmp_path):
    if cls is Checkpointer:
        obj = Checkpointer(tmp_path / "ck")
        assert obj.directory == str(tmp_path / "ck")
    elif cls is DiskStore:
        obj = DiskStore(tmp_path, budget="1MiB", io_threads=1)
        assert os.path.dirname(obj.directory) == str(tmp_path) and os.path.isdir(obj.directory)
    else:
        publisher = rl.ParamStore(spill_dir=tmp_path)
        obj = publisher if cls is rl.ParamStore else rl.ParamStore.attach(publisher.directory)
        assert os.path.dirname(obj.directory) == str(tmp_path)
    try:
        for old, new in ATTRIBUTES[cls].items():
            assert f"`.{new}`" in TABLE and f"`.{old}`" in TABLE
            with pytest.warns(DeprecationWarning, match=rf"{cls.__name__}\.{old} is now \.{new}"):
                assert getattr(obj, old) == getattr(obj, new)
    finally:
        obj.close()
        if cls is ParamReader:
            publisher.close()


@pytest.mark.parametrize("fn", RENAMED, ids=lambda f: f.__qualname__)
def test_each_entry_point_takes_the_new_names_and_maps_the_old(fn):
    assert fn.__renamed__ == RENAMED[fn]
    params = inspect.signature(fn).parameters
    for old, new in RENAMED[fn].items():
        assert old not in params, (fn, old)
        if fn not in TAKES_KWARGS:
            assert new in params, (fn, new)
        elif new not in params:  # passed on: to the Offloader or the EpochConfig
            target = tt.Offloader if fn in (tt.offload, tt.offload_module) else EpochConfig
            assert new in inspect.signature(target).parameters, (fn, new)


def test_the_readme_table_names_every_new_and_old_name():
    for mapping in RENAMED.values():
        for old, new in mapping.items():
            assert f"`{new}" in TABLE, new
            assert f"`{old}" in TABLE, old


def test_no_public_signature_keeps_an_old_name():
    """Every public class and function of tt, tt.rl and tt.data, and their public methods."""
    seen = []
    for mod in (tt, rl, data):
        for name in mod.__all__:
            obj = getattr(mod, name)
            if inspect.isclass(obj) and issubclass(obj, Exception):
                continue  # an error's path= names the file it is about
            fns = [obj]
            if inspect.isclass(obj):
                fns = [obj.__init__] + [
                    f for n, f in vars(obj).items() if not n.startswith("_") and callable(f)
                ]
            for f in fns:
                f = getattr(f, "__func__", f)
                try:
                    params = inspect.signature(f).parameters
                except (TypeError, ValueError):
                    continue
                bad = OLD & set(params)
                if f is tt.TransferEngine.from_store:  # to="host"|"device": where a read lands
                    bad -= {"to"}
                seen.append(f)
                assert not bad, (name, f, bad)
    assert len(seen) > 50
