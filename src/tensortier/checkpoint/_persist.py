"""Persist one snapshot: parallel writes, fsync, manifest last, atomic rename (see PROTOCOL.md).

Runs on the checkpointer's background thread. Data goes from the page-aligned snapshot images
straight to the files with ``os.pwrite`` in 16 MiB chunks on a thread pool (O_DIRECT when the
filesystem allows, so a checkpoint does not evict the page cache and the bytes hit the disk once),
checksums are computed on the same pool, and nothing is visible under its final name until the
directory rename. Any failure removes the ``.incomplete`` directory and is re-raised, a full disk
as :class:`TierFullError`.
"""

from __future__ import annotations

import errno
import os
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait

import torch

from tensortier.checkpoint import _faults
from tensortier.checkpoint._format import MANIFEST, Shard, crc, entry_info, manifest_bytes
from tensortier.errors import TierFullError

CHUNK = 16 << 20
MAX_OPEN = 64  # shard files a save holds open at once
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_pwrite = os.pwrite  # module-level so tests can simulate a full disk


class CpuClock:
    """CPU seconds (user + system) spent by background work, summed over the threads it ran on.

    On a CPU-only machine these are seconds taken from training, so the adaptive interval counts
    them as cost even when iteration timings are too noisy to show the slowdown.
    """

    def __init__(self) -> None:
        self.seconds = 0.0
        self._lock = threading.Lock()

    def wrap(self, fn: Callable) -> Callable:
        def timed(*args):
            t0 = time.thread_time()
            try:
                return fn(*args)
            finally:
                with self._lock:
                    self.seconds += time.thread_time() - t0

        return timed


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step}")


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def retire(root: str, steps: list[int]) -> None:
    """Remove the checkpoints a rollback abandoned, durably, before the next one commits.

    Renames go in ascending step order, so the abandoned run's newest checkpoint is the last to
    go: until then ``restore()`` still sees it (as if the rollback had not started); from then on
    it sees the rolled-back-to step. The directory fsync makes that durable before the new
    checkpoint's rename can be (PROTOCOL.md, "Rollback").
    """
    doomed = []
    for step in sorted(steps):
        path = step_dir(root, step)
        target = f"{path}.deleting-{os.getpid()}"
        os.rename(path, target)
        doomed.append(target)
        _faults.point("rollback-renamed")
    fsync_dir(root)
    _faults.point("rollback-synced")
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)


def _write_all(fd: int, view: memoryview, pos: int) -> None:
    done = 0
    while done < len(view):
        done += _pwrite(fd, view[done:], pos + done)


def persist(
    root: str,
    step: int,
    shards: list[Shard],
    images: list[torch.Tensor],
    body: dict,
    pool: ThreadPoolExecutor,
    direct: bool,
    clock: CpuClock | None = None,
) -> tuple[str, int]:
    """Write ``step-N/`` durably; returns (its path, bytes written). ``body`` gets the checksums.

    The caller marks the start of the save for the fault points (``_faults.begin_save``).
    """
    final = step_dir(root, step)
    tmp = final + ".incomplete"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.mkdir(tmp, 0o755)
        body["tensors"], written = write_shards(tmp, shards, images, pool, direct, clock)
        commit(root, tmp, final, body)
        return final, written
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise disk_full(exc, step, root) from exc


