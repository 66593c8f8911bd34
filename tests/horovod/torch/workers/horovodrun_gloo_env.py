"""Start N local ranks the way ``horovodrun --gloo -np N`` does on one host.

Each rank gets horovodrun's variables (HOROVOD_RANK/SIZE/LOCAL_*/CROSS_*, HOROVOD_CONTROLLER
=gloo, HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT) and an HTTP key-value server stands in for
horovodrun's rendezvous server (same PUT/GET /scope/key protocol). Used where the real
horovodrun is not installed. Usage: horovodrun_gloo_env.py N script [args...]
"""

import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

STORE: dict[str, bytes] = {}


class KeyValue(BaseHTTPRequestHandler):
    def do_PUT(self):  # noqa: N802 (http.server's naming)
        STORE[self.path] = self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self):  # noqa: N802
        value = STORE.get(self.path)
        self.send_response(200 if value is not None else 404)
        self.send_header("Content-Length", str(len(value or b"")))
        self.end_headers()
        self.wfile.write(value or b"")

    def log_message(self, *args):
        pass


def main() -> int:
    n, command = int(sys.argv[1]), sys.argv[2:]
    server = ThreadingHTTPServer(("127.0.0.1", 0), KeyValue)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    procs = []
    for rank in range(n):
        env = dict(base, HOROVOD_RANK=str(rank), HOROVOD_SIZE=str(n), HOROVOD_LOCAL_RANK=str(rank),
                   HOROVOD_LOCAL_SIZE=str(n), HOROVOD_CROSS_RANK="0", HOROVOD_CROSS_SIZE="1",
                   HOROVOD_HOSTNAME="localhost", HOROVOD_CONTROLLER="gloo", HOROVOD_CPU_OPERATIONS="gloo",
                   HOROVOD_GLOO_RENDEZVOUS_ADDR="127.0.0.1", HOROVOD_GLOO_RENDEZVOUS_PORT=str(server.server_port),
                   HOROVOD_GLOO_IFACE="lo")
        procs.append(subprocess.Popen([sys.executable, *command], env=env))
    codes = [p.wait() for p in procs]
    server.shutdown()
    return max(codes)


if __name__ == "__main__":
    sys.exit(main())
