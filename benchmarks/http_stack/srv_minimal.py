"""(d) asyncio.Protocol + a minimal hand-written HTTP/1.1 request parser (Content-Length only)."""
import asyncio, socket
import common
common.setup()
common.use_uvloop()

STATUS = {200: b"200 OK", 400: b"400 Bad Request", 401: b"401 Unauthorized"}
MAX_HEAD, MAX_BODY = 16384, 1 << 20
BAD = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


class HttpProto(asyncio.Protocol):
    def connection_made(self, transport):
        self.transport = transport
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def data_received(self, data):
        buf = self.buf + data if self.buf else data
        while buf:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > MAX_HEAD:
                    return self._bad()
                break
            lines = buf[:end].decode("latin-1").split("\r\n")
            parts = lines[0].split(" ")
            if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
                return self._bad()
            h = {}
            for line in lines[1:]:
                name, sep, value = line.partition(":")
                if not sep:
                    return self._bad()
                h[name.strip().lower()] = value.strip()
            if "transfer-encoding" in h:
                return self._bad()  # no chunked bodies here
            try:
                length = int(h.get("content-length", "0"))
            except ValueError:
                return self._bad()
            if not 0 <= length <= MAX_BODY:
                return self._bad()
            start = end + 4
            if len(buf) < start + length:
                break  # wait for the rest of the body
            body = buf[start:start + length]
            buf = buf[start + length:]
            conn = h.get("connection", "").lower()
            keep = conn != "close" if parts[2] == "HTTP/1.1" else conn == "keep-alive"
            status, reply, sig = common.work(parts[1], h.get("x-le-nonce"), h.get("x-le-timestamp"),
                                             h.get("x-le-signature"), body)
            self.transport.write(b"HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                                 b"X-LE-Signature: %s\r\n%s\r\n%s" % (
                                     STATUS[status], len(reply), sig.encode(),
                                     b"" if keep else b"Connection: close\r\n", reply))
            if not keep:
                self.transport.close()
                return
        self.buf = buf

    def _bad(self):
        self.transport.write(BAD)
        self.transport.close()
        self.buf = b""


async def main():
    port = common.port_arg()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(HttpProto, "127.0.0.1", port, backlog=common.BACKLOG)
    common.ready(port)
    async with server:
        await server.serve_forever()

asyncio.run(main())
