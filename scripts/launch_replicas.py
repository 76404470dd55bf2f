"""Start N ``jaxpaged serve`` replicas on consecutive ports, each on its own device(s).

    python scripts/launch_replicas.py --num-replicas 4 --base-port 8001 \\
        --write-nginx-config /tmp/jaxpaged-nginx.conf -- --model /models/llama --metrics-prefix vllm

Everything after ``--`` is passed to every ``jaxpaged serve`` (``--tensor-parallel-size`` / ``-tp``
is read from it). On GPU, replica i sees the devices ``gpu_ids[i*tp : (i+1)*tp]`` through
``CUDA_VISIBLE_DEVICES`` (default ids 0..N*tp-1); on CPU the replicas are plain processes. The
launcher waits until every replica answers ``GET /health`` with 200, prints their URLs, forwards
SIGINT / SIGTERM to them, and stops them all when it exits or one of them dies (unless
``--keep-going``). ``--print-nginx-upstream`` prints the ``upstream`` block for
``deploy/nginx.conf`` and exits; ``--write-nginx-config PATH`` writes that file with these replicas
(and ``--nginx-run-dir`` for pid / log / temp paths a non-root Nginx can write).

``ReplicaSet`` is the same machinery as a library (tests/deploy/test_nginx.py drives it).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

NGINX_TEMPLATE = pathlib.Path(__file__).resolve().parent.parent / "deploy" / "nginx.conf"
UPSTREAM_NAME = "jaxpaged_replicas"
# The passive health-check parameters of every upstream server line (deploy/nginx.conf).
UPSTREAM_SERVER_PARAMS = "max_fails=1 fail_timeout=5s"


@dataclasses.dataclass(frozen=True)
class ReplicaSpec:
    """One replica: its index, address, and the GPU ids it sees (empty: CPU or all devices)."""

    index: int
    host: str
    port: int
    gpu_ids: tuple[int, ...] = ()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def plan_replicas(
    num_replicas: int,
    *,
    base_port: int = 8001,
    host: str = "127.0.0.1",
    device: str = "cpu",
    tensor_parallel_size: int = 1,
    gpu_ids: list[int] | None = None,
    ports: list[int] | None = None,
) -> list[ReplicaSpec]:
    """Ports and device groups of ``num_replicas`` replicas.

    Args:
        device: ``"gpu"`` gives replica i the ids ``gpu_ids[i*tp : (i+1)*tp]``; ``"cpu"`` none.
        gpu_ids: the GPUs to use; None: ``0 .. num_replicas*tp - 1``.
        ports: explicit ports (one per replica); None: ``base_port + i``.

    Raises:
        ValueError: a bad count, port, device or tensor-parallel size, or too few GPU ids.
    """
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be at least 1, got {num_replicas}")
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {tensor_parallel_size}")
    if device not in ("cpu", "gpu"):
        raise ValueError(f"device must be 'cpu' or 'gpu', got {device!r}")
    if ports is None:
        if not 1 <= base_port <= 65535 - num_replicas + 1:
            raise ValueError(
                f"base_port must leave {num_replicas} ports below 65536, got {base_port}"
            )
        ports = [base_port + i for i in range(num_replicas)]
    if len(ports) != num_replicas:
        raise ValueError(f"ports must list {num_replicas} ports, got {len(ports)}")
    groups: list[tuple[int, ...]] = [()] * num_replicas
    if device == "gpu":
        needed = num_replicas * tensor_parallel_size
        ids = list(range(needed)) if gpu_ids is None else list(gpu_ids)
        if len(ids) < needed:
            raise ValueError(
                f"{num_replicas} replicas x tensor_parallel_size {tensor_parallel_size} need "
                f"{needed} GPUs, got gpu_ids {ids}"
            )
        tp = tensor_parallel_size
        groups = [tuple(ids[i * tp : (i + 1) * tp]) for i in range(num_replicas)]
    return [ReplicaSpec(i, host, ports[i], groups[i]) for i in range(num_replicas)]


def nginx_upstream(replicas: list[ReplicaSpec]) -> str:
    """The ``upstream`` block of deploy/nginx.conf, rendered for these replicas."""
    text = render_nginx_config(replicas)
    block = re.search(rf"^ *upstream {UPSTREAM_NAME} {{.*?^ *}}", text, flags=re.M | re.S)
    if block is None:
        raise ValueError(f"deploy/nginx.conf has no `upstream {UPSTREAM_NAME}` block")
    return block.group(0)


def render_nginx_config(
    replicas: list[ReplicaSpec],
    *,
    listen: str = "8000",
    run_dir: str | os.PathLike | None = None,
    worker_processes: str = "auto",
    template: str | None = None,
) -> str:
    """deploy/nginx.conf with its upstream ``server`` lines replaced by ``replicas``.

    Args:
        listen: the ``listen`` value (``"8000"``, ``"127.0.0.1:9000"``).
        run_dir: when given, pid, error/access logs and temp files go under it (an unprivileged
            Nginx can run the result); None keeps the template's system paths.
        template: the config text; None reads deploy/nginx.conf.

    Raises:
        ValueError: no replicas, or a template without the upstream servers or ``listen``.
    """
    if not replicas:
        raise ValueError("render_nginx_config needs at least one replica, got none")
    text = NGINX_TEMPLATE.read_text() if template is None else template
    server_line = re.compile(r"^( *)server [\w.\-\[\]:]+:\d+ [^;\n]*;\n", re.MULTILINE)
    found = list(server_line.finditer(text))
    if not found:
        raise ValueError("the nginx template has no upstream `server host:port ...;` line")
    indent = found[0].group(1)
    servers = "".join(
        f"{indent}server {r.host}:{r.port} {UPSTREAM_SERVER_PARAMS};\n" for r in replicas
    )
    text = text[: found[0].start()] + servers + text[found[-1].end() :]
    text, count = re.subn(r"^( *)listen [^;\n]+;", rf"\g<1>listen {listen};", text, flags=re.M)
    if count != 1:
        raise ValueError(f"the nginx template must have one `listen` line, found {count}")
    text = re.sub(
        r"^worker_processes [^;\n]+;", f"worker_processes {worker_processes};", text, flags=re.M
    )
    if run_dir is not None:
        run = pathlib.Path(run_dir).resolve()
        for directive, path in (
            ("pid", run / "nginx.pid"),
            ("error_log", run / "error.log"),
            ("access_log", run / "access.log"),
            ("client_body_temp_path", run / "client_body"),
            ("proxy_temp_path", run / "proxy"),
        ):
            text = re.sub(
                rf"^( *){directive} [^\s;]+", rf"\g<1>{directive} {path}", text, flags=re.M
            )
    return text


def serve_command(spec: ReplicaSpec, serve_args: list[str]) -> list[str]:
    """The ``jaxpaged serve`` command line of one replica."""
    return [
        sys.executable,
        "-m",
        "jaxpaged.entrypoints.cli",
        "serve",
        *serve_args,
        "--host",
        spec.host,
        "--port",
        str(spec.port),
    ]


def replica_env(spec: ReplicaSpec, base: dict[str, str] | None = None) -> dict[str, str]:
    """The replica's environment: ``base`` (default ``os.environ``), with
    ``CUDA_VISIBLE_DEVICES`` set to its GPU group when it has one."""
    env = dict(os.environ if base is None else base)
    if spec.gpu_ids:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in spec.gpu_ids)
    return env


def is_healthy(url: str, timeout: float = 2.0) -> bool:
    """Whether ``GET url/health`` answers 200."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


