"""Reading and writing faiss indexes (streamed in blocks; a local file memory-mapped) and the
embedding files the index is built from.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass

import faiss
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from apache_beam.io.filesystems import FileSystems

from pipeline.common.errors import ChecksumMismatch
from pipeline.common.names import file_number
from pipeline.index.factory import IndexBuildError, is_ivf
from pipeline.index.search import set_search_depth
from schemas.arrow import tensor_column_to_numpy
from schemas.manifest import unversioned

IO_BLOCK = 1 << 22  # bytes per read / write call when streaming an index
# An index in slices by inverted lists also writes, beside slice-NNNNN.faiss:
INDEX_FILE = "index.faiss"  # the index in one file
QUANTIZER_FILE = "quantizer.faiss"  # the trained index without vectors: the coarse assignment
LIST_OWNERS_FILE = "list_owners.npy"  # int32 [nlist]: the slice of each list (-1: an empty list)


def searched_files(paths: list[str]) -> list[str]:
    """Of an index's faiss file paths, those searched (index.faiss, or its slices in number
    order): not the quantizer and list owners of slices."""
    routing = (QUANTIZER_FILE, LIST_OWNERS_FILE)
    return sorted((p for p in paths if not unversioned(p).endswith(routing)), key=file_number)


def write_owners(owner: np.ndarray, path: str) -> tuple[int, str]:
    """LIST_OWNERS_FILE: (bytes written, sha256)."""
    from pipeline.common import fileio

    buffer = io.BytesIO()
    np.save(buffer, owner.astype(np.int32))
    data = buffer.getvalue()
    fileio.write_bytes(path, data)
    return len(data), hashlib.sha256(data).hexdigest()


def read_owners(path: str) -> np.ndarray:
    from pipeline.common import fileio

    return np.load(io.BytesIO(fileio.read_bytes(path)))


def write_index(index, path: str) -> tuple[int, str]:
    """Stream the index to any Beam filesystem path, never as one bytes object (that would be
    a second copy of the index in memory): (bytes written, sha256)."""
    from pipeline.common import fileio

    digest, size = hashlib.sha256(), 0
    with fileio.open_write(path) as f:

        def write(block: bytes) -> int:
            nonlocal size
            digest.update(block)
            f.write(block)
            size += len(block)
            return len(block)

        faiss.write_index(index, faiss.PyCallbackIOWriter(write, IO_BLOCK))  # type: ignore[attr-defined]  # not in faiss's stubs
    return size, digest.hexdigest()


def write_consecutive(path: str, records) -> list[int]:
    """Each record (its arrays, as raw bytes) one after another in one file, so that each is
    read alone by its range (`read_range`): where each starts."""
    from pipeline.common import fileio

    offsets, offset = [], 0
    with fileio.open_write(path) as f:
        for arrays in records:
            offsets.append(offset)
            for array in arrays:
                data = np.ascontiguousarray(array).tobytes()
                f.write(data)
                offset += len(data)
    return offsets


def read_range(path: str, offset: int, nbytes: int) -> bytes:
    """`nbytes` of the file at `path` from `offset` (a block among others in one file)."""
    from pipeline.common import fileio

    with fileio.open_read(path) as f:
        f.seek(offset)
        data = f.read(nbytes)
    if len(data) != nbytes:
        raise IndexBuildError(f"{path}: {len(data)} bytes at {offset}, expected {nbytes}")
    return data


_CHECKED: set[tuple] = set()  # (path, sha256, size, modified) checked in this process


def check_sha256(path: str, sha256: str | None) -> None:
    """Refuse the file at `path` unless its sha256 is `sha256`, before faiss parses it (faiss
    trusts what it reads: a tampered file is a crash or worse). None: a file the running job
    wrote itself, in no manifest yet. Costs one read of the file (1.26 GB/s, AMD EPYC), once per
    process while the file is as it was listed then (its size and time): a searcher that loads
    slices in turn reads each again, but hashes it once."""
    from pipeline.common import fileio

    if sha256 is None:
        return
    listed = FileSystems.match([path])[0].metadata_list
    if not listed:
        raise ChecksumMismatch(f"{path}: missing, though its manifest lists it (a run committed over it: run again)")
    seen = (path, sha256, listed[0].size_in_bytes, listed[0].last_updated_in_seconds)
    if seen in _CHECKED:  # as it was when its bytes were checked
        return
    found, size = fileio.sha256_file(path)
    if found != sha256:
        raise ChecksumMismatch(
            f"{path}: sha256 {found[:12]}… of its {size:,} bytes is not the manifest's {sha256[:12]}…: "
            "the file changed since (a run committed over it: run again) or is damaged; faiss did not read it"
        )
    _CHECKED.add(seen)


def read_index(path: str, *, sha256: str | None):
    """Read an index file from any Beam filesystem path, streamed (no bytes copy), once its
    sha256 is checked (`check_sha256`)."""
    from pipeline.common import fileio

    check_sha256(path, sha256)
    with fileio.open_read(path) as f:
        return faiss.read_index(faiss.PyCallbackIOReader(f.read, IO_BLOCK))  # type: ignore[attr-defined]  # not in faiss's stubs


class EmptiedTrained:
    """The trained index, read once per holder (a DoFn instance: a worker thread; at 2^20 lists
    it is 2-3.7 GB and a step adds to it once per file or piece) and emptied of the vectors the
    previous use added (a failed bundle may have left some) each time it is handed out: its
    inverted lists are replaced by empty ones, as faiss's `reset` would keep each list's
    capacity, and a holder that fills different lists in turn (a piece of each slice) would
    keep the room of all of them."""

    def __init__(self):
        self._held: tuple[str, faiss.Index] | None = None  # (path, index)

    def __call__(self, trained_path: str, sha256: str | None = None):
        """The trained index at `trained_path` (checked against `sha256` where given, when read)."""
        if self._held is None or self._held[0] != trained_path:
            self._held = None  # the previous one freed before the next is read
            self._held = (trained_path, read_index(trained_path, sha256=sha256))
        index = self._held[1]
        ivf = faiss.extract_index_ivf(index)
        empty = faiss.ArrayInvertedLists(ivf.nlist, ivf.code_size)
        empty.this.disown()  # type: ignore[attr-defined]  # the index owns it
        ivf.replace_invlists(empty, True)
        ivf.ntotal = index.ntotal = 0  # a pre-transform wrapper counts too
        return index

    def drop(self) -> None:
        self._held = None


def load_index(path: str, depth: int | None = None, *, sha256: str | None):
    """`read_index`, but local IVF files are memory-mapped (`without_prefetch`)."""
    if "://" in path:
        index = read_index(path, sha256=sha256)
    else:
        check_sha256(path, sha256)
        try:
            index = without_prefetch(faiss.read_index(path, faiss.IO_FLAG_MMAP | faiss.IO_FLAG_READ_ONLY))
        except RuntimeError:
            index = faiss.read_index(path)  # not IVF: read whole (checked above)
    if depth is not None:
        set_search_depth(index, depth)
    return index


def without_prefetch(index):
    """A memory-mapped IVF index whose searches read only what they score. faiss's on-disk
    lists otherwise start 32 threads per search call, each reading whole probed lists ahead
    of the search; over a file in the page cache that is all cost (at 50k chunks, IVF256
    nprobe 16, 512 queries a call: 3.5-3.9 s of search against 2.6-2.8 s without, AMD EPYC)."""
    if is_ivf(index):
        lists = faiss.downcast_InvertedLists(faiss.extract_index_ivf(index).invlists)
        if isinstance(lists, faiss.OnDiskInvertedLists):
            lists.prefetch_nthread = 0
    return index


READ_BATCH = 16384  # rows per record batch read from an embeddings file


@dataclass(frozen=True)
class EmbeddingFile:
    """One embeddings Parquet file, as its footer describes it."""

    path: str
    rows: int
    dim: int


def embedding_file_info(path: str) -> EmbeddingFile:
    """Rows and vector width of one embeddings Parquet file (from its footer only)."""
    from pipeline.common import fileio

    with fileio.open_read(path) as f:
        parquet = pq.ParquetFile(f)
        schema = parquet.schema_arrow
        if "chunk_id" not in schema.names or "embedding" not in schema.names:
            raise IndexBuildError(f"{path}: needs columns chunk_id and embedding, has {schema.names}")
        vector = schema.field("embedding").type
        if not pa.types.is_fixed_size_list(vector) or vector.value_type not in (pa.float32(), pa.float16()):
            raise IndexBuildError(f"{path}: embedding must be fixed_size_list<float32 or float16>[d], is {vector}")
        return EmbeddingFile(path, parquet.metadata.num_rows, vector.list_size)


def read_embeddings(path: str):
    """(ids int64 [b], vectors float32 [b, d]) record batch by record batch."""
    from pipeline.common import fileio

    with fileio.open_read(path) as f:
        for batch in pq.ParquetFile(f).iter_batches(batch_size=READ_BATCH, columns=["chunk_id", "embedding"]):
            ids = batch.column("chunk_id").to_numpy().astype(np.int64)
            yield ids, tensor_column_to_numpy(batch.column("embedding")).astype(np.float32)
