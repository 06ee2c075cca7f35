"""`validate DIR -- --runner=...`: the checks of `pipeline.check.validate` as a Beam job, on the
runners the pipeline runs on, so no process holds the whole output.

`ValidateOutput` plans from the manifests on a worker (facts only: sums and runs, no entry per
file) and hands each row group of the manifests' file tables to a worker, which makes its units
(`pipeline.check.units`): listed files hashed, one per element (a sample: their sizes, a row
group's per element), one shard per element (its references keyed by chunk file number), a
GroupByKey that brings each chunk file its unit and references so each group reads only that file
(or the row groups the references fall in), embedding files, then the cross-file checks over small
summaries (each chunk-file boundary, document runs counted per doc id, seq_id ranges, faiss
probes). Problems become (kind, message) elements, counted by kind with the first few of each kept
(`Problems`); the job's last step fails it when there are any, with that report."""

from __future__ import annotations

import re
from dataclasses import dataclass

import apache_beam as beam

from pipeline.check.facts import ChunkFileUnit, EmbeddingFileUnit, EntryGroup, ListedFile, ListedSizes
from pipeline.check.plan import ValidationPlan, plan_validation
from pipeline.check.problems import ValidationFailed, check_listed_file, check_listed_sizes
from pipeline.check.rules import (
    check_chunk_boundaries,
    check_document_runs,
    check_embedding_file,
    check_faiss_index,
)
from pipeline.check.shard_rules import SEQ_BLOCK, ShardsTogether, check_chunk_file, check_shard, check_shards_together
from pipeline.check.units import units_of
from pipeline.check.validate import Problems, Verdict
from pipeline.jobs.job import Job, graph_bytes
from pipeline.jobs.options import new_pipeline
from schemas.manifest import ShardEntry

PROBLEMS = "problems"


def _problem(problem: ValidationFailed):
    return beam.pvalue.TaggedOutput(PROBLEMS, (problem.kind, str(problem)))


def _checking(check):
    """A FlatMap function: the check's result (unless None), or its problem as a tagged
    (kind, message) output; any other error fails the job as usual."""

    def run(element, *args):
        try:
            result = check(element, *args)
        except ValidationFailed as problem:
            yield _problem(problem)
        else:
            if result is not None:
                yield result

    return run


_UNIT_TAGS = {
    ShardEntry: "shards",
    ChunkFileUnit: "chunk_files",
    EmbeddingFileUnit: "embedding_files",
    ListedFile: "listed",
    ListedSizes: "sizes",
}


def _tagged_units(group: EntryGroup, facts: ValidationPlan):
    """The units of one row group of entries, each tagged by its kind; an entry the manifest
    model refuses, as a problem."""
    try:
        for unit in units_of(facts, group):
            yield beam.pvalue.TaggedOutput(_UNIT_TAGS[type(unit)], unit)
    except ValidationFailed as problem:
        yield _problem(problem)


def _check_chunk_file_group(group, facts: ValidationPlan):
    """One chunk file with what points at it (its unit from the plan, the reference blocks):
    what was read, then its first problem."""
    number, values = group
    values = list(values)
    units = [value for value in values if isinstance(value, ChunkFileUnit)]
    if len(units) != 1:  # every chunk file is planned once, and shards only point at planned ones
        raise ValueError(f"chunk file {number}: {len(units)} units planned")
    blocks = [value for value in values if not isinstance(value, ChunkFileUnit)]
    assert facts.chunks is not None  # a plan with chunk files has their database
    try:
        yield from check_chunk_file(facts.chunks, units[0], blocks or None, facts.index)
    except ValidationFailed as problem:
        yield _problem(problem)


def _ends_with_neighbours(ends):
    """Each file's boundary rows to its own key and the next file's: each key then holds a
    boundary's two sides (the first and last file's key, one)."""
    return [(ends.number, ends), (ends.number + 1, ends)]


