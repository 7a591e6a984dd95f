"""Where a launched engine server runs: its own process group (``stop()`` reaches its workers) inside our session, so
the CPU scheduler's per-session groups (``sched_autogroup_enabled``) do not set the engine against loopwise's event
loop as a peer group of its own."""

from __future__ import annotations

import os
import sys

from runtime.engines.launcher import ServerLauncher

SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


class Tiny(ServerLauncher):
    name = "tiny"

    def command(self, host: str, port: int) -> list[str]:
        return [sys.executable, "-c", SERVER, str(port)]


def test_a_launched_server_has_its_own_process_group_in_our_session():
    launcher = Tiny(url=None, launch_timeout_s=60)
    launcher.start()
    try:
        assert launcher.proc is not None
        pid = launcher.proc.pid
        assert os.getpgid(pid) == pid != os.getpgid(0)  # its own group: stop() signals the server and its workers
        assert os.getsid(pid) == os.getsid(0)  # but our session
    finally:
        launcher.stop()
    assert launcher.proc.poll() is not None
