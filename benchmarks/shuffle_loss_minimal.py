"""Smallest Beam-only pipeline shaped like build-shards' retrieval join, to reproduce the
shuffle loss seen on the local multi-process runner (no project code but the avoidance,
with `--no-time-flush`).

    .venv/bin/python benchmarks/shuffle_loss_minimal.py [--runs 5] [--sequences 24999]
        [--workers 2] [--mode multi_processing] [--load 0] [--files 4] [--picks 16]
        [--payload 512]

Per run (a subprocess of its own, `--direct_num_workers=W --direct_running_mode=MODE`):

  batches (Create) -> sequences (seq_id, 2 KB of int32 tokens)
  JoinQueries:     CoGroupByKey by search batch (64 sequences)        -- shuffle 1
  Search:          per sequence `--picks` picks keyed by "chunk file"  (+ SENT counts, tagged)
  GroupPicks:      GroupByKey by file (`--files` keys, ~100k values each) -- shuffle 2
  NeighbourTokens: per pick (seq_id, (j, slot, chunk_id, score, `--payload` bytes of numpy))
  JoinNeighbours:  CoGroupByKey by seq_id {sequence, picks, sent}     -- shuffle 3
  Count:           per sequence (received, sent), summed as data

and prints `sent X received Y` (picks), the number of sequences short of picks and a sample.
`--load N` runs N busy-loop processes during the runs (the loss was seen under CPU load);
`--widen S` forces the race open with a timing-only patch of the runner (see widen_race_window).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

BATCH = 64


def widen_race_window(delay: float) -> None:
    """Timing only, no logic changed: the runner pauses `delay` s after writing each input
    message of a bundle to its output stream (as a loaded machine does), and its data channel
    pauses `delay` s before queueing each outgoing data message (as `_enqueue_to_send` does
    when the 100 MB send queue is full). The 1 s flusher thread of the runner's
    TimeBasedBufferingClosableOutputStream then fires while a bundle's inputs are being
    written, and every write that lands between its `get()` and `_clear()` is dropped."""
    from apache_beam.portability.api import beam_fn_api_pb2
    from apache_beam.runners.portability.fn_api_runner import fn_runner
    from apache_beam.runners.worker import data_plane

    def _send_input_to_worker(self, process_bundle_id, read_transform_id, byte_streams):
        data_out = self._worker_handler.data_conn.output_stream(process_bundle_id, read_transform_id)
        for byte_stream in byte_streams or []:
            data_out.write(byte_stream)
            time.sleep(delay)
        data_out.close()

    fn_runner.BundleManager._send_input_to_worker = _send_input_to_worker

    enqueue = data_plane._GrpcDataChannel._enqueue_to_send

    def _enqueue_to_send(self, elem):
        if isinstance(elem, beam_fn_api_pb2.Elements.Data) and elem.data:
            time.sleep(delay)
        return enqueue(self, elem)

    data_plane._GrpcDataChannel._enqueue_to_send = _enqueue_to_send


def job(out: str, sequences: int, files: int, picks: int, payload: int, widen: float, beam_args: list[str]) -> None:
    if "--no-time-flush" in beam_args:  # the project's avoidance: no 1 s flusher thread on the runner's streams
        beam_args = [a for a in beam_args if a != "--no-time-flush"]
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from pipeline.jobs.options import no_timed_flush_on_local_runner

        no_timed_flush_on_local_runner()
    if widen:
        widen_race_window(widen)
    import apache_beam as beam
    import numpy as np
    from apache_beam.options.pipeline_options import PipelineOptions

    batches = (sequences + BATCH - 1) // BATCH

    def make_sequences(batch):
        for s in range(batch * BATCH, min((batch + 1) * BATCH, sequences)):
            tokens = np.random.default_rng(s).integers(1, 30000, 513).astype(np.int32)
            yield s, tokens.tobytes()

    class Search(beam.DoFn):  # a DoFn, as the project's: no output type inferred
        def process(self, keyed):
            yield from search(keyed)

    def search(keyed):
        batch, grouped = keyed
        seqs = sorted(grouped["sequences"])
        for seq_id, _ in seqs:
            rng = np.random.default_rng([seq_id, 1])
            chunk_ids = rng.integers(0, files * 65536, picks)
            for j, chunk_id in enumerate(chunk_ids.tolist()):
                yield chunk_id // 65536, (chunk_id, (seq_id, j // 2, j % 2, float(j)))
            yield beam.pvalue.TaggedOutput("sent", (seq_id, picks))

    def neighbour_tokens(keyed):
        number, group = keyed
        values = np.arange(payload // 4 * 4096, dtype=np.int32).reshape(4096, -1)
        for chunk_id, (seq_id, j, slot, score) in group:
            yield seq_id, (j, slot, chunk_id, score, values[chunk_id % 4096].tobytes())

    def count(keyed):
        seq_id, grouped = keyed
        got = sum(1 for _ in grouped["picks"])
        sent = list(grouped["sent"])
        nseq = sum(1 for _ in grouped["sequence"])
        yield {
            "sequences": nseq,
            "received": got,
            "sent": sum(sent),
            "short": int(got != sum(sent)),
            "sample": [(seq_id, got, sent)] if got != sum(sent) or nseq != 1 else [],
        }

    def merge(rows):
        total = {"sequences": 0, "received": 0, "sent": 0, "short": 0, "sample": []}
        for r in rows:
            for k in ("sequences", "received", "sent", "short"):
                total[k] += r[k]
            total["sample"] = (total["sample"] + r["sample"])[:5]
        return total

    with beam.Pipeline(options=PipelineOptions(["--runner=FnApiRunner", *beam_args])) as p:
        seqs = p | "Batches" >> beam.Create(list(range(batches))) | "Sequences" >> beam.FlatMap(make_sequences)
        searched = (
            {"sequences": seqs | "ByBatch" >> beam.Map(lambda s: (s[0] // BATCH, s))}
            | "JoinQueries" >> beam.CoGroupByKey()
            | "Search" >> beam.ParDo(Search()).with_outputs("sent", main="picks")
        )
        neighbours = (
            searched.picks | "GroupPicks" >> beam.GroupByKey() | "NeighbourTokens" >> beam.FlatMap(neighbour_tokens)
        )
        _ = (
            {"sequence": seqs, "picks": neighbours, "sent": searched.sent}
            | "JoinNeighbours" >> beam.CoGroupByKey()
            | "Count" >> beam.FlatMap(count)
            | "Total" >> beam.CombineGlobally(merge)
            | "Write" >> beam.Map(lambda t: open(out, "w").write(json.dumps(t)))
        )


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_job":
        out, sequences, files, picks, payload = sys.argv[2], *map(int, sys.argv[3:7])
        return job(out, sequences, files, picks, payload, float(sys.argv[7]), sys.argv[8:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--sequences", type=int, default=24_999)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--picks", type=int, default=16)
    parser.add_argument("--payload", type=int, default=512)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--mode", default="multi_processing")
    parser.add_argument("--load", type=int, default=0, help="busy-loop processes during the runs")
    parser.add_argument(
        "--no-time-flush",
        action="store_true",
        help="the project's avoidance (pipeline.jobs.options.no_timed_flush_on_local_runner) in the job process",
    )
    parser.add_argument(
        "--widen",
        type=float,
        default=0.0,
        help="seconds: open the race window (a timing-only monkeypatch of the runner, see widen_race_window)",
    )
    args = parser.parse_args()
    loaders = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    beam_args = [f"--direct_num_workers={args.workers}", f"--direct_running_mode={args.mode}"]
    if args.no_time_flush:
        beam_args.append("--no-time-flush")
    lost_runs = 0
    try:
        for run in range(args.runs):
            out = tempfile.mktemp(prefix="shuffle-min-", suffix=".json")
            start = time.perf_counter()
            proc = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "_job",
                    out,
                    str(args.sequences),
                    str(args.files),
                    str(args.picks),
                    str(args.payload),
                    str(args.widen),
                    *beam_args,
                ],
                capture_output=True,
                text=True,
            )
            wall = time.perf_counter() - start
            if proc.returncode or not os.path.exists(out):
                print(f"run {run}: FAILED rc={proc.returncode} in {wall:.0f} s\n{proc.stderr[-2000:]}", flush=True)
                continue
            t = json.load(open(out))
            os.unlink(out)
            expected = args.sequences * args.picks
            lost = t["sent"] != t["received"] or t["sent"] != expected or t["sequences"] != args.sequences
            lost_runs += lost
            print(
                f"run {run}: sent {t['sent']} received {t['received']} (expected {expected}); sequences "
                f"{t['sequences']}, short of picks {t['short']}{' sample ' + str(t['sample']) if t['sample'] else ''}"
                f" in {wall:.0f} s{'  LOST' if lost else ''}",
                flush=True,
            )
    finally:
        for loader in loaders:
            loader.kill()
    print(f"{lost_runs}/{args.runs} runs lost elements")


if __name__ == "__main__":
    main()
