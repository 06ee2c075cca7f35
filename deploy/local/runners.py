"""Beam's Flink and Spark runners on this machine, from pinned jars: a Flink session cluster of
one JobManager and two TaskManagers, each its own JVM, on loopback, with Beam's Flink job
server beside it; and Beam's Spark job server, which runs Spark inside itself (`local[2]`).

    python deploy/local/runners.py install        # the pinned jars (Maven, PyPI), sha256-checked
    python deploy/local/runners.py up             # start the Flink cluster (what is not running);
                                                  # last line: the Beam options that submit to it
    python deploy/local/runners.py down           # stop every process `up` started, by pid
    python deploy/local/runners.py spark-options  # the Beam options for the Spark job server

`make flink-up` / `make flink-down` run these; the tests start their own Flink cluster the same
way (`--dir`, `--rest-port`). Standard library only: it runs before anything else is installed.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

# The versions, pinned here only. Beam's Java side: the newest release whose Flink runner
# (`beam-runners-flink-1.19`) comes from Maven Central here with all its dependencies (2.63-2.69
# and 2.71-2.77 are not served; 2.70.0 lacks beam-runners-java-job-service 2.70.0); its Spark
# runner from the same release. Flink: the newest 1.19 release, from PyPI's
# apache-flink-libraries (its deps/ holds the distribution's jars; Maven Central serves no
# flink-dist). Spark: the newest 3.5 release (the first line to run on Java 17), from Maven.
BEAM_JAVA_VERSION = "2.62.0"
FLINK_MINOR = "1.19"
FLINK_VERSION = "1.19.3"
FLINK_LIBRARIES_SHA256 = "4a58e3a1fb7d83340bc96b6c080624c6d792d69fae5d294b96224775204a9c60"
SPARK_VERSION = "3.5.9"
SPARK_MASTER = "local[2]"
# The Flink cluster: jobs run at parallelism TASK_MANAGERS, a slot of each TaskManager, and the
# slots left let Flink's restart strategy rerun a job on the TaskManagers that survive one lost.
TASK_MANAGERS, SLOTS = 2, 2

HERE = Path(__file__).resolve().parent
REPOSITORY = HERE.parents[1]
DEFAULT_HOME = REPOSITORY / ".runners"  # the installed jars
JOB_MANAGER_MAIN = "org.apache.flink.runtime.entrypoint.StandaloneSessionClusterEntrypoint"
TASK_MANAGER_MAIN = "org.apache.flink.runtime.taskexecutor.TaskManagerRunner"
MEMORY_PARAMETERS = "org.apache.flink.runtime.util.bash.BashJavaUtils"

# What Flink's own config.yaml passes every JVM on Java 17 (env.java.opts.all), and what Spark
# adds (sun.nio.cs, sun.security.action, sun.util.calendar, java.lang.invoke): both serialise
# JDK classes by reflection. As JVM flags for the Flink cluster, as manifest attributes for the
# job servers' launcher jars.
EXPORTED = ["java.base/sun.net.util", "java.rmi/sun.rmi.registry", "java.security.jgss/sun.security.krb5"]
OPENED = [
    f"java.base/{package}"
    for package in (
        "java.lang",
        "java.lang.invoke",
        "java.lang.reflect",
        "java.io",
        "java.net",
        "java.nio",
        "java.text",
        "java.time",
        "java.util",
        "java.util.concurrent",
        "java.util.concurrent.atomic",
        "java.util.concurrent.locks",
        "sun.nio.ch",
        "sun.nio.cs",
        "sun.security.action",
        "sun.util.calendar",
    )
]
JAVA_17_FLAGS = [f"--add-exports={m}=ALL-UNNAMED" for m in EXPORTED] + [f"--add-opens={m}=ALL-UNNAMED" for m in OPENED]


class ClusterError(RuntimeError):
    pass


@dataclass(frozen=True)
class JobServer:
    """One of Beam's Java job servers: its Maven project (`pom.xml`, with every jar of its
    classpath pinned in `jars.sha256` beside it), the versions the project takes, its main class."""

    name: str
    artifact: str  # Beam's name for the runner: beam-runners-<artifact>
    main: str
    properties: tuple[tuple[str, str], ...]

    @property
    def project(self) -> Path:
        return HERE / f"{self.name}-job-server"

    def jar(self, home: Path) -> Path:
        """The launcher jar, beside the `lib/` it names."""
        return home / f"{self.name}-job-server" / f"beam-runners-{self.artifact}-job-server-{BEAM_JAVA_VERSION}.jar"

    def pinned(self) -> dict[str, str]:
        """jars.sha256: every jar of the classpath and its sha256."""
        pinned = {}
        for line in (self.project / "jars.sha256").read_text().splitlines():
            if line.strip() and not line.startswith("#"):
                digest, name = line.split()
                pinned[name] = digest
        return pinned


JOB_SERVERS = (
    JobServer(
        "flink",
        f"flink-{FLINK_MINOR}",
        "org.apache.beam.runners.flink.FlinkJobServerDriver",
        (("beam.version", BEAM_JAVA_VERSION), ("flink.minor", FLINK_MINOR)),
    ),
    JobServer(
        "spark",
        "spark-3",
        "org.apache.beam.runners.spark.SparkJobServerDriver",
        (("beam.version", BEAM_JAVA_VERSION), ("spark.version", SPARK_VERSION)),
    ),
)
FLINK_JOB_SERVER, SPARK_JOB_SERVER = JOB_SERVERS


# -- install -------------------------------------------------------------------------------


def flink_dir(home: Path) -> Path:
    return home / f"flink-{FLINK_VERSION}"


def _stamp(home: Path) -> Path:
    return home / ".installed"


def _pins() -> str:
    """What an installation is of: the versions, the Maven projects and the pinned digests."""
    digest = hashlib.sha256(f"{BEAM_JAVA_VERSION} {FLINK_VERSION} {FLINK_LIBRARIES_SHA256} {SPARK_VERSION}".encode())
    for server in JOB_SERVERS:
        for pinned in ("pom.xml", "jars.sha256"):
            digest.update((server.project / pinned).read_bytes())
    return digest.hexdigest()


def installed(home: Path) -> bool:
    return _stamp(home).exists() and _stamp(home).read_text() == _pins()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_jars(directory: Path, pinned: dict[str, str]) -> None:
    """Every pinned jar present with its sha256, and no other jar."""
    found = {p.name for p in directory.glob("*.jar")}
    missing, extra = sorted(pinned.keys() - found), sorted(found - pinned.keys())
    if missing or extra:
        raise ClusterError(f"{directory}: jars missing {missing[:5]}, not pinned {extra[:5]}")
    wrong = [name for name, digest in pinned.items() if _sha256(directory / name) != digest]
    if wrong:
        raise ClusterError(f"{directory}: sha256 differs from jars.sha256 for {wrong[:5]}")


def _write_launcher(jar: Path, main: str, classpath: list[str]) -> None:
    """A jar holding only a manifest: `java -jar` runs the job server's main class over the
    jars beside it (the Class-Path entries resolve relative to this jar) with the JDK modules
    Flink and Spark need opened, and the log level of the job server's own lines."""
    attributes = {
        "Manifest-Version": "1.0",
        "Main-Class": main,
        "Class-Path": " ".join(classpath),
        "Add-Exports": " ".join(EXPORTED),
        "Add-Opens": " ".join(OPENED),
    }
    lines = []
    for key, value in attributes.items():
        raw = f"{key}: {value}".encode()
        lines.append(raw[:72])
        lines += [b" " + raw[i : i + 71] for i in range(72, len(raw), 71)]  # manifest lines wrap at 72 bytes
    with zipfile.ZipFile(jar, "w") as out:
        out.writestr("META-INF/MANIFEST.MF", b"\r\n".join(lines) + b"\r\n\r\n")
        out.writestr("simplelogger.properties", "org.slf4j.simpleLogger.defaultLogLevel=warn\n")


