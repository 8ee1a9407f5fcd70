"""(b2) aiohttp.web.Server low-level handler (no router/app), access log off."""
import asyncio
import common
common.setup()
common.use_uvloop()
from aiohttp import web


async def handler(request):
    body = await request.read()
    h = request.headers
    status, reply, sig = common.work(request.path, h.get("X-LE-Nonce"), h.get("X-LE-Timestamp"),
                                     h.get("X-LE-Signature"), body)
    return web.Response(status=status, body=reply, content_type="application/json",
                        headers={"X-LE-Signature": sig})


async def main():
    port = common.port_arg()
    server = web.Server(handler, access_log=None)
    runner = web.ServerRunner(server)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port, backlog=common.BACKLOG)
    await site.start()
    common.ready(port)
    await asyncio.Event().wait()

asyncio.run(main())
