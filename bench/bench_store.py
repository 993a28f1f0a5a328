"""Benchmark: what one P2P report costs the rendezvous store's server, the one process every report goes through.

A P2P receiver learns that a round's bytes landed, and their checksums, from a report its writer posts on the
transport group's store (`transports/p2p/notices.py`), hosted by the trainer's leader; a TCPStore server
answers its requests one at a time. At full scale that is tens of thousands of reports a sync (Kimi-K2 into
8 engines of TP=32 in `make scale`: the `control notices` phase counts them), so the server's time per report
bounds the sync. Each client process here posts a report and takes it back, `--reports` times; the server
runs in a process of its own and its CPU time (user + system, every thread) over the reports is printed:

- `before`: set, wait, get, delete (how a report was taken until 2026-12-06), through the same bounded
  clients;
- `notices`: the library's own `Notices.report` and `Notices.take_reports` on a blocking board: each of a
  round's writers posts its report (a set), the receiver takes them all in one blocking multi-get; with one
  writer a round and with `--batch` (8: a Kimi-K2 head rank's round has about that many writers). The taken
  reports are deleted afterwards, as `Notices.forget` deletes them once the version is agreed, timed on
  their own. The two runs give a report's post and a round's take, the scale model's `store_post_s` and
  `store_take_s`.

    PYTHONPATH=. python bench/bench_store.py                  # 8 clients, 2000 reports each
    PYTHONPATH=. python bench/bench_store.py --clients 16 --reports 1000
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import time

from bench.bench_sync import machine_description

REPORT = {7: 123456789, 8: -987654321}  # two pieces' checksums, as a round of two pieces reports them


def _server(ready, stop, out) -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    ready.put(store.port)
    marks = []
    while True:
        what = stop.get()
        t = os.times()
        marks.append(t.user + t.system)
        if what == "end":
            break
    out.put(marks)


def _client(port: int, index: int, reports: int, mode: str, batch: int, go, done) -> None:
    import torch.distributed as dist

    from megatron_sync.session.board import store_board
    from megatron_sync.transports.p2p.notices import Notices, RoundReport

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    board = store_board(store, prefix="bench/", rank=index, timeout_s=60.0, blocking=True)
    notices = Notices(board, version=1, attempt=1)
    report = RoundReport(REPORT, 64 << 20)
    bounded = board.medium._store  # the same bounded client the board's requests go through
    waiter = bounded.clone()  # as the blocking board waited: on a clone of the waiting thread's own
    go.wait()
    start = time.perf_counter()
    writers = [f"trainer/{w}" for w in range(batch)]
    for r in range(reports // batch):
        if mode == "before":
            key = f"bench/p2p/v1.1/report/{index}/{r}/trainer/0"
            bounded.set(key, report.to_bytes())
            waiter.wait([key], 1.0)
            RoundReport.from_bytes(bounded.get(key))
            bounded.delete_key(key)
        else:  # a round of `batch` writers: each posts its report, the receiver takes them together
            for writer in writers:
                notices.report(writer, index, r, report)
            notices.take_reports(writers, index, r, 60.0)
    done.put(("reports", start, time.perf_counter()))
    go.wait()
    start = time.perf_counter()
    for key in notices.taken:  # as `Notices.forget` deletes them once the version is agreed
        board.remove(key)
    done.put(("forget", start, time.perf_counter()))
    waiter.close()
    board.close()


def run(mode: str, clients: int, reports: int, batch: int = 1) -> dict:
    """Return the server's CPU seconds and the wall seconds of the reports and of forgetting them."""
    ctx = mp.get_context("spawn")
    ready, stop, out, done = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    go = ctx.Barrier(clients + 1)
    server = ctx.Process(target=_server, args=(ready, stop, out))
    server.start()
    port = ready.get(timeout=60)
    workers = [ctx.Process(target=_client, args=(port, i, reports, mode, batch, go, done)) for i in range(clients)]
    for w in workers:
        w.start()
    result = {}
    for phase in ("reports", "forget"):
        stop.put("mark")
        go.wait(timeout=120)
        spans = [done.get(timeout=600) for _ in workers]
        result[phase + "_wall_s"] = max(e for _, _, e in spans) - min(s for _, s, _ in spans)
    stop.put("end")
    marks = out.get(timeout=60)
    for w in workers + [server]:
        w.join(timeout=60)
    result["reports_cpu_s"], result["forget_cpu_s"] = marks[1] - marks[0], marks[2] - marks[1]
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--reports", type=int, default=2000, help="reports each client posts and takes")
    parser.add_argument("--batch", type=int, default=8, help="writers of a round in the batched run (at least 2)")
    args = parser.parse_args(argv)
    print(machine_description())
    total = args.clients * args.reports
    print(f"{args.clients} client processes x {args.reports} reports = {total:,} reports; server CPU = its "
          "process's user + system time over them")
    per = {}
    for mode, batch in (("before", 1), ("notices", 1), ("notices", args.batch)):
        r = run(mode, args.clients, args.reports, batch)
        per[(mode, batch)] = r["reports_cpu_s"] / total
        print(f"{mode:>8}, {batch} writer(s) a round: server CPU {1e6 * per[(mode, batch)]:5.1f} us a report "
              f"({1 / per[(mode, batch)]:,.0f} reports/s of one server core), wall {r['reports_wall_s']:.2f} s"
              + (f"; deleting them after the version: {1e6 * r['forget_cpu_s'] / total:.1f} us a report"
                 if mode == "notices" else ""))
    # per report: post + take / batch; solve the two notices runs for the post and the take
    b = args.batch
    take = (per[("notices", 1)] - per[("notices", b)]) * b / (b - 1)
    print(f"  => a report's post {1e6 * (per[('notices', 1)] - take):.1f} us, a round's take (one request for all "
          f"its reports) {1e6 * take:.1f} us of the server's CPU")
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
