"""Load generator + driver. Pinned to CPU 1; starts the server (which pins itself to CPU 0).

usage: bench.py SERVER SCENARIO [--uvloop]   SERVER in stdlib|aiohttp_app|aiohttp_low|httptools|minimal
       SCENARIO in throughput|fleet|idle ; appends one JSON line to results.jsonl
"""
import asyncio, select, hashlib, hmac, json, os, random, resource, socket, subprocess, sys, time

KEY = b"k" * 32
HERE = os.path.dirname(os.path.abspath(__file__))
PY = os.path.join(HERE, "venv", "bin", "python")
TCK = os.sysconf("SC_CLK_TCK")


def proc_cpu(pid):
    with open(f"/proc/{pid}/stat") as f:
        rest = f.read().rpartition(")")[2].split()
    return (int(rest[11]) + int(rest[12])) / TCK  # utime + stime


def proc_status(pid):
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "Threads"):
                out[k] = int(v.split()[0])
    return out  # VmRSS in kB


def cores_busy():
    """user+nice+system seconds on CPUs 0 and 1 (everyone's), to detect foreign load."""
    tot = 0
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith(("cpu0 ", "cpu1 ")):
                v = line.split()
                tot += int(v[1]) + int(v[2]) + int(v[3])
    return tot / TCK


def my_cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def make_request(port, i):
    body = json.dumps({"worker": f"node-{i // 8:04d}/rank-{i % 8}", "round": 7, "pid": 400000 + i,
                       "host": f"node-{i // 8:04d}.cluster.local", "gpus": 8, "state": "running",
                       "step": 123456, "ts": 1754000000.125}, separators=(",", ":")).encode()
    sig = hmac.new(KEY, body, hashlib.sha256).hexdigest()
    nonce = f"{i:08x}{random.getrandbits(64):016x}"
    head = (f"POST /heartbeat HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nX-LE-Timestamp: {time.time():.3f}\r\nX-LE-Nonce: {nonce}\r\n"
            f"X-LE-Signature: {sig}\r\n\r\n")
    return head.encode() + body


async def connect(port):
    r, w = await asyncio.open_connection("127.0.0.1", port, limit=65536)
    w.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return r, w


async def roundtrip(r, w, req):
    w.write(req)
    head = await r.readuntil(b"\r\n\r\n")
    low = head.lower()
    i = low.find(b"content-length:")
    n = int(low[i + 15:low.index(b"\r\n", i)])
    await r.readexactly(n)
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(head[:40])


def pct(xs, p):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


async def connect_all(port, n, conc=256):
    sem = asyncio.Semaphore(conc)
    errors = 0

    async def one(i):
        nonlocal errors
        async with sem:
            try:
                return await asyncio.wait_for(connect(port), 15)
            except Exception:
                errors += 1
                return None
    conns = await asyncio.gather(*(one(i) for i in range(n)))
    return conns, errors


async def throughput(pid, port, nconn=256, secs=10.0):
    conns, cerr = await connect_all(port, nconn)
    reqs = [make_request(port, i) for i in range(nconn)]
    await asyncio.gather(*(roundtrip(r, w, reqs[i]) for i, (r, w) in enumerate(conns)))  # warm-up
    lat, errors = [], 0
    t0 = time.perf_counter(); c0 = proc_cpu(pid); m0 = my_cpu(); b0 = cores_busy()
    deadline = t0 + secs

    async def loop(i, r, w):
        nonlocal errors
        req = reqs[i]
        while True:
            s = time.perf_counter()
            if s >= deadline:
                return
            try:
                await roundtrip(r, w, req)
            except Exception:
                errors += 1
                return
            lat.append(time.perf_counter() - s)
    await asyncio.wait_for(asyncio.gather(*(loop(i, r, w) for i, (r, w) in enumerate(conns))), secs + 30)
    t1 = time.perf_counter(); c1 = proc_cpu(pid); m1 = my_cpu(); b1 = cores_busy()
    for r, w in conns:
        w.close()
    n = len(lat)
    return dict(requests=n, rps=n / (t1 - t0), server_cpu_s=c1 - c0, server_cpu_pct=100 * (c1 - c0) / (t1 - t0),
                server_us_per_req=1e6 * (c1 - c0) / n, client_cpu_pct=100 * (m1 - m0) / (t1 - t0),
                p50_ms=1e3 * pct(lat, 50), p99_ms=1e3 * pct(lat, 99), errors=errors + cerr,
                other_cpu_pct=100 * ((b1 - b0) - (c1 - c0) - (m1 - m0)) / (t1 - t0))


