"""The per-rank HDF5 metrics file (schema_version 1): rows buffered between flushes, each flush
appended to the file in HDF5's single-writer/multiple-reader (SWMR) mode, through a file object
that keeps the superblock's status flags clear on disk (a file left by a killed writer opens
with a plain ``h5py.File(path, "r")``)."""

from __future__ import annotations

import datetime as _dt
import io
import json
import os
import pickle
import time
from typing import Dict, List, Optional

import h5py
import numpy as np

__all__ = ["SCHEMA_VERSION", "GROUPS", "OPTIONAL_GROUPS", "TIME_COLUMNS", "MetricsWriter",
           "rank_file", "open_rank_file", "encode_config"]

SCHEMA_VERSION = 1

#: Required columns of each group, in order, and their dtypes. Algorithms may add columns
#: (EASGD's centre accuracy in /eval, local SGD's T in /train); readers ignore what they
#: do not know.
GROUPS: Dict[str, Dict[str, str]] = {
    "train": {"step": "i8", "epoch": "f8", "wall_time": "f8", "loss": "f8", "accuracy": "f8",
              "lr": "f8", "comm_bytes_sent": "i8", "comm_bytes_recv": "i8",
              "comm_seconds": "f8", "compute_seconds": "f8",
              # cumulative seconds (docs/metrics.md): control traffic (stop flag), consensus
              # probes, evaluations, checkpoints, metric flushes, and the training time =
              # wall_time less probes, evaluations, checkpoints and flushes
              "overhead_seconds": "f8", "probe_seconds": "f8", "eval_seconds": "f8",
              "checkpoint_seconds": "f8", "metrics_seconds": "f8", "training_time": "f8"},
    "eval": {"step": "i8", "epoch": "f8", "wall_time": "f8", "training_time": "f8",
             "test_loss": "f8", "test_accuracy": "f8"},
    "leader": {"step": "i8", "scope": "i8", "leader_rank": "i8", "score": "f8"},
    "consensus": {"step": "i8", "distance": "f8"},
    # one row per recovery from lost ranks (on_failure="shrink" or "heal"; docs/metrics.md),
    # and one per heal: the step
    # the survivors go on from, the run's clock, the ranks lost (initial numbering, e.g.
    # "1,3" or "8-15"; n_lost of them), the world size after it, the seconds it took, and
    # the nodes left without a rank (host names, comma-separated; empty when none)
    "faults": {"step": "i8", "wall_time": "f8", "lost_ranks": "S256", "n_lost": "i8",
               "world_size_after": "i8", "recovery_seconds": "f8", "lost_nodes": "S256",
               # a heal's row (on_failure="heal"): the ranks replaced, and the seconds from
               # their loss to the end of the replacements' first step (empty and NaN in
               # the row of a loss)
               "replaced_ranks": "S256", "replace_seconds": "f8",
               "replaced_nodes": "S256"},
}

#: groups written only when they have rows (a file without failures has no /faults)
OPTIONAL_GROUPS = ("faults",)


#: Columns that hold measured times: they differ between two runs of the same seed (a
#: resumed run is compared with an uninterrupted one on everything else).
TIME_COLUMNS = ("wall_time", "training_time", "comm_seconds", "compute_seconds",
                "overhead_seconds", "probe_seconds", "eval_seconds", "checkpoint_seconds",
                "metrics_seconds", "worker_seconds", "node_seconds", "recovery_seconds")


#: bytes of one chunk of a column (1024 rows of an 8-byte column): a flush writes into the
#: last chunk of each column, a file of a few rows stays small
CHUNK_BYTES = 8192


def rank_file(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, "metrics", f"rank{rank:05d}.h5")