class _Summed(beam.CombineFn):
    """Values summed into one accumulator of `kind` (`Problems`, `ShardsTogether`): each value's
    fields given to its `add`, or with `of_parts` each value an accumulator of its own, merged."""

    def __init__(self, kind: type, *, of_parts: bool = False):
        self.kind, self.of_parts = kind, of_parts

    def create_accumulator(self):
        return self.kind()

    def add_input(self, summed, value):
        return summed.merge(value) if self.of_parts else summed.add(*value)

    def merge_accumulators(self, accumulators):
        merged = self.kind()
        for summed in accumulators:
            merged.merge(summed)
        return merged

    def extract_output(self, summed):
        return summed


@dataclass(frozen=True)
class OutputParts:
    """Which checks an output needs: all the job's graph is built from besides the path."""

    shards: bool
    index: bool
    faiss_index: bool

    @classmethod
    def of(cls, plan: ValidationPlan) -> OutputParts:
        return cls(plan.shards is not None, plan.index is not None, plan.faiss_index is not None)


class ValidateOutput(beam.PTransform):
    """The checks of the output at `path`; outputs one `Verdict`: passed with the plan's lines,
    or failed with the problems' report. The graph holds the path, the sample and the parts
    (`OutputParts`) and the commits planned from only, whatever the number of files: the job
    plans again from those commits' manifests on a worker, its file tables' row groups are
    handed to the workers, which make the units, and the plan (facts only: chunk files as runs)
    is a side input."""

    def __init__(self, plan: ValidationPlan, parts: OutputParts):
        super().__init__()
        self.path, self.sample, self.index_directory, self.parts = plan.path, plan.sample, plan.index_directory, parts
        self.commits, self.hash_all = plan.commits, plan.hash_all

    @classmethod
    def of(cls, plan: ValidationPlan) -> ValidateOutput:
        return cls(plan, OutputParts.of(plan))

    def expand(self, pipeline):
        problems, parts = [], self.parts

        def checked(label, elements, check, *args):
            outputs = elements | label >> beam.FlatMap(_checking(check), *args).with_outputs(PROBLEMS, main="passed")
            problems.append(outputs[PROBLEMS])
            return outputs.passed

        plans = (
            pipeline
            | "Manifests" >> beam.Create([(self.path, self.sample, self.index_directory)])
            | "Plan" >> beam.MapTuple(plan_validation, commits=self.commits, hash_all=self.hash_all)
        )
        facts = beam.pvalue.AsSingleton(plans)
        units = (
            plans
            | "EntryGroups" >> beam.FlatMap(lambda plan: plan.entry_groups)
            | "SpreadEntryGroups" >> beam.Reshuffle()
            | "Units" >> beam.FlatMap(_tagged_units, facts).with_outputs(PROBLEMS, *_UNIT_TAGS.values())
        )
        problems.append(units[PROBLEMS])

        def spread(tag):  # one unit an element, spread over the workers
            return units[tag] | f"Spread{tag}" >> beam.Reshuffle()

        checked("CheckListedFiles", spread("listed"), lambda file: check_listed_file(file.directory, file.entry))
        checked("CheckListedSizes", units["sizes"], lambda files: check_listed_sizes(files.directory, files.entries))
        shards = checked("CheckShards", spread("shards"), lambda e, f: check_shard(f.shards, e), facts)
        references = shards | "ReferencesByChunkFile" >> beam.FlatMap(lambda shard: shard.references.items())
        chunk_files = units["chunk_files"] | "ByNumber" >> beam.Map(lambda unit: (unit.number, unit))
        read = (
            (references, chunk_files)
            | "WithUnits" >> beam.Flatten()
            | "PerChunkFile" >> beam.GroupByKey()
            | "CheckChunkFiles" >> beam.FlatMap(_check_chunk_file_group, facts).with_outputs(PROBLEMS, main="passed")
        )
        problems.append(read[PROBLEMS])
        summaries = read.passed | "Summaries" >> beam.FlatMap(lambda c: [] if c.summary is None else [c.summary])
        if parts.shards:
            shard_summaries = shards | "ShardSummaries" >> beam.Map(lambda s: s.summary)
            checked(
                "CheckShardsTogether",
                shard_summaries
                | "BySeqBlock" >> beam.Map(lambda summary: (summary[0] // SEQ_BLOCK, summary))
                | "ShardsTogetherPerBlock" >> beam.CombinePerKey(_Summed(ShardsTogether))
                | "Blocks" >> beam.Values()
                | "ShardsTogether" >> beam.CombineGlobally(_Summed(ShardsTogether, of_parts=True)),
                lambda together, f: check_shards_together(together, f.shards),
                facts,
            )
        probes = pipeline | "NoProbes" >> beam.Create([])
        if parts.index:
            boundaries = (
                summaries
                | "EndsByBoundary" >> beam.FlatMap(lambda s: _ends_with_neighbours(s.ends))
                | "PerBoundary" >> beam.GroupByKey()
            )
            checked("CheckBoundaries", boundaries, lambda b, f: check_chunk_boundaries(f.index, list(b[1])), facts)
            runs = (
                summaries
                | "DocumentStarts" >> beam.FlatMap(lambda s: s.doc_starts.tolist())
                | "RunsPerDocument" >> beam.combiners.Count.PerElement()
                | "RunsAndOne" >> beam.Map(lambda doc_runs: (doc_runs[1], 1))
                | "DocumentRuns" >> beam.CombineGlobally(beam.combiners.TupleCombineFn(sum, sum))
            )
            files = summaries | "FilesSummarized" >> beam.combiners.Count.Globally()
            checked(
                "CheckDocumentRuns",
                runs,
                lambda r, f, files: check_document_runs(f.index, *r, files),
                facts,
                beam.pvalue.AsSingleton(files),
            )
            probes = checked(
                "CheckEmbeddingFiles",
                spread("embedding_files"),
                lambda unit, f: check_embedding_file(f.index, unit, f.probes_per_file),
                facts,
            )
        if parts.faiss_index:
            checked(
                "CheckFaissIndex",
                probes | "AllProbes" >> beam.combiners.ToList(),
                lambda p, f: check_faiss_index(f.faiss_index, p),
                facts,
            )
        return (
            problems
            | "AllProblems" >> beam.Flatten()
            | "GatherProblems" >> beam.CombineGlobally(_Summed(Problems))
            | "Verdict" >> beam.Map(lambda found, f: found.verdict(f.path, f.lines), facts)
        )


def _fail_on_problems(verdict: Verdict) -> None:
    if not verdict.passed:
        raise ValidationFailed("\n".join(verdict.lines))


def _build(pipeline: beam.Pipeline, plan: ValidationPlan) -> None:
    _ = pipeline | "Validate" >> ValidateOutput.of(plan) | "FailOnProblems" >> beam.Map(_fail_on_problems)


def validate_job_graph_bytes(path: str, beam_args: list[str] | None = None, sample: float = 1.0) -> int:
    """The size of the validation job's graph as `validate_with_beam` builds it (serialised
    runner API proto, what a runner is sent), built here without running it."""
    pipeline = new_pipeline(list(beam_args or []), dry_run=True)
    _build(pipeline, plan_validation(path, sample))
    return graph_bytes(pipeline)


def validate_with_beam(
    path: str,
    beam_args: list[str],
    sample: float = 1.0,
    commits: dict[str, int] | None = None,
    *,
    hash_all: bool = False,
) -> list[str]:
    """Run the validation of `path` as a Beam job with these pipeline options; its lines, or
    ValidationFailed with the job's report. The plan made here (the manifests' own checks run
    before anything is submitted) decides which parts the job has and pins the commits it
    reads (`commits`, `hash_all`: as `plan_validation`'s)."""
    plan = plan_validation(path, sample, commits=commits, hash_all=hash_all)
    job = Job.reading("validate", path, beam_args)
    try:
        job.run(lambda pipeline, _: _build(pipeline, plan))
    except ValidationFailed as failed:  # in-process runners re-raise it with the step appended
        raise ValidationFailed(re.sub(r" \[while running '[^']*'\]$", "", str(failed))) from None
    return plan.lines
