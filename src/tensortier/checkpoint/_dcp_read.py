"""Reading a DCP checkpoint someone else wrote without running code from it (``import_dcp``).

DCP stores two kinds of pickle: the directory's ``.metadata`` (a ``Metadata`` dataclass tree,
which ``FileSystemReader`` reads with a plain ``pickle.load``) and each non-tensor entry of the
state dict (which ``DefaultLoadPlanner.load_bytes`` reads with ``torch.load(weights_only=False)``).
Either runs any code a crafted checkpoint names. Here:

- ``.metadata`` is unpickled by :class:`_MetadataUnpickler`, whose ``find_class`` resolves only
  the 13 globals DCP's metadata holds (its dataclasses, ``torch.Size``, dtypes, how torch pickles
  a layout, the ``pathlib`` path of ``StorageMeta.checkpoint_id``) and refuses every other one;
  the result is then checked to be a ``Metadata`` whose data files lie inside the directory.
- non-tensor entries are read with ``torch.load(weights_only=True)`` (torch's own allow-list:
  numbers, strings, containers, tensors), as DCP already reads tensors.

A refusal, damaged files and every error DCP raises (its ``CheckpointException`` derives from
``BaseException``) become :class:`CorruptDataError`. Must never call ``pickle.load`` on these
files unrestricted, nor ``torch.load`` with ``weights_only=False`` on bytes it did not write.
"""

from __future__ import annotations

import io
import os
import pickle

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from tensortier.errors import ConfigError, CorruptDataError, TensortierError

METADATA = ".metadata"  # DCP's name for the global metadata file (filesystem.py)
_MD = "torch.distributed.checkpoint.metadata"
ALLOWED = frozenset(
    {
        (_MD, "Metadata"),
        (_MD, "TensorStorageMetadata"),
        (_MD, "BytesStorageMetadata"),
        (_MD, "ChunkStorageMetadata"),
        (_MD, "TensorProperties"),
        (_MD, "MetadataIndex"),
        (_MD, "StorageMeta"),
        (_MD, "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # a torch.layout pickles as _get_layout("...")
        ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id (Python < 3.13)
        ("pathlib._local", "PosixPath"),  # the same, pickled by Python >= 3.13
    }
)


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the globals DCP's metadata is made of (``ALLOWED`` and torch dtypes)."""

    def find_class(self, module: str, name: str):
        if (module, name) in ALLOWED:
            return super().find_class(module, name)
        # torch.__dict__, not getattr: torch's module __getattr__ would import submodules
        if module == "torch" and isinstance(torch.__dict__.get(name), torch.dtype):
            return torch.__dict__[name]
        raise pickle.UnpicklingError(
            f"it names the global {module}.{name}, which DCP metadata never holds; refused "
            f"without running it"
        )


def read_metadata(dcp_dir: str) -> Metadata:
    """``dcp_dir/.metadata`` through the allow-list, checked to be DCP metadata of files inside
    ``dcp_dir``. ConfigError if there is none; CorruptDataError if it is anything else."""
    path = os.path.join(dcp_dir, METADATA)
    if not os.path.isfile(path):
        raise ConfigError(
            f"{dcp_dir!r} holds no DCP checkpoint (no {METADATA} file); pass the directory "
            f"torch.distributed.checkpoint.save wrote"
        )
    try:
        with open(path, "rb") as f:
            md = _MetadataUnpickler(f).load()
    except OSError as exc:
        raise ConfigError(f"cannot read {path!r} ({exc.strerror}); fix its permissions") from exc
    except Exception as exc:  # refused global, truncated or garbage pickle, bad state
        raise CorruptDataError(f"not DCP metadata tensortier can read: {exc}", path=path) from exc
    if (
        not isinstance(md, Metadata)
        or not isinstance(md.state_dict_metadata, dict)
        or not isinstance(md.storage_data, dict)
        or not isinstance(md.storage_meta, StorageMeta | None)
    ):
        raise CorruptDataError(f"not DCP metadata (a {type(md).__name__})", path=path)
    for info in md.storage_data.values():
        where = getattr(info, "relative_path", None)
        if (
            not isinstance(info, _StorageInfo)
            or not isinstance(where, str)
            or os.path.isabs(where)
            or os.path.normpath(where).split(os.sep)[0] == ".."
        ):
            raise CorruptDataError(
                f"DCP metadata names the data file {where!r}, which is not a file of the "
                f"checkpoint directory",
                path=path,
            )
    return md


class _Reader(FileSystemReader):
    """DCP's file reader, handed the metadata ``read_metadata`` checked (never pickle.load)."""

    def __init__(self, dcp_dir: str, metadata: Metadata):
        super().__init__(dcp_dir)
        self._metadata = metadata

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class _Planner(_EmptyStateDictLoadPlanner):
    """DCP's planner for an empty state dict, reading non-tensor entries weights-only."""

    def __init__(self, dcp_dir: str):
        super().__init__()
        self._dir = dcp_dir

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            why = next((x for x in str(exc).splitlines() if "unsupported" in x.lower()), "")
            raise CorruptDataError(
                f"DCP entry {fqn!r} is a pickled Python object that torch.load(weights_only=True) "
                f"refuses ({why.strip() or exc}); tensortier never runs code from a checkpoint. "
                f"Store tensors and plain values, or allow the class you trust with "
                f"torch.serialization.safe_globals([...]) around import_dcp",
                path=self._dir,
            ) from exc
        except Exception as exc:
            raise CorruptDataError(
                f"DCP entry {fqn!r} is unreadable: {exc}", path=self._dir
            ) from exc
        # DCP's own placement of the value (flattened keys): it unpickles only these bytes,
        # written here from a value that passed the weights-only check
        mine = io.BytesIO()
        torch.save(obj, mine)
        mine.seek(0)
        super().load_bytes(read_item, mine)


def read_dcp(dcp_dir: str) -> dict:
    """The full state dict of the DCP checkpoint in ``dcp_dir`` (one process, full tensors)."""
    md = read_metadata(dcp_dir)
    state: dict = {}  # filled from the metadata, as torch's own dcp_to_torch_save does
    try:
        _load_state_dict(
            state, storage_reader=_Reader(dcp_dir, md), planner=_Planner(dcp_dir), no_dist=True
        )
    except TensortierError:
        raise
    except CheckpointException as exc:  # a BaseException: `except Exception` would miss it
        failures = [pair[0] for pair in exc.failures.values()]
        ours = next((e for e in failures if isinstance(e, TensortierError)), None)
        if ours is not None:
            raise ours from None
        first = failures[0] if failures else exc
        raise CorruptDataError(
            f"DCP could not read the checkpoint: {first!r}", path=dcp_dir
        ) from exc
    except Exception as exc:
        raise CorruptDataError(f"DCP could not read the checkpoint: {exc!r}", path=dcp_dir) from exc
    return state
