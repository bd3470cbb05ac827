"""The processes of a deployment: trtserver replicas, redis-server, nginx in front; each on a free
loopback port with its files in a given directory."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from trtserver_redis_quota.testing import RedisServer

from tests.http.conftest import TEST_DEVICE, free_port

# one core each at most: two replicas share this machine's cores with everything else
REPLICA_FLAGS = ("--threads", "1", "--no-pin-threads", "--max-batch-size", "4", "--max-model-len", "512")
QUOTAS = """
[server.quotas.rpm10]
requests_per_minute = 10

[server.quotas.tokens]
tokens_per_minute = 1000

[server.quotas.gone]
tokens_per_minute = 1000
"""


# nginx as docs/deploy.md recommends it for trtserver, on given ports and paths
NGINX_CONF = """
{user}
worker_processes 1;
daemon off;
pid {dir}/nginx.pid;
error_log {dir}/error.log info;
events {{ worker_connections 256; }}
http {{
    access_log {dir}/access.log;
    client_body_temp_path {dir}/client_body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;

    upstream trtserver {{
{servers}
        keepalive 16;
    }}
    server {{
        listen 127.0.0.1:{port};
        client_max_body_size 16m;
        location / {{
            proxy_pass http://trtserver;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Host $host;
            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
            proxy_buffering {buffering};
            proxy_cache off;
            proxy_read_timeout 1h;
            proxy_send_timeout 1h;
            proxy_next_upstream error timeout http_503 non_idempotent;
            proxy_next_upstream_tries 2;
        }}
    }}
}}
"""


class Nginx:
    """``nginx`` in the foreground, configured in ``directory`` (Debian's package)."""

    def __init__(self, directory: Path, upstreams: list[str], *, buffering: bool = False) -> None:
        binary = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
        if binary is None:
            raise RuntimeError("nginx is not installed (Debian package nginx; `make install` adds it)")
        self.directory, self.port = directory, free_port()
        directory.mkdir(parents=True, exist_ok=True)
        # as root, workers would run as nobody, who cannot write to a private temporary directory
        user = f"user {pwd.getpwuid(0).pw_name};" if os.geteuid() == 0 else ""
        servers = "\n".join(f"        server {address} max_fails=1 fail_timeout=10s;" for address in upstreams)
        self.conf = directory / "nginx.conf"
        self.conf.write_text(NGINX_CONF.format(user=user, dir=directory, servers=servers, port=self.port,
                                               buffering="on" if buffering else "off"))
        self.process = subprocess.Popen([binary, "-p", str(directory), "-e", str(directory / "error.log"),
                                         "-c", str(self.conf)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        self.base = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 10
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"nginx exited with {self.process.returncode}: {self.log()[-2000:]}")
            try:
                httpx.get(f"{self.base}/nginx-is-up", timeout=1)
                return
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError("nginx did not start listening") from None
                time.sleep(0.05)

    def log(self) -> str:
        path = self.directory / "error.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()  # SIGTERM: nginx's fast shutdown
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


class Replica:
    """One ``trtserver serve`` subprocess on the default model, with a config file."""

    def __init__(self, engine_dir: Path, config: Path, log: Path, flags: tuple[str, ...] = REPLICA_FLAGS) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.address = f"127.0.0.1:{self.port}"
        self.log_path = log
        self._log = open(log, "wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "trtserver.cli", "serve", str(engine_dir), "--port", str(self.port),
             "--config", str(config), "--engine", os.environ.get("TRTSERVER_TEST_ENGINE", "torch"),
             "--device", TEST_DEVICE, *flags], stdout=self._log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)
        self._log.close()


@dataclass
class Deployment:
    redis: RedisServer
    key_prefix: str
    open_replica: Replica  # on_unavailable = "fail_open"
    closed_replica: Replica  # on_unavailable = "fail_closed"
    nginx: Nginx

    @property
    def replicas(self) -> tuple[Replica, Replica]:
        return self.open_replica, self.closed_replica


def replica_config(path: Path, redis_url: str, key_prefix: str, on_unavailable: str) -> Path:
    path.write_text(f"""[server]
{QUOTAS}
[plugins]
load = ["trtserver_redis_quota"]

[plugins.redis_quota]
url = "{redis_url}"
key_prefix = "{key_prefix}"
on_unavailable = "{on_unavailable}"
timeout_s = 5  # a loaded machine must not look like an outage; a stopped Redis refuses at once
""")
    return path
