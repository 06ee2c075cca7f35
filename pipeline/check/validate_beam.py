"""`validate DIR -- --runner=...`: the checks of `pipeline.check.validate` as a Beam job, on the
runners the pipeline runs on, so no process holds the whole output.

`ValidateOutput` runs the plan's units as ParDos: listed files hashed, one shard per element
(its references keyed by chunk file number), a GroupByKey that brings each chunk file its
references so each group reads only that file, embedding files, then the few cross-file
checks over small summaries (chunk-file boundaries, document runs, seq_id ranges, faiss
probes). Problems become (kind, message) elements, counted by kind with the first few of
each kept (`Problems`); the job's last step fails it when there are any, with that report.
"""

from __future__ import annotations

import re

import apache_beam as beam

from pipeline.check.plan import ValidationPlan, plan_validation
from pipeline.check.problems import ValidationFailed, check_listed_file
from pipeline.check.rules import (
    check_chunk_boundaries,
    check_chunk_file,
    check_document_runs,
    check_embedding_file,
    check_faiss_index,
    check_seq_ranges,
    check_shard,
)
from pipeline.check.validate import Problems, Verdict
from pipeline.jobs.job import Job

PROBLEMS = "problems"


SAMPLED, UNSAMPLED = "sampled", "unsampled"  # what a chunk file is when no checked shard references it


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


def _check_chunk_file_group(group, chunks, index):
    """One chunk file with what points at it (its mark from the plan, the reference blocks):
    its summary, then its first problem."""
    number, values = group
    blocks = [value for value in values if value not in (SAMPLED, UNSAMPLED)]
    try:
        yield from check_chunk_file(chunks, number, blocks or None, index, SAMPLED in values)
    except ValidationFailed as problem:
        yield _problem(problem)


class _GatherProblems(beam.CombineFn):
    def create_accumulator(self):
        return Problems()

    def add_input(self, problems, problem):
        return problems.add(*problem)

    def merge_accumulators(self, accumulators):
        merged = Problems()
        for problems in accumulators:
            merged.merge(problems)
        return merged

    def extract_output(self, problems):
        return problems


class ValidateOutput(beam.PTransform):
    """The plan's checks; outputs one `Verdict`: passed with the plan's lines, or failed with
    the problems' report."""

    def __init__(self, plan: ValidationPlan):
        super().__init__()
        self.plan = plan

    def expand(self, pipeline):
        plan, problems = self.plan, []

        def checked(label, elements, check, *args):
            outputs = elements | label >> beam.FlatMap(_checking(check), *args).with_outputs(PROBLEMS, main="passed")
            problems.append(outputs[PROBLEMS])
            return outputs.passed

        # The units come from the manifests, planned again on a worker: a Create of every shard
        # entry would put them all into the job's graph, whose size runners cap.
        units = (
            pipeline
            | "Manifests" >> beam.Create([(plan.path, plan.sample, plan.index_directory)])
            | "Plan" >> beam.MapTuple(plan_validation)
        )

        def spread(label, units_of):  # one unit an element, spread over the workers
            return units | label >> beam.FlatMap(units_of) | f"Spread{label}" >> beam.Reshuffle()

        listed = spread("ListedFiles", lambda p: p.listed_files)
        checked("CheckListedFiles", listed, lambda file: check_listed_file(*file))
        shards = checked(
            "CheckShards",
            spread("Shards", lambda p: p.shard_entries),
            lambda entry, facts: check_shard(facts, entry),
            plan.shards,
        )
        references = shards | "ReferencesByChunkFile" >> beam.FlatMap(lambda shard: shard.references.items())
        marks = units | "ChunkFiles" >> beam.FlatMap(
            lambda p: [(n, SAMPLED) for n in p.sampled_chunk_files] + [(n, UNSAMPLED) for n in p.unsampled_chunk_files]
        )
        summaries = (
            (references, marks)
            | "WithMarks" >> beam.Flatten()
            | "PerChunkFile" >> beam.GroupByKey()
            | "CheckChunkFiles"
            >> beam.FlatMap(_check_chunk_file_group, plan.chunks, plan.index).with_outputs(PROBLEMS, main="passed")
        )
        problems.append(summaries[PROBLEMS])
        summaries = summaries.passed
        if plan.shards is not None:
            ranges = shards | "SeqRange" >> beam.Map(lambda s: (s.first_seq, s.last_seq, s.path))
            checked("CheckSeqRanges", ranges | "AllSeqRanges" >> beam.combiners.ToList(), check_seq_ranges)
        probes = pipeline | "NoProbes" >> beam.Create([])
        if plan.index is not None:
            ends = summaries | "Ends" >> beam.Map(lambda s: s.ends) | "AllEnds" >> beam.combiners.ToList()
            checked("CheckBoundaries", ends, lambda e, index: check_chunk_boundaries(index, e), plan.index)
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
                lambda r, index, files: check_document_runs(index, *r, files),
                plan.index,
                beam.pvalue.AsSingleton(files),
            )
            probes = checked(
                "CheckEmbeddingFiles",
                spread("EmbeddingFiles", lambda p: p.embedding_files),
                lambda position, index, per_file: check_embedding_file(index, position, per_file),
                plan.index,
                plan.probes_per_file,
            )
        if plan.faiss_index is not None:
            checked(
                "CheckFaissIndex",
                probes | "AllProbes" >> beam.combiners.ToList(),
                lambda p, facts: check_faiss_index(facts, p),
                plan.faiss_index,
            )
        path, lines = plan.path, list(plan.lines)
        return (
            problems
            | "AllProblems" >> beam.Flatten()
            | "GatherProblems" >> beam.CombineGlobally(_GatherProblems())
            | "Verdict" >> beam.Map(lambda found: found.verdict(path, lines))
        )


def _fail_on_problems(verdict: Verdict) -> None:
    if not verdict.passed:
        raise ValidationFailed("\n".join(verdict.lines))


def validate_with_beam(path: str, beam_args: list[str], sample: float = 1.0) -> list[str]:
    """Run the validation of `path` as a Beam job with these pipeline options; its lines, or
    ValidationFailed with the job's report."""
    plan = plan_validation(path, sample)
    job = Job.reading("validate", path, beam_args)
    _ = job.pipeline | "Validate" >> ValidateOutput(plan) | "FailOnProblems" >> beam.Map(_fail_on_problems)
    try:
        job.run()
    except ValidationFailed as failed:  # in-process runners re-raise it with the step appended
        raise ValidationFailed(re.sub(r" \[while running '[^']*'\]$", "", str(failed))) from None
    return plan.lines