def install_job_server(server: JobServer, home: Path) -> None:
    """The job server's classpath through Maven, every jar checked against its pin, and the
    launcher jar that names them."""
    shutil.rmtree(server.jar(home).parent, ignore_errors=True)  # nothing of an earlier pin is left
    lib = server.jar(home).parent / "lib"
    print(f"fetching Beam's {server.name} job server {BEAM_JAVA_VERSION} through Maven", file=sys.stderr)
    subprocess.run(
        ["mvn", "--batch-mode", "--quiet", "-Dstyle.color=never", "--file", str(server.project / "pom.xml")]
        + [f"-D{key}={value}" for key, value in server.properties]
        + ["dependency:copy-dependencies", f"-DoutputDirectory={lib}", "-DincludeScope=runtime"],
        check=True,
    )
    check_jars(lib, server.pinned())
    _write_launcher(server.jar(home), server.main, [f"lib/{name}" for name in sorted(server.pinned())])


def install_flink(home: Path) -> None:
    """Flink's jars from PyPI's apache-flink-libraries, the download checked against its pin."""
    print(f"fetching Flink {FLINK_VERSION} (apache-flink-libraries from PyPI)", file=sys.stderr)
    download = home / "download"
    download.mkdir(parents=True, exist_ok=True)
    requirement = download / "requirements.txt"
    requirement.write_text(f"apache-flink-libraries=={FLINK_VERSION} --hash=sha256:{FLINK_LIBRARIES_SHA256}\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--require-hashes"]
        + ["--no-binary", ":all:", "-r", str(requirement), "-d", str(download)],
        check=True,
    )
    sdist = download / f"apache-flink-libraries-{FLINK_VERSION}.tar.gz"  # pip checked its hash
    target = flink_dir(home)
    shutil.rmtree(target, ignore_errors=True)
    with tarfile.open(sdist) as archive:
        for member in archive.getmembers():
            parts = Path(member.name).parts  # apache-flink-libraries-X/deps/{lib,bin}/name.jar
            if member.isfile() and len(parts) == 4 and parts[1] == "deps" and parts[2] in ("lib", "bin"):
                (target / parts[2]).mkdir(parents=True, exist_ok=True)
                (target / parts[2] / parts[3]).write_bytes(archive.extractfile(member).read())
    if not (target / "lib" / f"flink-dist-{FLINK_VERSION}.jar").exists():
        raise ClusterError(f"{sdist} holds no deps/lib/flink-dist-{FLINK_VERSION}.jar")
    shutil.rmtree(download)


