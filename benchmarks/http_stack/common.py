"""Shared by every server: setup (affinity, fd limit, backlog) and the per-request token work."""
import hashlib, hmac, json, os, resource, sys

KEY = b"k" * 32
BACKLOG = 4096
PATH = "/heartbeat"


def setup():
    os.sched_setaffinity(0, {0})  # before any thread exists: every later thread inherits it
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def use_uvloop():
    if "--uvloop" in sys.argv:
        import uvloop
        uvloop.install()


def port_arg():
    return int(sys.argv[1])


def work(path, nonce, timestamp, signature, body):
    """Same for all servers: verify an HMAC, parse JSON, build + sign a ~60-byte JSON reply.

    Returns (status, reply_body, reply_signature)."""
    if path != PATH or nonce is None or timestamp is None or signature is None:
        return 400, b'{"error":"bad request"}', ""
    if not hmac.compare_digest(hmac.new(KEY, body, hashlib.sha256).hexdigest(), signature):
        return 401, b'{"error":"bad signature"}', ""
    msg = json.loads(body)
    reply = json.dumps({"ok": True, "round": msg["round"], "worker": msg["worker"], "t": 0.0},
                       separators=(",", ":")).encode()
    sig = hmac.new(KEY, nonce.encode() + reply, hashlib.sha256).hexdigest()
    return 200, reply, sig


def ready(port):
    print(f"READY {port}", flush=True)