async def fleet(pid, port, nconn=4096, period=2.5, window=20.0):
    lat, errors, connect_errs, timeouts = [], 0, 0, 0
    T0 = time.perf_counter()
    w0, w1 = T0 + period, T0 + period + window
    conns = []
    status = {}

    async def worker(i):
        nonlocal errors, connect_errs, timeouts
        req = make_request(port, i)
        first = T0 + random.uniform(0, period)
        await asyncio.sleep(first - time.perf_counter())
        try:
            r, w = await asyncio.wait_for(connect(port), 10)
        except Exception:
            connect_errs += 1
            return
        conns.append(w)
        k = 0
        while True:
            t = first + k * period
            if t >= w1:
                return
            await asyncio.sleep(t - time.perf_counter())
            s = time.perf_counter()
            try:
                await asyncio.wait_for(roundtrip(r, w, req), 10)
            except asyncio.TimeoutError:
                timeouts += 1; errors += 1
                return
            except Exception:
                errors += 1
                return
            e = time.perf_counter()
            if w0 <= s < w1:
                lat.append(e - s)
            k += 1

    async def sampler():
        await asyncio.sleep(w0 - time.perf_counter())
        status["c0"], status["m0"], status["t0"], status["b0"] = proc_cpu(pid), my_cpu(), time.perf_counter(), cores_busy()
        status["threads_peak"] = proc_status(pid)["Threads"]
        await asyncio.sleep(w1 - time.perf_counter())
        status["c1"], status["m1"], status["t1"], status["b1"] = proc_cpu(pid), my_cpu(), time.perf_counter(), cores_busy()
        st = proc_status(pid)
        status["rss_mb"] = st["VmRSS"] / 1024
        status["threads"] = st["Threads"]
    await asyncio.wait_for(asyncio.gather(sampler(), *(worker(i) for i in range(nconn))), period + window + 40)
    for w in conns:
        w.close()
    dt = status["t1"] - status["t0"]
    n = len(lat)
    return dict(requests=n, rps=n / window, server_cpu_pct=100 * (status["c1"] - status["c0"]) / dt,
                server_us_per_req=1e6 * (status["c1"] - status["c0"]) / n if n else None,
                client_cpu_pct=100 * (status["m1"] - status["m0"]) / dt,
                p50_ms=1e3 * pct(lat, 50), p99_ms=1e3 * pct(lat, 99), p999_ms=1e3 * pct(lat, 99.9),
                max_ms=1e3 * max(lat) if lat else None, over_1s=sum(x > 1 for x in lat),
                errors=errors, timeouts=timeouts, connect_errors=connect_errs,
                rss_mb=status["rss_mb"], threads=status["threads"],
                other_cpu_pct=100 * ((status["b1"] - status["b0"]) - (status["c1"] - status["c0"])
                                     - (status["m1"] - status["m0"])) / dt)


async def idle(pid, port, nconn=8192, hold=3.0):
    base = proc_status(pid)
    conns, cerr = await connect_all(port, nconn)
    ok = [c for c in conns if c]
    req_errs = 0

    async def first(i, r, w):
        nonlocal req_errs
        try:
            await asyncio.wait_for(roundtrip(r, w, make_request(port, i)), 30)
        except Exception:
            req_errs += 1
    await asyncio.wait_for(asyncio.gather(*(first(i, r, w) for i, (r, w) in enumerate(ok))), 120)
    await asyncio.sleep(1.0)
    c0, t0 = proc_cpu(pid), time.perf_counter()
    await asyncio.sleep(hold)
    c1, t1 = proc_cpu(pid), time.perf_counter()
    st = proc_status(pid)
    for r, w in ok:
        w.close()
    return dict(connections=len(ok), connect_errors=cerr, request_errors=req_errs,
                rss_base_mb=base["VmRSS"] / 1024, threads_base=base["Threads"],
                rss_mb=st["VmRSS"] / 1024, threads=st["Threads"],
                kb_per_conn=(st["VmRSS"] - base["VmRSS"]) / max(1, len(ok)),
                idle_cpu_pct=100 * (c1 - c0) / (t1 - t0))


def main():
    server, scenario = sys.argv[1], sys.argv[2]
    uv = "--uvloop" in sys.argv
    os.sched_setaffinity(0, {1})
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    cmd = [PY, os.path.join(HERE, f"srv_{server}.py"), str(port)] + (["--uvloop"] if uv else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(os.path.join(HERE, "server.err"), "a"), text=True)
    try:
        t = time.monotonic()
        buf = ""
        while "READY" not in buf:
            if time.monotonic() - t > 20 or proc.poll() is not None:
                raise SystemExit(f"server did not start: {buf!r}")
            if select.select([proc.stdout], [], [], 0.2)[0]:
                buf += proc.stdout.readline()
        time.sleep(0.3)
        affinity = sorted(os.sched_getaffinity(proc.pid))
        fn = {"throughput": throughput, "fleet": fleet, "idle": idle}[scenario]
        res = asyncio.run(fn(proc.pid, port))
        # every server thread pinned to CPU 0?
        tasks = os.listdir(f"/proc/{proc.pid}/task")
        pinned = True
        for t in tasks[:50]:
            try:
                pinned &= os.sched_getaffinity(int(t)) == {0}
            except ProcessLookupError:
                pass
        res = dict(server=server + ("+uvloop" if uv else ""), scenario=scenario, server_affinity=affinity,
                   threads_pinned=pinned, **res)
        print(json.dumps(res))
        with open(os.path.join(HERE, "results.jsonl"), "a") as f:
            f.write(json.dumps(res) + "\n")
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill(); proc.wait(5)


if __name__ == "__main__":
    main()
