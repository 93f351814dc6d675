"""The fleet's download server in the field's fleet box, run there by the package's Python as a
transient unit: static files over HTTPS (TLS 1.3 only, the broker's certificate: its name is
the fleet box's), each answer written to a log, one JSON line ({"path", "status", "bytes"}).

    cdn.py ADDRESS PORT CERT KEY ROOT LOG
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import ssl
import sys
from typing import Any


class Files(http.server.SimpleHTTPRequestHandler):
    log_path = ""

    def log_request(self, code: Any = "-", size: Any = "-") -> None:
        """At the answer's start: its status, and for a whole file its length."""
        path = self.translate_path(self.path)
        length = os.path.getsize(path) if int(code) == 200 and os.path.isfile(path) else 0
        with open(self.log_path, "a", encoding="utf-8") as log:
            log.write(json.dumps({"path": self.path, "status": int(code), "bytes": length}) + "\n")


def main() -> None:
    address, port, cert, key, root, log = sys.argv[1:7]
    Files.log_path = log
    server = http.server.ThreadingHTTPServer(
        (address, int(port)), functools.partial(Files, directory=root)
    )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