def install(home: Path) -> None:
    """Both job servers and Flink, every jar checked. Does nothing when already installed."""
    if installed(home):
        return
    for tool in ("java", "mvn"):
        if shutil.which(tool) is None:
            raise ClusterError(f"{tool} not found: Beam's Flink and Spark runners here need Java 17 and Maven")
    for server in JOB_SERVERS:
        install_job_server(server, home)
    install_flink(home)
    _stamp(home).write_text(_pins())


# -- up / down -------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _port_taken(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def flink_config(directory: Path, rest_port: int, rpc_port: int, task_managers: int, slots: int) -> str:
    """Flink's config.yaml (1.19's standard YAML). Memory: a sort inside a batch GroupByKey needs
    each element to fit one sort buffer, a share of the slot's managed memory (with the 435 MiB
    Flink gives a 2 GiB TaskManager by default, the embed stage's groups of several MB did not);
    network buffers for Beam's batch graphs, which deploy every stage at once; direct memory
    for the Beam data channel's gRPC buffers (`task.off-heap`: without it build-shards' first
    stages at 250k chunks failed with "OutOfMemoryError: Direct buffer memory"), and heap for
    its gRPC messages (at 1M chunks a 2.5 GiB TaskManager ran out of heap in a gRPC thread). An
    error no task catches fails the TaskManager instead of leaving its job waiting for ever (that
    heap error stalled the job: no task failed, none went on). Failures: a lost
    TaskManager is noticed within 10 s and the tasks it held restarted on the slots left (2 per
    TaskManager, 1 used at parallelism 2). With every exchange blocking each task is a region of
    its own, and fixed-delay counted each lost task as a failure: a TaskManager holding four used
    up its three attempts and failed the job. exponential-delay counts the failures that come
    before its next restart as one."""
    config = {
        "jobmanager": {
            "rpc": {"address": "localhost", "port": rpc_port},
            "bind-host": "localhost",
            "memory": {"process": {"size": "1024m"}},
        },
        "taskmanager": {
            "host": "localhost",
            "bind-host": "localhost",
            "numberOfTaskSlots": slots,
            "memory": {
                "process": {"size": "4096m"},
                "managed": {"size": "1024m"},
                "task": {"off-heap": {"size": "512m"}},
                "network": {"min": "384m", "max": "384m"},
            },
            "network": {"sort-shuffle": {"min-buffers": 64}},
        },
        "rest": {"address": "localhost", "bind-address": "localhost", "port": rest_port},
        "parallelism": {"default": task_managers},
        "cluster": {"evenly-spread-out-slots": True, "uncaught-exception-handling": "FAIL"},
        "restart-strategy": {
            "type": "exponential-delay",
            "exponential-delay": {"initial-backoff": "1 s", "max-backoff": "10 s", "attempts-before-reset-backoff": 3},
        },
        "heartbeat": {"interval": 2000, "timeout": 10000},
        "io": {"tmp": {"dirs": str(directory / "tmp")}},
        "web": {"tmpdir": str(directory / "tmp")},
    }
    return json.dumps(config, indent=2) + "\n"  # JSON is YAML


