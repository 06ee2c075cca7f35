"""build_info.json: what the index stage hands the job that commits it: the index's facts and
faiss files."""

from __future__ import annotations

from typing import Any

from pipeline.common import fileio
from pipeline.index.factory import IndexPlan
from pipeline.index.recall import RECALL_MEASURE
from schemas.manifest import FileEntry, VectorIndex
from schemas.measures import DepthRecall, OwnDocumentRecall
from schemas.stage_config import IndexConfig

BUILD_INFO_FILE = "build_info.json"


class BuildInfo(VectorIndex):
    """The index's facts as a manifest records them (`VectorIndex`), with its faiss files and
    how many vectors and filled parts went in."""

    num_vectors: int
    parts: int
    files: list[FileEntry]  # paths relative to faiss/

    def vector_index(self) -> dict[str, Any]:
        """The `VectorIndex` fields, for the manifest that records them."""
        return {name: getattr(self, name) for name in VectorIndex.model_fields}


def write_build_info(
    plan: IndexPlan,
    cfg: IndexConfig,
    *,
    out_dir: str,
    parts: int,
    files: list[dict],
    tuned: tuple[int | None, float, bool, int],
    rate: float,
    curve: list[DepthRecall] | None,
    own: OwnDocumentRecall | None,
) -> BuildInfo:
    """build_info.json: what the manifest records of the index, and its faiss files; `tuned`:
    (depth, recall, plateau, query sample size); `curve`: the recall at each depth measured
    (None for an exact index); `own`: the recall with the query's own document excluded
    (None: documents unknown)."""
    depth, recall, plateau, sample_size = tuned
    info = {
        "index_factory": plan.factory,
        "nprobe": depth,
        "dim": plan.dim,
        "metric": "inner_product",
        "num_vectors": sum(f["rows"] for f in files),
        "training_vectors": plan.train_size,
        "clustering": plan.clustering,
        "parts": parts,
        "recall_at_k": {
            "measure": RECALL_MEASURE,
            "value": recall,
            "sample_size": int(sample_size),
            "nprobe": depth,
            "target": cfg.target_recall,
            "plateau": plateau,
            "curve": None if curve is None else [point.model_dump() for point in curve],
            "own_document_excluded": None if own is None else own.model_dump(exclude_unset=True),
        },
        "queries_per_second": round(rate, 1),
        "index_bytes": sum(f["bytes"] for f in files),
        "files": files,
        "memory_budget": cfg.memory_budget,
        "slice_bytes": cfg.slice_bytes if len(files) > 1 else None,
    }
    fileio.write_json_atomic(fileio.join(out_dir, BUILD_INFO_FILE), info)
    return BuildInfo.model_validate(info)