class ReplicaSet:
    """The replica processes of ``specs``, each running ``serve_command`` in its own process
    group (a signal to the group reaches everything the replica started).

    Args:
        serve_args: ``jaxpaged serve`` flags shared by every replica.
        env: base environment (default ``os.environ``).
        log_dir: each replica's stdout and stderr go to ``replica-<i>.log`` there; None:
            inherited.
    """

    def __init__(
        self,
        specs: list[ReplicaSpec],
        serve_args: list[str],
        *,
        env: dict[str, str] | None = None,
        log_dir: str | os.PathLike | None = None,
    ):
        self.specs = specs
        self.serve_args = list(serve_args)
        self.env = env
        self.log_dir = None if log_dir is None else pathlib.Path(log_dir)
        self.processes: list[subprocess.Popen | None] = [None] * len(specs)

    def start(self, index: int) -> None:
        """Start replica ``index`` (again, if it has died).

        Raises:
            RuntimeError: it is still running.
        """
        process = self.processes[index]
        if process is not None and process.poll() is None:
            raise RuntimeError(f"replica {index} is still running (pid {process.pid})")
        spec = self.specs[index]
        output = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            output = open(self.log_dir / f"replica-{index}.log", "ab")  # noqa: SIM115
        self.processes[index] = subprocess.Popen(
            serve_command(spec, self.serve_args),
            env=replica_env(spec, self.env),
            stdout=output,
            stderr=subprocess.STDOUT if output is not None else None,
            start_new_session=True,
        )
        if output is not None:
            output.close()  # the child holds its own descriptor

    def start_all(self) -> None:
        for index in range(len(self.specs)):
            self.start(index)

    def wait_healthy(self, indices=None, *, timeout: float = 300.0, poll: float = 0.25) -> None:
        """Until every replica in ``indices`` (default all) answers ``/health`` with 200.

        Raises:
            RuntimeError: a replica exited first (its exit code and log path are named).
            TimeoutError: ``timeout`` seconds passed.
        """
        pending = set(range(len(self.specs)) if indices is None else indices)
        deadline = time.monotonic() + timeout
        while pending:
            for index in sorted(pending):
                process = self.processes[index]
                if process is None or process.poll() is not None:
                    code = None if process is None else process.returncode
                    log = (
                        "" if self.log_dir is None else f"; see {self.log_dir}/replica-{index}.log"
                    )
                    raise RuntimeError(
                        f"replica {index} exited with code {code} before /health{log}"
                    )
                if is_healthy(self.specs[index].url):
                    pending.discard(index)
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"replicas {sorted(pending)} not healthy after {timeout} s")
            if pending:
                time.sleep(poll)

    def signal(self, index: int, signum: int) -> None:
        """Send ``signum`` to replica ``index``'s process group, if it runs."""
        process = self.processes[index]
        if process is not None and process.poll() is None:
            try:
                os.killpg(process.pid, signum)
            except ProcessLookupError:
                pass

    def kill(self, index: int) -> None:
        """SIGKILL replica ``index`` (a crash, as far as clients and Nginx can tell) and reap it."""
        self.signal(index, signal.SIGKILL)
        process = self.processes[index]
        if process is not None:
            process.wait()

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM every replica, then SIGKILL those still running after ``grace`` seconds."""
        for index in range(len(self.specs)):
            self.signal(index, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for index, process in enumerate(self.processes):
            if process is None:
                continue
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill(index)

    def first_exited(self) -> int | None:
        """The index of a replica that has exited, or None."""
        for index, process in enumerate(self.processes):
            if process is not None and process.poll() is not None:
                return index
        return None


def _tensor_parallel_size(serve_args: list[str]) -> int:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    known, _ = parser.parse_known_args(serve_args)
    return known.tensor_parallel_size


def _parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    serve_args: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, serve_args = argv[:split], argv[split + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-replicas", "-n", type=int, required=True, help="replicas N >= 1")
    parser.add_argument(
        "--base-port", type=int, default=8001, help="replica i listens on base-port + i (8001)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="replicas' listen address")
    parser.add_argument(
        "--device",
        choices=["auto", "gpu", "cpu"],
        default="auto",
        help="gpu: pin replicas to GPU groups with CUDA_VISIBLE_DEVICES; cpu: plain processes; "
        "auto: gpu when nvidia-smi is on PATH (default)",
    )
    parser.add_argument(
        "--gpu-ids",
        default=None,
        help="comma-separated GPU ids to split into groups of tp (default 0..N*tp-1)",
    )
    parser.add_argument("--log-dir", default=None, help="write replica-<i>.log files here")
    parser.add_argument(
        "--health-timeout", type=float, default=600.0, help="seconds to wait for /health (600)"
    )
    parser.add_argument(
        "--keep-going",
        action="store_true",
        help="keep the others running when a replica dies (default: stop all)",
    )
    parser.add_argument(
        "--print-nginx-upstream",
        action="store_true",
        help="print the nginx upstream block for these replicas and exit",
    )
    parser.add_argument(
        "--write-nginx-config", default=None, help="write deploy/nginx.conf for them to this path"
    )
    parser.add_argument("--nginx-listen", default="8000", help="nginx `listen` value (8000)")
    parser.add_argument(
        "--nginx-run-dir", default=None, help="pid, log and temp paths of that config go here"
    )
    return parser.parse_args(argv), serve_args


def main(argv: list[str] | None = None) -> int:
    args, serve_args = _parse_args(argv)
    device = args.device
    if device == "auto":
        device = "gpu" if shutil.which("nvidia-smi") else "cpu"
    gpu_ids = None if args.gpu_ids is None else [int(i) for i in args.gpu_ids.split(",")]
    try:
        specs = plan_replicas(
            args.num_replicas,
            base_port=args.base_port,
            host=args.host,
            device=device,
            tensor_parallel_size=_tensor_parallel_size(serve_args),
            gpu_ids=gpu_ids,
        )
    except ValueError as error:
        print(f"launch_replicas: error: {error}", file=sys.stderr)
        return 2
    if args.print_nginx_upstream:
        print(nginx_upstream(specs))
        return 0
    if args.write_nginx_config:
        config = render_nginx_config(specs, listen=args.nginx_listen, run_dir=args.nginx_run_dir)
        pathlib.Path(args.write_nginx_config).write_text(config)
        print(f"wrote {args.write_nginx_config}", flush=True)

    replicas = ReplicaSet(specs, serve_args, log_dir=args.log_dir)

    def forward(signum, _frame):
        raise _Stop(signum)

    # SIGINT / SIGTERM end the wait below; `finally` passes SIGTERM on to every replica.
    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    try:
        replicas.start_all()
        replicas.wait_healthy(timeout=args.health_timeout)
        for spec in specs:
            devices = ",".join(map(str, spec.gpu_ids)) or "cpu"
            print(f"replica {spec.index} ready at {spec.url} (devices: {devices})", flush=True)
        while True:
            dead = replicas.first_exited()
            if dead is not None and not args.keep_going:
                print(f"replica {dead} exited; stopping all", file=sys.stderr, flush=True)
                return 1
            time.sleep(0.5)
    except _Stop:
        return 0
    except (RuntimeError, TimeoutError) as error:
        print(f"launch_replicas: error: {error}", file=sys.stderr)
        return 1
    finally:
        replicas.stop()


class _Stop(Exception):
    """SIGINT or SIGTERM reached the launcher."""


if __name__ == "__main__":
    sys.exit(main())
