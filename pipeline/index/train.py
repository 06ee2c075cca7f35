"""Training an index on its sample (one or two levels of k-means), filling it with vectors,
merging filled parts, and a slice's pieces written and merged.
"""

from __future__ import annotations

import faiss
import numpy as np

from pipeline.common.sampling import TRAIN_SALT, in_sample
from pipeline.index.factory import IndexBuildError, is_ivf, new_index, resolve_clustering, training_size
from pipeline.index.files import read_index, write_index
from pipeline.index.kmeans import train_two_level
from pipeline.index.routing import add_list_blocks


def train_index(
    factory: str,
    sample: np.ndarray,
    clustering: str = "flat",
    ids: np.ndarray | None = None,
    population: int | None = None,
):
    """A new index of `factory` trained on `sample`. An IVF's coarse k-means is one k-means over
    all lists ('flat', on every GPU this faiss build sees: none with faiss-cpu) or faiss's
    two-level clustering ('two_level', on the CPU; see resolve_clustering), which draws its
    subsets by the sample's chunk `ids` (default: row numbers) out of `population` vectors
    (default: the sample's size), as `TrainIndex` does."""
    index = new_index(factory, sample.shape[1])
    sample = np.ascontiguousarray(sample, dtype=np.float32)
    if index.is_trained:
        return index
    if resolve_clustering(clustering, factory) == "two_level":
        row_ids = np.arange(len(sample), dtype=np.int64) if ids is None else np.asarray(ids, np.int64)
        return train_two_level(factory, row_ids, sample, len(sample) if population is None else population)
    if is_ivf(index) and faiss.get_num_gpus() > 0:  # not measured on a GPU yet
        ivf = faiss.extract_index_ivf(index)
        ivf.clustering_index = faiss.index_cpu_to_all_gpus(faiss.IndexFlatL2(ivf.d))
    index.train(sample)
    return index


def build_index(ids: np.ndarray, vectors: np.ndarray, factory: str):
    """In one process: a trained, filled index whose faiss ids are `ids`, trained on the same
    sample the Beam stage would draw (for small sets, the non-mergeable types and baselines)."""
    keep = in_sample(ids, training_size(len(ids), factory), len(ids), TRAIN_SALT)
    index = train_index(factory, vectors[keep], ids=ids[keep], population=len(ids))
    index.add_with_ids(np.ascontiguousarray(vectors, dtype=np.float32), ids.astype(np.int64))
    return index


def merge_part(merged, part) -> None:
    """Move the inverted lists of a filled IVF part into `merged` (same trained index). Only the
    lists move, so a part written without its coarse quantizer (`write_part`) merges too."""
    target, source = faiss.extract_index_ivf(merged), faiss.extract_index_ivf(part)
    if (target.nlist, target.code_size) != (source.nlist, source.code_size):
        raise IndexBuildError(
            f"a part of {source.nlist} lists of {source.code_size} B codes does not "
            f"merge into an index of {target.nlist} lists of {target.code_size} B"
        )
    if target.invlists is None or source.invlists is None:
        raise IndexBuildError("an IVF index without inverted lists cannot merge or be merged into")
    target.invlists.merge_from(source.invlists, 0)
    target.ntotal += source.ntotal
    source.ntotal = 0
    merged.ntotal = target.ntotal  # a pre-transform wrapper counts too


def write_part(index, path: str) -> tuple[int, str]:
    """`write_index` of a filled IVF part with an empty coarse quantizer in place of the trained
    one: every part shares it (it comes back from the trained index at merge time), and at
    2^20 lists it is ~2 GB per file while a part's codes are a few MB."""
    ivf = faiss.extract_index_ivf(index)
    trained, owned = ivf.quantizer, ivf.own_fields
    empty = faiss.IndexFlat(ivf.d, ivf.metric_type)
    ivf.quantizer, ivf.own_fields = empty, False
    try:
        return write_index(index, path)
    finally:
        ivf.quantizer, ivf.own_fields = trained, owned


def write_piece(emptied, blocks, path: str) -> None:
    """A piece of a slice: its `blocks` (ListBlock, from a run of consecutive files) added to
    the trained index emptied of vectors (`files.EmptiedTrained`), each list sorted by chunk id,
    written as a part is (`write_part`)."""
    add_list_blocks(emptied, blocks)
    write_part(emptied, path)


def merge_pieces(index, pieces) -> None:
    """A slice's pieces ((piece, path), `write_piece`) merged into `index` in piece order, one
    read at a time. Pieces in file order hold chunk ids in order where files are numbered in
    chunk-id order (the index stage's are); every list is sorted again for files that are not
    (given to `index` directly)."""
    for _, path in sorted(pieces):
        merge_part(index, read_index(path, sha256=None))
    add_list_blocks(index, [])