def open_rank_file(path) -> h5py.File:
    """A rank file opened read-only, without HDF5 file locking, also while its writer appends
    to it. This package's writer never leaves the superblock's status flags set on disk (see
    ``MetricsWriter``), so its files open as ordinary ones; a file whose flags are set (written
    by an older version of this package, or by another SWMR writer) is marked "already open
    for write" and is then opened as a SWMR reader, which sees the rows of the writer's last
    completed flush at least. Any other error (a truncated file, not HDF5) propagates. Columns
    of a group may differ in length by the rows of one flush (a writer killed mid-flush): cut
    them to the shortest (the rows they all have are a prefix of the rows logged)."""
    try:
        return h5py.File(path, "r", locking=False)
    except OSError as exc:
        if "already open for write" not in str(exc):
            raise
    return h5py.File(path, "r", locking=False, swmr=True)


def _swmr_fapl(fileobj):
    """File access for the writer's appends: HDF5 writes through ``fileobj`` (h5py's
    file-object driver; a ``_CrashSafeFile``), the latest format (SWMR needs it)."""
    fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    fapl.set_fileobj_driver(h5py.h5fd.fileobj_driver, fileobj)
    fapl.set_libver_bounds(h5py.h5f.LIBVER_LATEST, h5py.h5f.LIBVER_LATEST)
    return fapl


#: the HDF5 format signature, at the start of a file without a user block
_SIGNATURE = b"\x89HDF\r\n\x1a\n"
#: bytes of a superblock of version 2 or 3 with 8-byte addresses (the longest read back)
_SUPERBLOCK_BYTES = 48


def _lookup3(data: bytes, initval: int = 0) -> int:
    """Bob Jenkins' lookup3 ``hashlittle``: HDF5's metadata checksum (H5_checksum_lookup3)."""
    m = 0xFFFFFFFF

    def rot(x, k):
        return ((x << k) | (x >> (32 - k))) & m

    n = len(data)
    a = b = c = (0xDEADBEEF + n + initval) & m
    i = 0
    while n > 12:
        a = (a + int.from_bytes(data[i:i + 4], "little")) & m
        b = (b + int.from_bytes(data[i + 4:i + 8], "little")) & m
        c = (c + int.from_bytes(data[i + 8:i + 12], "little")) & m
        a = ((a - c) & m) ^ rot(c, 4); c = (c + b) & m
        b = ((b - a) & m) ^ rot(a, 6); a = (a + c) & m
        c = ((c - b) & m) ^ rot(b, 8); b = (b + a) & m
        a = ((a - c) & m) ^ rot(c, 16); c = (c + b) & m
        b = ((b - a) & m) ^ rot(a, 19); a = (a + c) & m
        c = ((c - b) & m) ^ rot(b, 4); b = (b + a) & m
        i, n = i + 12, n - 12
    if n == 0:
        return c
    tail = bytes(data[i:i + n]) + bytes(12 - n)
    a = (a + int.from_bytes(tail[0:4], "little")) & m
    b = (b + int.from_bytes(tail[4:8], "little")) & m
    c = (c + int.from_bytes(tail[8:12], "little")) & m
    c = (c ^ b) - rot(b, 14) & m
    a = (a ^ c) - rot(c, 11) & m
    b = (b ^ a) - rot(a, 25) & m
    c = (c ^ b) - rot(b, 16) & m
    a = (a ^ c) - rot(c, 4) & m
    b = (b ^ a) - rot(a, 14) & m
    c = (c ^ b) - rot(b, 24) & m
    return c


def _superblock_fields(head) -> Optional[tuple]:
    """(checksummed length, offset of the end-of-file address, bytes of an address) of the
    version-2-or-later superblock that ``head`` starts with; None for anything else."""
    if len(head) < 12 or bytes(head[:8]) != _SIGNATURE or head[8] < 2:
        return None
    size = head[9]
    end = 12 + 4 * size                # signature .. root group address; then the checksum
    return (end, 12 + 2 * size, size) if len(head) >= end + 4 else None


