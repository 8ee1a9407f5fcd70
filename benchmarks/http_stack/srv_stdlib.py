"""(a) http.server.ThreadingHTTPServer, HTTP/1.1, TCP_NODELAY -- as in launcher/service/rendezvous_server.py."""
import common
common.setup()
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    disable_nagle_algorithm = True
    protocol_version = "HTTP/1.1"

    def do_POST(self):
        h = self.headers
        body = self.rfile.read(int(h.get("Content-Length", "0")))
        status, reply, sig = common.work(self.path, h.get("X-LE-Nonce"), h.get("X-LE-Timestamp"),
                                         h.get("X-LE-Signature"), body)
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.send_header("X-LE-Signature", sig)
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *a):
        pass


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = common.BACKLOG

    def handle_error(self, request, client_address):
        pass


srv = Server(("127.0.0.1", common.port_arg()), Handler)
common.ready(srv.server_address[1])
srv.serve_forever()