def disk_full(exc: BaseException, step: int, root: str, written: int = 0) -> BaseException:
    """ENOSPC/EDQUOT as :class:`TierFullError`; any other error as it is."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return TierFullError(
            f"disk full while writing checkpoint step {step} to {root!r} ({exc.strerror}). The "
            f"partial checkpoint was removed and earlier ones are intact; free space there, "
            f"lower keep=, or point the Checkpointer elsewhere.",
            tier="disk",
            requested=written,
        )
    return exc


def write_shards(
    folder: str,
    shards: list[Shard],
    images: list[torch.Tensor],
    pool: ThreadPoolExecutor,
    direct: bool,
    clock: CpuClock | None = None,
    prefix: str = "",
) -> tuple[dict, int]:
    """Write and fsync every shard file into ``folder`` (which exists); returns the manifest's
    tensor table (file names prefixed with ``prefix``) and the bytes written. On an error every
    job is waited for and the error re-raised (the caller removes the folder). At most
    ``MAX_OPEN`` files are open at once: a small ``shard_size`` makes thousands of shards, more
    than the process may open (EMFILE on every save)."""
    clock = clock or CpuClock()
    tensors: dict = {}
    written = 0
    for at in range(0, len(shards), MAX_OPEN):
        part = slice(at, at + MAX_OPEN)
        table, n = _write_group(folder, shards[part], images[part], pool, direct, clock, prefix)
        tensors.update(table)
        written += n
    return tensors, written


def _write_group(
    folder: str,
    shards: list[Shard],
    images: list[torch.Tensor],
    pool: ThreadPoolExecutor,
    direct: bool,
    clock: CpuClock,
    prefix: str,
) -> tuple[dict, int]:
    """``write_shards`` for a group of files open together, written in parallel."""
    fds: list[int] = []
    jobs: list = []  # every pool job, waited for before an error leaves
    written = 0
    try:
        for shard in shards:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | (_O_DIRECT if direct else 0)
            fds.append(os.open(os.path.join(folder, shard.file), flags, 0o644))
        crc_jobs = [
            (shard, e, pool.submit(clock.wrap(crc), img[shard.data_start + e.offset :][: e.nbytes]))
            for shard, img in zip(shards, images)
            for e in shard.entries
        ]
        jobs += [job for _, _, job in crc_jobs]

        def chunk(fd: int, image: torch.Tensor, start: int, end: int) -> None:
            _write_all(fd, memoryview(image[start:end].numpy()), start)
            _faults.point("chunk-written")

        write_jobs = []
        for fd, shard, image in zip(fds, shards, images):
            length = shard.image_bytes if direct else shard.file_bytes
            written += shard.file_bytes
            write_jobs.append(
                [
                    pool.submit(clock.wrap(chunk), fd, image, s, min(s + CHUNK, length))
                    for s in range(0, length, CHUNK)
                ]
            )
            jobs += write_jobs[-1]

        def finish(fd: int, shard: Shard, chunks: list) -> None:
            for job in chunks:  # queued before this job (FIFO), so they never wait for a thread
                job.result()
            if direct:
                os.ftruncate(fd, shard.file_bytes)  # drop the O_DIRECT padding of the last page
            os.fsync(fd)
            _faults.point("file-synced")

        finish_jobs = [
            pool.submit(clock.wrap(finish), *args) for args in zip(fds, shards, write_jobs)
        ]
        jobs += finish_jobs
        for job in finish_jobs:  # first error wins; the rest are waited for before cleanup
            job.result()
        tensors = {}
        for shard, entry, job in crc_jobs:
            info = entry_info(entry, shard, job.result())
            info["file"] = prefix + info["file"]
            tensors[entry.name] = info
        return tensors, written
    except BaseException:
        wait(jobs)
        raise
    finally:
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass


def commit(root: str, tmp: str, final: str, body: dict) -> None:
    """Steps 4-7 of PROTOCOL.md: manifest last, fsync, atomic rename, fsync of the root."""
    body["created"] = time.time()
    data = manifest_bytes(body)
    fd = os.open(os.path.join(tmp, MANIFEST), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        half = len(data) // 2
        _write_all(fd, memoryview(data)[:half], 0)
        _faults.point("manifest-partial")
        _write_all(fd, memoryview(data)[half:], half)
        os.fsync(fd)
    finally:
        os.close(fd)
    _faults.point("manifest-synced")
    fsync_dir(tmp)
    _faults.point("before-rename")
    if os.path.exists(final):  # the same step saved again (a resumed run): replace it
        old = final + f".deleting-{os.getpid()}"
        os.rename(final, old)
        shutil.rmtree(old, ignore_errors=True)
    os.rename(tmp, final)
    _faults.point("after-rename")
    fsync_dir(root)
    _faults.point("after-dir-fsync")
