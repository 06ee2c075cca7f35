"""Imported at the start of every Python process whose PYTHONPATH holds this directory. While
BUNDLE_PEAKS_DIR is set (`benchmarks/decontamination.py --bundles` and
`benchmarks/scale_rehearsal.py` set it for a job, and Beam's worker processes inherit it):

- every bundle a process runs is recorded in BUNDLE_PEAKS_DIR/<pid>.jsonl: its transforms'
  names, how far it raised the process's resident memory (VmHWM, reset through
  /proc/self/clear_refs as the bundle starts, less VmRSS then; the heap's free memory is handed
  back first, `malloc_trim`, else a bundle would reuse what an earlier one freed and show
  less), the bytes the process read meanwhile (`rchar` of /proc/self/io: files and pipes, page
  cache or not) and its wall time. Bundles a process runs at once (Flink starts a stage's while
  the one before it still streams) are one record: the reset waits until none runs, and the
  record names every transform of the bundles that overlapped, with how many there were. No
  bundle waits for another (a lock would: their inputs share one data channel, whose queue
  for a waiting bundle fills and stalls every other);
- the runner process (Beam's local FnApiRunner, which groups every shuffle itself) counts the
  encoded bytes each GroupByKey receives, by the transform's name, and writes them at exit to
  BUNDLE_PEAKS_DIR/shuffles-<pid>.json. Reshuffle and CoGroupByKey are GroupByKeys underneath,
  so every shuffle of a job is counted; side inputs and a stage's plain outputs are not
  shuffles and are not;
- Beam's local runner streams a bundle's input to its worker, as a cluster's shuffle reads
  stream (`_stream_inputs`, `_stream_groups`), and Beam's data channel buffers 1 MB each way
  (`_small_data_channel`), so that a bundle's rise is what its steps hold, not its share of a
  stage or the channel's filling;
- with BUNDLE_PEAKS_TRACE set too, the process traces Python's allocations (`tracemalloc`,
  5-25x slower) and each record adds `traced_rise_kb`: the most the bundle's Python objects
  held above what was traced as it started (numpy's arrays included; faiss's and Arrow's own
  allocations not), which tells a step's objects from the allocator's and native libraries'
  share of its rise."""

import atexit
import ctypes
import json
import os
import threading
import time
import tracemalloc
from collections import Counter
from pathlib import Path


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _bytes_read() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise KeyError("rchar")


def _record_bundles(directory: Path) -> None:
    from apache_beam.runners.worker import bundle_processor

    original = bundle_processor.BundleProcessor.process_bundle
    guard = threading.Lock()  # over `running` only, never held while a bundle runs
    running: dict = {"bundles": 0}
    log = directory / f"{os.getpid()}.jsonl"

    libc = ctypes.CDLL("libc.so.6")

    def process_bundle(self, *args, **kwargs):
        with guard:
            if running["bundles"] == 0:
                libc.malloc_trim(0)
                Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
                running.update(
                    rss_kb=_status_kb("VmRSS"), read=_bytes_read(), began=time.perf_counter(), names=set(), overlapped=0
                )
                if tracemalloc.is_tracing():
                    tracemalloc.reset_peak()
                    running["traced"] = tracemalloc.get_traced_memory()[0]
            running["bundles"] += 1
            running["overlapped"] += 1
        try:
            return original(self, *args, **kwargs)
        finally:
            with guard:
                running["names"].update(t.unique_name for t in self.process_bundle_descriptor.transforms.values())
                running["bundles"] -= 1
                if running["bundles"] == 0:
                    record = {
                        "rss_kb": running["rss_kb"],
                        "rise_kb": _status_kb("VmHWM") - running["rss_kb"],
                        "read_bytes": _bytes_read() - running["read"],
                        "seconds": round(time.perf_counter() - running["began"], 3),
                        "bundles": running["overlapped"],
                        "transforms": sorted(running["names"]),
                    }
                    if tracemalloc.is_tracing():
                        record["traced_rise_kb"] = (tracemalloc.get_traced_memory()[1] - running["traced"]) // 1024
                    with log.open("a") as f:
                        f.write(json.dumps(record) + "\n")

    bundle_processor.BundleProcessor.process_bundle = process_bundle


def _count_shuffles(directory: Path) -> None:
    from apache_beam.runners.portability.fn_api_runner import execution

    shuffled: Counter = Counter()
    names: dict[int, str] = {}
    get_buffer = execution.BundleContextManager.get_buffer
    append = execution.GroupingBuffer.append

    def named_get_buffer(self, buffer_id, transform_id):
        buffer = get_buffer(self, buffer_id, transform_id)
        kind, name = execution.split_buffer_id(buffer_id)
        if kind == "group":
            names[id(buffer)] = self.execution_context.pipeline_components.transforms[name].unique_name
        return buffer

    def counted_append(self, elements_data):
        shuffled[names.get(id(self), "?")] += len(elements_data)
        return append(self, elements_data)

    def write():
        if shuffled:
            (directory / f"shuffles-{os.getpid()}.json").write_text(json.dumps(dict(shuffled)))

    execution.BundleContextManager.get_buffer = named_get_buffer
    execution.GroupingBuffer.append = counted_append
    atexit.register(write)


