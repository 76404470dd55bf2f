"""scripts/launch_replicas.py: device groups, the rendered Nginx config, and the launcher's
process handling (against stand-in replicas: a few lines of http.server answering /health)."""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from scripts.launch_replicas import (
    NGINX_TEMPLATE,
    nginx_upstream,
    plan_replicas,
    render_nginx_config,
    replica_env,
    serve_command,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_gpu_replicas_get_consecutive_groups_of_tensor_parallel_size():
    specs = plan_replicas(3, device="gpu", tensor_parallel_size=2, base_port=9000)
    assert [s.gpu_ids for s in specs] == [(0, 1), (2, 3), (4, 5)]
    assert [s.port for s in specs] == [9000, 9001, 9002]
    assert replica_env(specs[1], base={"PATH": "/bin"}) == {
        "PATH": "/bin",
        "CUDA_VISIBLE_DEVICES": "2,3",
    }
    chosen = plan_replicas(2, device="gpu", gpu_ids=[6, 7])
    assert [s.gpu_ids for s in chosen] == [(6,), (7,)]
    cpu = plan_replicas(2, device="cpu")
    assert [s.gpu_ids for s in cpu] == [(), ()]
    assert "CUDA_VISIBLE_DEVICES" not in replica_env(cpu[0], base={})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(num_replicas=0), "num_replicas must be at least 1, got 0"),
        (dict(num_replicas=2, tensor_parallel_size=0), "tensor_parallel_size must be at least 1"),
        (dict(num_replicas=2, device="tpu"), "device must be 'cpu' or 'gpu', got 'tpu'"),
        (dict(num_replicas=2, base_port=65535), "base_port must leave 2 ports below 65536"),
        (
            dict(num_replicas=3, device="gpu", tensor_parallel_size=2, gpu_ids=[0, 1, 2, 3]),
            r"need 6 GPUs, got gpu_ids \[0, 1, 2, 3\]",
        ),
    ],
)
def test_bad_plans_are_refused_with_the_field_and_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan_replicas(**kwargs)


def test_serve_command_passes_the_flags_and_its_own_address():
    spec = plan_replicas(1, base_port=8123)[0]
    command = serve_command(spec, ["--max-model-len", "64"])
    assert command[1:4] == ["-m", "jaxpaged.entrypoints.cli", "serve"]
    assert command[4:] == ["--max-model-len", "64", "--host", "127.0.0.1", "--port", "8123"]


def test_deploy_nginx_conf_is_what_the_launcher_renders_for_three_replicas():
    assert render_nginx_config(plan_replicas(3)) == NGINX_TEMPLATE.read_text()
    upstream = nginx_upstream(plan_replicas(2, base_port=7000))
    assert "least_conn;" in upstream and "server 127.0.0.1:7001 max_fails=1" in upstream


def test_rendered_config_with_a_run_dir_passes_nginx_t(tmp_path):
    config = render_nginx_config(
        plan_replicas(2, base_port=9301), listen="127.0.0.1:9300", run_dir=tmp_path
    )
    for line in ("pid", "error_log", "access_log", "proxy_temp_path"):
        assert f"{line} {tmp_path}" in config
    for needed in ("proxy_buffering off;", "proxy_read_timeout 3600s;", "keepalive 64;"):
        assert needed in config
    nginx = shutil.which("nginx") or (
        "/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None
    )
    if nginx is None:
        pytest.skip("the nginx binary is absent (Debian: apt-get install nginx-light)")
    (tmp_path / "nginx.conf").write_text(config)
    check = subprocess.run(
        [nginx, "-t", "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf"), "-e", "stderr"],
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stderr


# A stand-in replica: answers /health, notes SIGTERM in <marker dir>/<port>.term, then exits.
FAKE_REPLICA = textwrap.dedent(
    """
    import http.server, pathlib, signal, sys
    port = int(sys.argv[sys.argv.index("--port") + 1])
    marker = pathlib.Path(sys.argv[sys.argv.index("--marker-dir") + 1]) / f"{port}.term"
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *args):
            pass
    server = http.server.HTTPServer(("127.0.0.1", port), Health)
    def term(*_):
        marker.write_text("SIGTERM")
        sys.exit(0)
    signal.signal(signal.SIGTERM, term)
    server.serve_forever()
    """
)

DRIVER = textwrap.dedent(
    """
    import sys
    import scripts.launch_replicas as launch
    launch.serve_command = lambda spec, args: [
        sys.executable, sys.argv[1], *args, "--port", str(spec.port)]
    sys.exit(launch.main(sys.argv[2:]))
    """
)


def test_launcher_waits_for_health_and_forwards_sigterm_to_every_replica(tmp_path):
    (tmp_path / "fake.py").write_text(FAKE_REPLICA)
    port = 20000 + os.getpid() % 20000
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-c",
            DRIVER,
            str(tmp_path / "fake.py"),
            "-n",
            "2",
            "--device",
            "cpu",
            "--base-port",
            str(port),
            "--",
            "--marker-dir",
            str(tmp_path),
        ],  # fmt: skip
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        ready = [launcher.stdout.readline() for _ in range(2)]
        assert ready == [
            f"replica 0 ready at http://127.0.0.1:{port} (devices: cpu)\n",
            f"replica 1 ready at http://127.0.0.1:{port + 1} (devices: cpu)\n",
        ]
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(20) == 0
    finally:
        launcher.kill()
    deadline = time.monotonic() + 10
    markers = [tmp_path / f"{port + i}.term" for i in range(2)]
    while not all(m.exists() for m in markers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(m.read_text() == "SIGTERM" for m in markers)
