"""(b1) aiohttp.web Application with one route, access log off."""
import common
common.setup()
common.use_uvloop()
from aiohttp import web


async def heartbeat(request):
    body = await request.read()
    h = request.headers
    status, reply, sig = common.work(request.path, h.get("X-LE-Nonce"), h.get("X-LE-Timestamp"),
                                     h.get("X-LE-Signature"), body)
    return web.Response(status=status, body=reply, content_type="application/json",
                        headers={"X-LE-Signature": sig})


app = web.Application()
app.router.add_post(common.PATH, heartbeat)
port = common.port_arg()
web.run_app(app, host="127.0.0.1", port=port, access_log=None, backlog=common.BACKLOG,
            print=lambda *a: common.ready(port), handle_signals=True)