LOG4J = """rootLogger.level = INFO
rootLogger.appenderRef.file.ref = File
appender.file.name = File
appender.file.type = File
appender.file.append = true
appender.file.fileName = ${sys:log.file}
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = %d{yyyy-MM-dd HH:mm:ss,SSS} %-5p %-60c %x - %m%n
"""


def _alive(pid_file: Path, directory: Path) -> int | None:
    """The pid in `pid_file` if that process runs and is one of this cluster's (its command line
    names this cluster's conf directory: a pid reused by another process is not ours)."""
    try:
        pid = int(pid_file.read_text())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError):
        return None
    return pid if str(directory / "conf").encode() in cmdline else None


def _memory_parameters(flink: Path, conf: Path, which: str) -> tuple[list[str], list[str]]:
    """Flink's own arithmetic (as its start scripts do): the JVM's heap and direct memory flags,
    and the derived memory sizes the process must be given as dynamic properties."""
    out = subprocess.run(
        ["java", "-cp", f"{flink / 'bin' / '*'}:{flink / 'lib' / '*'}", MEMORY_PARAMETERS]
        + [f"GET_{which}_RESOURCE_PARAMS", "--configDir", str(conf)],
        capture_output=True,
        text=True,
    )
    marker = "BASH_JAVA_UTILS_EXEC_RESULT:"
    results = [line[len(marker) :] for line in out.stdout.splitlines() if line.startswith(marker)]
    if out.returncode != 0 or len(results) < 2:
        raise ClusterError(f"Flink's memory calculation failed ({which}):\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    return shlex.split(results[0]), shlex.split(results[1])


def _start(name: str, main: str, flink: Path, directory: Path, extra: list[str]) -> subprocess.Popen:
    conf = directory / "conf"
    jvm, dynamic = _memory_parameters(flink, conf, "JM" if main == JOB_MANAGER_MAIN else "TM")
    log = directory / "log" / f"{name}.log"
    command = [
        "java",
        *jvm,
        *JAVA_17_FLAGS,
        f"-Dlog.file={log}",
        f"-Dlog4j.configurationFile=file:{conf / 'log4j.properties'}",
        "-cp",
        str(flink / "lib" / "*"),
        main,
        "--configDir",
        str(conf),
        *dynamic,
        *extra,
    ]
    with (directory / "log" / f"{name}.out").open("ab") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    (directory / "pids" / f"{name}.pid").write_text(str(process.pid))
    return process


def rest(rest_port: int, path: str) -> dict:
    with urllib.request.urlopen(f"http://localhost:{rest_port}{path}", timeout=5) as response:
        return json.load(response)


def spark_options(home: Path) -> list[str]:
    """The Beam options for Spark inside Beam's Spark job server (which the runner starts)."""
    jar = SPARK_JOB_SERVER.jar(home)
    return ["--runner=SparkRunner", f"--spark_job_server_jar={jar}", f"--spark_master_url={SPARK_MASTER}"]


def beam_options(home: Path, rest_port: int, parallelism: int) -> list[str]:
    return [
        "--runner=FlinkRunner",
        f"--flink_master=localhost:{rest_port}",
        f"--flink_version={FLINK_MINOR}",
        f"--flink_job_server_jar={FLINK_JOB_SERVER.jar(home)}",
        f"--parallelism={parallelism}",
    ]


def _registered(rest_port: int) -> set[str] | None:
    """The TaskManagers the JobManager lists, or None while its REST API does not answer."""
    try:
        return {tm["id"] for tm in rest(rest_port, "/taskmanagers")["taskmanagers"]}
    except (OSError, urllib.error.URLError, ValueError):
        return None


def up(home: Path, directory: Path, *, rest_port: int, task_managers: int, slots: int, timeout: float) -> list[str]:
    """Start the JobManager and each TaskManager that is not running, wait until the REST API
    lists every TaskManager, and return the Beam options that submit to the cluster."""
    if not installed(home):
        raise ClusterError(f"Flink is not installed in {home}: run `make runners-install`")
    flink = flink_dir(home)
    for sub in ("conf", "log", "pids", "tmp"):
        (directory / sub).mkdir(parents=True, exist_ok=True)
    names = ["jobmanager"] + [f"taskmanager-{i}" for i in range(1, task_managers + 1)]
    running = {name: _alive(directory / "pids" / f"{name}.pid", directory) for name in names}
    started = {}
    deadline = time.monotonic() + timeout
    if running["jobmanager"] is None:
        # TaskManagers of an earlier JobManager would never register with a new one (a new rpc port)
        stop(directory, [name for name in names[1:] if running[name] is not None])
        running = dict.fromkeys(names)
        if _port_taken(rest_port):
            raise ClusterError(f"port {rest_port} is taken: stop what holds it or pass --rest-port")
        config = flink_config(directory, rest_port, _free_port(), task_managers, slots)
        (directory / "conf" / "config.yaml").write_text(config)
        (directory / "conf" / "log4j.properties").write_text(LOG4J)
        started["jobmanager"] = _start("jobmanager", JOB_MANAGER_MAIN, flink, directory, [])
    rest_port = json.loads((directory / "conf" / "config.yaml").read_text())["rest"]["port"]
    restart = [name for name in names[1:] if running[name] is None]
    if "jobmanager" not in started:
        # a TaskManager that died stays listed until its heartbeats time out, and its successor
        # registers under the same id: start it once the old one is gone, or `up` could return early
        while restart and set(restart) & (_registered(rest_port) or set()):
            if time.monotonic() > deadline:
                raise ClusterError(f"{', '.join(restart)} still listed as registered after {timeout:.0f} s")
            time.sleep(0.5)
    for name in restart:
        started[name] = _start(name, TASK_MANAGER_MAIN, flink, directory, ["-D", f"taskmanager.resource-id={name}"])
    while not set(names[1:]) <= (_registered(rest_port) or set()):  # readiness poll: until all registered
        dead = [name for name, process in started.items() if process.poll() is not None]
        if dead or time.monotonic() > deadline:
            for process in started.values():  # nothing half-started is left running
                process.kill()
            why = f"{', '.join(dead)} exited" if dead else f"not all TaskManagers registered in {timeout:.0f} s"
            raise ClusterError(f"the Flink cluster did not start: {why}; logs in {directory / 'log'}")
        time.sleep(0.5)
    return beam_options(home, rest_port, task_managers)


def stop(directory: Path, names: list[str], grace: float = 30) -> list[str]:
    """Stop the named processes of this cluster that run (SIGTERM; SIGKILL after `grace`
    seconds) and forget them; the names of those that ran."""
    stopped = []
    for name in names:
        pid_file = directory / "pids" / f"{name}.pid"
        pid = _alive(pid_file, directory)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):  # it may exit on its own meanwhile
                os.kill(pid, signal.SIGTERM)
                deadline = time.monotonic() + grace
                while _alive(pid_file, directory) is not None and time.monotonic() < deadline:
                    time.sleep(0.2)  # waiting for the JVM's shutdown hooks
                if _alive(pid_file, directory) is not None:
                    os.kill(pid, signal.SIGKILL)
            stopped.append(name)
        pid_file.unlink(missing_ok=True)
    return stopped