def clear_status_flags(head: bytes, eof: Optional[int] = None) -> bytes:
    """``head`` (a file's first bytes, the superblock whole) with the superblock's status
    flags cleared (what ``h5clear -s`` does), its end-of-file address set to ``eof`` when
    given, and its checksum made anew; ``head`` itself when it does not start with a
    superblock of version 2 or later. HDF5 sets the flags (write access, SWMR write access)
    in a version-3 superblock while a writer holds the file open and clears them at its
    close; a plain reader refuses a file whose flags are set ("file is already open for
    write")."""
    fields = _superblock_fields(head)
    if fields is None:
        return head
    end, eof_at, size = fields
    sb = bytearray(head)
    sb[11] = 0
    if eof is not None:
        sb[eof_at:eof_at + size] = int(eof).to_bytes(size, "little")
    sb[end:end + 4] = _lookup3(bytes(sb[:end])).to_bytes(4, "little")
    return bytes(sb)


class _CrashSafeFile(io.FileIO):
    """The rank file as the appending writer's HDF5 sees it (h5py's file-object driver),
    kept such that the file on disk, after any of its writes (where a SIGKILL may cut the
    writer), opens with a plain ``h5py.File(path, "r")`` and reads back:

    - every write of the superblock goes to disk with its status flags cleared, in the same
      write: HDF5 keeps its own copy of the flags in memory (it writes, flushes and closes
      as a SWMR writer), but the file on disk never carries them ("already open for write");
    - the superblock's end-of-file address covers every byte written: after a write past it
      (a new chunk, a new chunk index block), the superblock is written again with the new
      end, before HDF5's next write, which may point to them (a SWMR writer writes what
      an object points to before the object, and the superblock only at its close; a
      plain reader refuses an address past the end-of-file address: "addr overflow"). It
      never exceeds the file's length either ("truncated file").

    A file that does not start with a superblock of version 2 or later is written as is.
    """

    def __init__(self, path: str):
        super().__init__(path, "r+")
        self._sb = bytearray(os.pread(self.fileno(), _SUPERBLOCK_BYTES, 0))
        fields = _superblock_fields(self._sb)
        #: the end-of-file address in the superblock on disk (None: not a superblock we know)
        self._eof = None if fields is None else \
            int.from_bytes(self._sb[fields[1]:fields[1] + fields[2]], "little")
        #: whether the superblock on disk carries status flags (left by another writer)
        self.flagged = fields is not None and bool(self._sb[11])

    def _put_superblock(self, eof: int) -> None:
        self._sb = bytearray(clear_status_flags(bytes(self._sb), eof))
        self._pwrite(memoryview(self._sb), 0)
        self._eof = eof

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        pos, n = self.tell(), len(view)
        if self._eof is None:
            return self._pwrite(view, pos)
        if pos < len(self._sb):
            # (a part of) the superblock: merged into the one on disk, flags cleared, its
            # end-of-file address no more than the file's length; one write from offset 0
            head = bytearray(max(pos + n, len(self._sb)))
            head[:len(self._sb)] = self._sb
            head[pos:pos + n] = view
            fields = _superblock_fields(head)
            if fields is None:
                return self._pwrite(view, pos)
            _, eof_at, size = fields
            eof = min(int.from_bytes(head[eof_at:eof_at + size], "little"),
                      max(os.fstat(self.fileno()).st_size, pos + n))
            out = clear_status_flags(bytes(head), eof)
            self._pwrite(memoryview(out), 0)
            self._sb, self._eof = bytearray(out[:len(self._sb)]), eof
            self.seek(pos + n)
            return n
        self._pwrite(view, pos)
        if pos + n > self._eof:
            self._put_superblock(pos + n)
            self.seek(pos + n)
        return n

    def truncate(self, size=None):
        size = self.tell() if size is None else size
        if self._eof is not None and size < self._eof:
            self._put_superblock(size)
        self._ftruncate(size)
        return size

    def _ftruncate(self, size: int) -> None:
        os.ftruncate(self.fileno(), size)

    def _pwrite(self, view: memoryview, pos: int) -> int:
        """All of ``view`` at ``pos`` (the file position left after it, as a write leaves
        it)."""
        done = 0
        while done < len(view):
            done += os.pwrite(self.fileno(), view[done:], pos + done)
        self.seek(pos + done)
        return done


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class MetricsWriter:
    """Rows kept in memory between flushes; each flush appends them to the file.

    The file's columns are chunked, resizable datasets. The first flush writes the file whole
    (a temporary file in the same folder, fsynced, renamed over the path); each later flush
    opens it directly, switches to HDF5's SWMR writing, extends every column of a group by
    its new rows, writes them, flushes, closes and fsyncs the file: its cost is that of the
    new rows, not of the whole run, and memory holds the rows of one flush interval
    (``rows``; the counts already on disk are ``written``). As a SWMR writer HDF5 writes the
    raw data before the metadata and what an object points to before the object (a column's
    chunk index before its extent); it writes through a ``_CrashSafeFile``, which keeps the
    superblock's status flags clear on disk and its end-of-file address past every byte
    written. So a job killed at any instant (even mid-flush) leaves a file that a plain
    ``h5py.File(path, "r")`` opens, whose columns hold prefixes of the rows logged; the
    columns of a group differ by at most the rows of the flush that was cut, and readers cut
    them to the shortest (tests/runtime/test_metrics_kill.py replays every write of a flush
    cut short, and SIGKILLs writers). Between flushes the file is closed, an ordinary HDF5
    file.

    What changes the file's layout (the first rows of an optional group such as /faults,
    changed attributes such as ``end_time`` at ``close()``, a resume's ``load_existing``)
    writes the file anew the first way, once.

    ``trackers``: experiment trackers that mirror the rows (rank 0's; lsgd_hpc.runtime.trackers:
    ``open_trackers`` or ``make_trackers``): every row logged is sent to them as it comes,
    they are flushed at every flush and closed by ``close()``.
    """

    def __init__(self, path: str, attrs: dict, flush_every: int = 50,
                 flush_seconds: float = 30.0, extra_columns: Optional[Dict[str, Dict]] = None,
                 trackers=None):
        self.path = path
        self.attrs = dict(attrs)
        self.flush_every = flush_every
        self.flush_seconds = flush_seconds
        self.columns = {g: dict(cols) for g, cols in GROUPS.items()}
        for g, cols in (extra_columns or {}).items():
            self.columns[g].update(cols)
        #: the rows logged since the last flush (group -> column -> values)
        self.rows: Dict[str, Dict[str, List]] = {
            g: {c: [] for c in cols} for g, cols in self.columns.items()}
        #: the rows of each group in the file (written by this writer or kept by a resume)
        self.written: Dict[str, int] = {g: 0 for g in self.columns}
        #: (groups, pickled attributes) of the file as last written whole; None: no file of
        #: this writer's yet (the first flush replaces whatever is at the path)
        self._layout: Optional[tuple] = None
        self._last_flush_time = time.monotonic()
        self._rows_since_flush = 0
        self.trackers = _mirror(trackers)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)

    # -- rows ------------------------------------------------------------------------------
    def log(self, group: str, **row) -> None:
        cols = self.rows[group]
        if row.keys() != cols.keys():
            missing, extra = cols.keys() - row.keys(), row.keys() - cols.keys()
            raise KeyError(f"/{group} row: missing {sorted(missing)}, unknown {sorted(extra)}")
        for c, v in row.items():
            cols[c].append(v)
        if group == "train":
            self._rows_since_flush += 1
        if self.trackers:
            self.trackers.log_row(group, row)

    def track(self, step: int, **scalars: float) -> None:
        """Send values that have no column in the file to the trackers only, under the keys
        given (``track(step, **{"leader/score": s})``); nothing without trackers."""
        if self.trackers:
            self.trackers.log_scalars(step, scalars)

    def _pending(self, group: str) -> int:
        return len(next(iter(self.rows[group].values())))

    def row_counts(self) -> Dict[str, int]:
        """Rows of each group so far, on disk and since the last flush (optional groups
        only once they have some)."""
        counts = {g: self.written[g] + self._pending(g) for g in self.rows}
        return {g: n for g, n in counts.items() if n or g not in OPTIONAL_GROUPS}

    def column(self, group: str, name: str) -> list:
        """Every value of one column so far: those flushed (read back from the file) and
        those since the last flush."""
        values: list = []
        if self.written[group]:
            with open_rank_file(self.path) as f:
                values = f[group][name][:self.written[group]].tolist()
        return values + list(self.rows[group][name])

    def maybe_flush(self) -> bool:
        due = (self._rows_since_flush >= self.flush_every
               or time.monotonic() - self._last_flush_time >= self.flush_seconds)
        if due:
            self.flush()
        return due

    # -- disk ------------------------------------------------------------------------------
    def flush(self) -> None:
        """The rows since the last flush to the file: appended, or the file written anew
        when its layout changes (see the class)."""
        if self._layout is None or self._layout != self._wanted_layout():
            self._rewrite(dict(self.written))
        elif any(self._pending(g) for g in self.rows):
            try:
                self._append()
            except OSError:
                # the file's status flags are set (another SWMR writer holds it, or was
                # killed holding it), or it is not what this writer wrote: write it anew
                self._rewrite(dict(self.written))
        self._last_flush_time = time.monotonic()
        self._rows_since_flush = 0
        if self.trackers:
            self.trackers.flush()

    def _wanted_layout(self) -> tuple:
        groups = frozenset(g for g in self.columns if g not in OPTIONAL_GROUPS
                           or self.written[g] or self._pending(g))
        return groups, pickle.dumps(self.attrs)

    def _taken(self) -> None:
        """The rows since the last flush are in the file."""
        for g, cols in self.rows.items():
            self.written[g] += self._pending(g)
            for values in cols.values():
                values.clear()

    def _append(self) -> None:
        with _CrashSafeFile(self.path) as raw:
            if raw.flagged:
                raise OSError(f"{self.path}: superblock status flags set (a writer holds it, "
                              f"or was killed holding it)")
            fid = h5py.h5f.open(os.fsencode(self.path), h5py.h5f.ACC_RDWR, _swmr_fapl(raw))
            try:
                # SWMR writing (HDF5 refuses ACC_SWMR_WRITE at the open through a file
                # object, not the switch after it): what an object points to is written
                # before the object; without it, some cut flushes read back wrong values.
                # An HDF5 that refuses the switch too: the flush writes the file anew.
                try:
                    fid.start_swmr_write()
                except (RuntimeError, ValueError) as exc:
                    raise OSError(f"{self.path}: no SWMR writing: {exc}") from exc
                self._append_rows(fid)
            finally:
                fid.close()
            os.fsync(raw.fileno())
        self._taken()

    def _append_rows(self, fid) -> None:
        """Each group's new rows appended to its columns, then the file flushed."""
        for g, cols in self.rows.items():
            k, n = self._pending(g), self.written[g]
            if not k:
                continue
            # every column's extent and data (HDF5's low-level calls: a tenth of the
            # high-level ones' cost); at the flush below HDF5 writes the raw data first,
            # then each column's chunk index before its extent (SWMR flush order)
            for c, values in cols.items():
                ds = h5py.h5d.open(fid, f"{g}/{c}".encode())
                ds.set_extent((n + k,))
                space = ds.get_space()
                space.select_hyperslab((n,), (k,))
                ds.write(h5py.h5s.create_simple((k,)), space,
                         np.ascontiguousarray(values, dtype=self.columns[g][c]))
                ds.close()
        h5py.h5f.flush(fid)

    def _rewrite(self, keep: Dict[str, int], src: Optional[h5py.File] = None) -> None:
        """Write the file anew: the attributes, the first ``keep[g]`` rows of each group
        (read from ``src``, else from the file at the path) and the rows since the last
        flush; a temporary file, fsynced, renamed over the path."""
        if src is None and any(keep.values()):
            with open_rank_file(self.path) as f:
                self._rewrite(keep, f)
            return
        self.written = {g: int(keep.get(g, 0)) for g in self.columns}
        groups, attrs = self._wanted_layout()
        tmp = f"{self.path}.tmp"
        with h5py.File(tmp, "w", libver="latest", locking=False) as f:
            for k, v in self.attrs.items():
                f.attrs[k] = str(v) if isinstance(v, str) else v
            for g in (g for g in self.columns if g in groups):
                grp = f.create_group(g)
                for c, dtype in self.columns[g].items():
                    kept = _prefix(src, self.path, g, c, self.written[g])
                    arr = np.concatenate([kept.astype(dtype, copy=False),
                                          np.asarray(self.rows[g][c], dtype=dtype)])
                    grp.create_dataset(c, data=arr, dtype=dtype, maxshape=(None,),
                                       chunks=(max(1, CHUNK_BYTES // np.dtype(dtype).itemsize),))
        _fsync(tmp)
        os.replace(tmp, self.path)
        self._layout = (groups, attrs)
        self._taken()

    def close(self) -> None:
        """The end of the run: stamp the file's ``end_time`` attribute (ISO 8601, UTC; how
        ``lsgd_hpc.summary --follow`` knows a run ended), flush, close the trackers. Rows
        logged after it still go to the file at the next flush, not to the trackers."""
        self.attrs["end_time"] = _dt.datetime.now(_dt.timezone.utc).isoformat()
        try:
            self.flush()
        finally:
            self.close_trackers()

    def close_trackers(self) -> None:
        if self.trackers is not None:
            self.trackers.close()
            self.trackers = None

    def load_existing(self, counts: Dict[str, int]) -> None:
        """Resume: keep the first ``counts[g]`` rows of each group of the file on disk (rows
        written after the checkpoint are dropped from it; they will be produced again). The
        file is written anew with them (a file left by a killed writer becomes an ordinary
        one); only their counts are kept in memory."""
        with open_rank_file(self.path) as f:
            for g, n in counts.items():
                if g in OPTIONAL_GROUPS and n == 0 and g not in f:
                    continue
                for c in self.columns[g]:
                    if g not in f or c not in f[g]:
                        raise RuntimeError(f"{self.path}: /{g}/{c} missing; cannot resume")
                    if len(f[g][c]) < n:
                        raise RuntimeError(f"{self.path}: /{g}/{c} has {len(f[g][c])} rows, "
                                           f"checkpoint expects {n}")
            for g in counts:
                for values in self.rows[g].values():
                    values.clear()
            self._rewrite({g: int(n) for g, n in counts.items()}, f)


def _prefix(src: Optional[h5py.File], path: str, group: str, column: str, n: int) -> np.ndarray:
    """The first ``n`` values of ``/group/column`` in ``src`` (none when n is 0)."""
    if not n:
        return np.empty(0)
    if group not in src or column not in src[group]:
        raise RuntimeError(f"{path}: /{group}/{column} missing; cannot rewrite the file")
    data = src[group][column][:n]
    if len(data) < n:
        raise RuntimeError(f"{path}: /{group}/{column} has {len(data)} rows, {n} expected")
    return data


def _mirror(trackers):
    """None, a trackers.Mirror, or a list of trackers (wrapped in a Mirror)."""
    if trackers is None or hasattr(trackers, "log_row"):
        return trackers
    from lsgd_hpc.runtime.trackers import Mirror
    return Mirror(trackers) if trackers else None


def encode_config(config: dict) -> str:
    return json.dumps(config, sort_keys=True, default=str)

