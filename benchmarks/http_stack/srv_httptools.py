"""(c) asyncio.Protocol + httptools.HttpRequestParser."""
import asyncio, socket
import common
common.setup()
common.use_uvloop()
import httptools

STATUS = {200: b"200 OK", 400: b"400 Bad Request", 401: b"401 Unauthorized"}
WANTED = {b"x-le-nonce", b"x-le-timestamp", b"x-le-signature"}


class HttpProto(asyncio.Protocol):
    __slots__ = ("transport", "parser", "url", "headers", "body")

    def connection_made(self, transport):
        self.transport = transport
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.parser = httptools.HttpRequestParser(self)

    def data_received(self, data):
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            self.transport.close()

    def on_message_begin(self):
        self.headers = {}
        self.body = []

    def on_url(self, url):
        self.url = url

    def on_header(self, name, value):
        name = name.lower()
        if name in WANTED:
            self.headers[name] = value.decode("latin-1")

    def on_body(self, body):
        self.body.append(body)

    def on_message_complete(self):
        h = self.headers
        status, reply, sig = common.work(self.url.decode("latin-1"), h.get(b"x-le-nonce"),
                                         h.get(b"x-le-timestamp"), h.get(b"x-le-signature"),
                                         b"".join(self.body))
        keep = self.parser.should_keep_alive()
        self.transport.write(b"HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                             b"X-LE-Signature: %s\r\n%s\r\n%s" % (
                                 STATUS[status], len(reply), sig.encode(),
                                 b"" if keep else b"Connection: close\r\n", reply))
        if not keep:
            self.transport.close()


async def main():
    port = common.port_arg()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(HttpProto, "127.0.0.1", port, backlog=common.BACKLOG)
    common.ready(port)
    async with server:
        await server.serve_forever()

asyncio.run(main())