def down(directory: Path) -> list[str]:
    """Stop every process of this cluster that runs; the names of those stopped."""
    return stop(directory, sorted(p.stem for p in (directory / "pids").glob("*.pid")))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["install", "up", "down", "spark-options"])
    parser.add_argument("--home", type=Path, default=DEFAULT_HOME, help="where the jars are installed")
    parser.add_argument("--dir", type=Path, help="the cluster's conf, logs and pids (default: HOME/cluster)")
    parser.add_argument("--rest-port", type=int, default=8081)
    parser.add_argument("--task-managers", type=int, default=TASK_MANAGERS)
    parser.add_argument("--slots", type=int, default=SLOTS, help="per TaskManager")
    parser.add_argument("--timeout", type=float, default=120, help="seconds `up` waits for the TaskManagers")
    args = parser.parse_args(argv)
    home = args.home.resolve()
    directory = (args.dir or home / "cluster").resolve()
    try:
        if args.command == "install":
            install(home)
            print(f"installed in {home}: Flink {FLINK_VERSION}, Beam's Flink and Spark job servers {BEAM_JAVA_VERSION}")
        elif args.command == "spark-options":
            if not installed(home):
                raise ClusterError(f"the runners are not installed in {home}: run `make runners-install`")
            print(" ".join(spark_options(home)))
        elif args.command == "up":
            options = up(
                home,
                directory,
                rest_port=args.rest_port,
                task_managers=args.task_managers,
                slots=args.slots,
                timeout=args.timeout,
            )
            print(f"Flink {FLINK_VERSION}, 1 JobManager, {args.task_managers} TaskManagers, logs: {directory / 'log'}")
            print(" ".join(options))
        else:
            stopped = down(directory)
            print(f"stopped: {', '.join(stopped) or 'nothing was running'}")
    except (ClusterError, subprocess.CalledProcessError) as err:
        sys.exit(f"error: {err}")


if __name__ == "__main__":
    main()
