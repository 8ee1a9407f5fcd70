import collections, json, os, statistics as st, sys
rows = [json.loads(l) for l in open(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "final.jsonl"))]
g = collections.defaultdict(list)
for r in rows:
    g[(r["server"], r["scenario"])].append(r)
for (srv, sc), rs in g.items():
    if sc == "throughput":
        us = [r["server_us_per_req"] for r in rs]; rps = [r["rps"] for r in rs]
        print(f"TP {srv:20s} rps med {st.median(rps):7.0f} [{min(rps):.0f}-{max(rps):.0f}] us/req med {st.median(us):5.1f} [{min(us):.1f}-{max(us):.1f}] srv% {st.median(r['server_cpu_pct'] for r in rs):.0f} cli% {st.median(r['client_cpu_pct'] for r in rs):.0f} p50 {st.median(r['p50_ms'] for r in rs):.1f} p99 {st.median(r['p99_ms'] for r in rs):.1f} err {sum(r['errors'] for r in rs)} other {[round(r['other_cpu_pct']) for r in rs]}")
    elif sc == "fleet":
        for r in rs:
            print(f"FL {srv:20s} cpu% {r['server_cpu_pct']:5.1f} us/req {r['server_us_per_req']:5.0f} p50 {r['p50_ms']:.2f} p99 {r['p99_ms']:.2f} p999 {r['p999_ms']:.1f} max {r['max_ms']:.0f} err {r['errors']} cerr {r['connect_errors']} thr {r['threads']} rss {r['rss_mb']:.0f} cli% {r['client_cpu_pct']:.0f} other {r['other_cpu_pct']:.0f}")
    else:
        for r in rs:
            print(f"ID {srv:20s} conns {r['connections']} cerr {r['connect_errors']} rerr {r['request_errors']} rss {r['rss_base_mb']:.0f}->{r['rss_mb']:.0f} MB ({r['kb_per_conn']:.1f} kB/conn) threads {r['threads']} idlecpu {r['idle_cpu_pct']}")