DATA_CHANNEL_BYTES = 1 << 20  # a message to or from a worker, and each buffer of Beam's data channel


def _stream_groups() -> None:
    """Beam's local runner encodes a worker's whole share of a GroupByKey's output into one
    message (`GroupingBuffer.partition`), so a step after a shuffle would show that share as
    its own memory. Cut into messages of about DATA_CHANNEL_BYTES between groups, which
    `_stream_inputs` sends one by one (the runner would join them into one again)."""
    from apache_beam.coders.coder_impl import create_OutputStream
    from apache_beam.runners.portability.fn_api_runner import execution
    from apache_beam.transforms.window import GlobalWindows

    partition = execution.GroupingBuffer.partition

    def streamed_partition(self, n):
        if self._grouped_output or not self._windowing.is_default():
            return partition(self, n)
        coder_impl, key_coder_impl = self._post_grouped_coder.get_impl(), self._key_coder.get_impl()
        parts: list[list[bytes]] = [[] for _ in range(n)]
        streams = [create_OutputStream() for _ in range(n)]
        for number, (encoded_key, values) in enumerate(self._table.items()):
            stream = streams[number % n]
            grouped = GlobalWindows.windowed_value((key_coder_impl.decode(encoded_key), values))
            coder_impl.encode_to_stream(grouped, stream, True)
            if stream.size() >= DATA_CHANNEL_BYTES:
                parts[number % n].append(stream.get())
                streams[number % n] = create_OutputStream()
        for part, stream in zip(parts, streams):
            if stream.size():
                part.append(stream.get())
        self._grouped_output = parts
        self._table.clear()
        return parts

    execution.GroupingBuffer.partition = streamed_partition


def _stream_inputs() -> None:
    """Beam's local runner writes a bundle's whole input into one message before it asks the
    worker to start the bundle (`BundleManager._send_input_to_worker`), so the worker holds
    all of it at once. Sent as it is written (a message per flush size, `_small_data_channel`)
    and beside the bundle, not before it, the input streams through the worker's bounded
    receive queue as a cluster's shuffle reads stream. (A send that fails prints its error,
    Python's default for a thread, and its bundle waits: this is a benchmark's instrument.)"""
    from apache_beam.runners.portability.fn_api_runner import fn_runner

    def streamed_send(self, process_bundle_id, read_transform_id, byte_streams) -> None:
        data_out = self._worker_handler.data_conn.output_stream(process_bundle_id, read_transform_id)

        def send():
            for byte_stream in byte_streams or []:
                data_out.write(byte_stream)
                data_out.maybe_flush()  # whole elements: each byte stream holds whole ones
            data_out.close()

        threading.Thread(target=send, daemon=True, name=f"send-{process_bundle_id}").start()

    fn_runner.BundleManager._send_input_to_worker = streamed_send


def _small_data_channel() -> None:
    """Beam's data channel holds up to 10 MB of a bundle's output before it sends it
    (`data_plane`'s flush size) and queues up to 100 MB of it for the runner, fixed per
    process (part of the SDK process's memory), filled as far as a bundle's output reaches
    and the runner lags: the local runner, one Python process, does. A step whose bundle
    writes less than that at N and more at 4N would show the channel's filling as its growth
    (measured: build-shards' search at 4N held 10.5 MB of Python objects in the output
    buffer alone, tracemalloc); at 1 MB each, a rise is what the step holds."""
    from apache_beam.runners.worker import data_plane

    data_plane._DEFAULT_SEND_QUEUE_MAX_BYTES = DATA_CHANNEL_BYTES  # read when a channel is made
    stream = data_plane.SizeBasedBufferingClosableOutputStream
    close, flush, _, warn = stream.__init__.__defaults__  # the flush size is a default argument
    stream.__init__.__defaults__ = (close, flush, DATA_CHANNEL_BYTES, warn)


if os.environ.get("BUNDLE_PEAKS_DIR"):
    if os.environ.get("BUNDLE_PEAKS_TRACE"):
        tracemalloc.start()
    _small_data_channel()
    _stream_inputs()
    _stream_groups()
    _record_bundles(Path(os.environ["BUNDLE_PEAKS_DIR"]))
    _count_shuffles(Path(os.environ["BUNDLE_PEAKS_DIR"]))
