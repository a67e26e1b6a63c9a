"""Two hosts on this machine (tests/multinode/hosts.py, issue 21): the collective weight channel
and one FSDP training step, two processes on one host (loopback) vs one on each host (veth),
side by side in one invocation.

    python bench/multinode_sync.py [--repeats 5] [--sizes tiny,64,256] [--bucket-mib 64]
                                   [--rows 32] [--length 96] [--micro-batch 64] [--threads 1]

Needs root (network and mount namespaces, as the multinode tests); no Ray. Four processes run
for the whole invocation: a pair inside host A that meets on 127.0.0.1 (its loopback; gloo on
`lo`), and a pair with rank 0 in host A and rank 1 in host B that meets on A's veth address
(gloo on each host's veth). Each pair meets through a `tcp://` store its rank 0 serves
(`hal.rendezvous.TcpStoreServer`), as Eddy's trainer ranks do on a cluster.

Measured, in this order, each after one warm-up round that is not counted:
- `channel SIZE`: the weights sent by rank 0 to rank 1 through `CollectiveChannel` (gloo) in
  buckets of `--bucket-mib` MiB (Eddy's `train.bucket_mb` default is 64): `tiny` is the shipped
  warm-start model's state dict (eddyrl/assets/tiny_warmstart, 3.3 MiB), a number is a
  synthetic float32 state dict of that many MiB (4 MiB tensors). The receiver checks every
  transfer against the weights it expects (outside the timed part).
- `FSDP step`: one `FSDPTrainEngine.train_step` of 2 data-parallel ranks on the warm-start
  model, `--rows` rows of `--length` tokens split between the ranks (the reduce-scatter of the
  gradients and the all-gather of the parameters cross the link).

A round times one transfer (or step) of each pair, one pair after the other, the order
alternating from round to round so that a change of the machine's load falls on both; the
idle pair waits on a file meanwhile. Inside a round both ranks first meet (a broadcast, or a
barrier), then time their part; the pair's time is the slower rank's. Printed: how it was run
(date, commit, cores, load average), each measurement's median, min and max over the rounds,
the veth / loopback ratio of the medians, and the load average after each measurement.
Numbers from a loaded machine are what they are: the load average is printed next to them.
Not part of the test suite.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the two-host fixture, imported by path
from multinode.hosts import TwoHosts, probe  # noqa: E402

WARM_START = ROOT / "eddyrl" / "assets" / "tiny_warmstart"
GROUP_TIMEOUT_S = 300.0  # inside the workers: a collective, the rendezvous (a hang guard)
WAIT_S = 900.0  # the coordinator, for one round or the workers' start (a hang guard)

WORKER = r'''
import json, os, sys, time
import torch

pair, rank, address, work = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
opts = json.loads(os.environ["BENCH_OPTS"])
torch.set_num_threads(opts["threads"])
os.environ["LOCAL_RANK"] = "0"

from eddyrl.hal import CollectiveChannel, get_platform, iter_buckets
from eddyrl.hal import distributed as hd
from eddyrl.hal.rendezvous import TcpStoreServer, make_store

TIMEOUT = opts["group_timeout_s"]
platform = get_platform("cpu")


def path(name):
    return os.path.join(work, f"{pair}.{name}")


def publish(name, value):
    with open(path(name) + ".tmp", "w") as file:
        json.dump(value, file)
    os.rename(path(name) + ".tmp", path(name))


def wait_for(name):
    deadline = time.monotonic() + opts["wait_s"]
    while not os.path.exists(path(name)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{pair} rank {rank}: no {name}")
        time.sleep(0.02)
    with open(path(name)) as file:
        return json.load(file)


def rendezvous(name):
    if rank == 0:
        server = TcpStoreServer(address, 2, TIMEOUT)
        publish(name, server.url)
        return server, server.url, server.store
    url = wait_for(name)
    return None, url, make_store(url, rank, 2, TIMEOUT)


def state_dict(size):
    if size == "tiny":
        from safetensors.torch import load_file
        return load_file(os.path.join(opts["model"], "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    return {f"w{i}": torch.randn(1024, 1024, generator=gen) for i in range(int(size) // 4)}


servers = []
server, url, store = rendezvous("trainer.url")
servers.append(server)
platform.init_process_group(rank, 2, None, TIMEOUT, store=store, address=address)
server, channel_url, channel_store = rendezvous("channel.url")
servers.append(server)
channel = CollectiveChannel.connect(platform, channel_url, rank, 2, TIMEOUT,
                                    store=channel_store, address=address)
publish(f"ready.{rank}", {"GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME")})

for job, (kind, size) in enumerate(opts["jobs"]):
    if kind == "channel":
        state = state_dict(size)
        buckets = list(iter_buckets(state.items(), opts["bucket_bytes"]))
        specs = [channel.describe(bucket) for bucket in buckets]  # both ranks know them
        sync = lambda: channel.group.broadcast(torch.zeros(1), 0).wait()

        def once():
            if rank == 0:
                for bucket in buckets:
                    channel.send(bucket)
                return None
            return [channel.receive(spec) for spec in specs]

        def check(received):
            if rank == 1:
                for got, want in zip(received, buckets):
                    if got.keys() != want.keys() or not all(torch.equal(got[k], want[k])
                                                           for k in want):
                        raise AssertionError(f"{pair}: the weights changed on the way")
    else:
        from eddyrl.core.losses import make_policy_loss
        from eddyrl.engines.training.fsdp import FSDPTrainEngine

        engine = FSDPTrainEngine(opts["model"], platform, rank, 2, url, local=False,
                                 lr=1e-6, micro_batch_size=opts["micro_batch"], seed=0,
                                 timeout_s=TIMEOUT)
        batch = torch.load(os.path.join(work, "batch.pt"), weights_only=False)
        half = len(batch) // 2
        mine = batch.select(slice(0, half) if rank == 0 else slice(half, len(batch)))
        loss = make_policy_loss(clip_low=0.2, clip_high=0.28, kl_coef=0.05)
        sync = hd.barrier
        once = lambda: engine.train_step(mine, loss)
        check = lambda result: None
    for round_ in range(opts["rounds"]):
        wait_for(f"go.{job}.{round_}")
        sync()
        began = time.perf_counter()
        result = once()
        took = time.perf_counter() - began
        check(result)
        publish(f"done.{job}.{round_}.{rank}", took)
    if kind == "channel":
        del state, buckets, result
    else:
        engine.close()
hd.barrier()
channel.close()
hd.destroy()
for server in servers:
    if server is not None:
        server.close()
'''


def _git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.strip() or "?"


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _batch(rows: int, length: int):
    import torch

    from eddyrl.protocol import TrainBatch

    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(5, 54, (rows, length), generator=gen)  # the tiny vocabulary
    attention_mask = torch.zeros(rows, length, dtype=torch.long)
    loss_mask = torch.zeros(rows, length)
    for row in range(rows):
        prompt = int(torch.randint(8, 24, (), generator=gen))
        response = int(torch.randint(8, length - prompt + 1, (), generator=gen))
        attention_mask[row, :prompt + response] = 1
        loss_mask[row, prompt:prompt + response] = 1
    old = -torch.rand(rows, length, generator=gen) * 3 * loss_mask
    return TrainBatch(input_ids=input_ids * attention_mask, attention_mask=attention_mask,
                      loss_mask=loss_mask, old_logprobs=old,
                      advantages=torch.randn(rows, 1, generator=gen) * loss_mask,
                      sample_weights=torch.ones(rows),
                      versions=torch.where(loss_mask > 0, 0, -1),
                      ref_logprobs=old + 0.1 * torch.randn(rows, length, generator=gen) * loss_mask)


class Pairs:
    """The two pairs' four workers: started, driven round by round, ended."""

    def __init__(self, hosts: TwoHosts, opts: dict, log_dir: Path) -> None:
        self.hosts, self.work = hosts, hosts.shared_dir
        self.pairs = {"loopback": [(hosts.a, "127.0.0.1"), (hosts.a, "127.0.0.1")],
                      "veth": [(hosts.a, hosts.a.address), (hosts.b, hosts.b.address)]}
        script = self.work / "worker.py"
        script.write_text(textwrap.dedent(WORKER))
        self.processes, self.logs = [], []
        for pair, ranks in self.pairs.items():
            for rank, (host, address) in enumerate(ranks):
                log = log_dir / f"{pair}.{rank}.log"
                self.logs.append(log)
                with open(log, "w") as out:
                    self.processes.append(host.popen(
                        [sys.executable, str(script), pair, str(rank), address, str(self.work)],
                        env={"BENCH_OPTS": json.dumps(opts), "OMP_NUM_THREADS":
                             str(opts["threads"])}, stdout=out, stderr=subprocess.STDOUT))

    def _wait(self, name: str) -> object:
        deadline = time.monotonic() + WAIT_S
        path = self.work / name
        while not path.exists():
            for process, log in zip(self.processes, self.logs):
                if process.poll() not in (None, 0):
                    raise RuntimeError(f"worker {log.stem} exited with {process.returncode}:\n"
                                       f"{log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {name} after {WAIT_S:.0f} s")
            time.sleep(0.01)
        return json.loads(path.read_text())

    def ready(self) -> dict:
        return {f"{pair} rank {rank}": self._wait(f"{pair}.ready.{rank}")["GLOO_SOCKET_IFNAME"]
                for pair in self.pairs for rank in range(2)}

    def round(self, job: int, round_: int) -> dict[str, float]:
        order = list(self.pairs) if round_ % 2 == 0 else list(self.pairs)[::-1]
        times = {}
        for pair in order:
            go = self.work / f"{pair}.go.{job}.{round_}"
            go.with_suffix(".tmp").write_text("true")
            go.with_suffix(".tmp").rename(go)  # whole, as the workers read it
            times[pair] = max(self._wait(f"{pair}.done.{job}.{round_}.{rank}")
                              for rank in range(2))
        return times

    def finish(self) -> None:
        deadline = time.monotonic() + WAIT_S
        for process, log in zip(self.processes, self.logs):
            process.wait(timeout=max(1.0, deadline - time.monotonic()))
            if process.returncode != 0:
                raise RuntimeError(f"worker {log.stem} exited with {process.returncode}:\n"
                                   f"{log.read_text()[-3000:]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="counted rounds per measurement")
    parser.add_argument("--sizes", default="tiny,64,256",
                        help="channel payloads: tiny (the warm-start model) or MiB (multiples "
                             "of 4)")
    parser.add_argument("--bucket-mib", type=int, default=64)
    parser.add_argument("--rows", type=int, default=32, help="the step's rows, both ranks")
    parser.add_argument("--length", type=int, default=96, help="tokens per row")
    parser.add_argument("--micro-batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--no-step", action="store_true", help="the channel only")
    args = parser.parse_args()
    reason = probe()
    if reason is not None:
        print(f"bench/multinode_sync.py needs network namespaces: {reason}", file=sys.stderr)
        return 2
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    for size in sizes:
        if size != "tiny" and (not size.isdigit() or int(size) % 4 or int(size) <= 0):
            parser.error(f"--sizes: {size!r} is neither tiny nor a positive multiple of 4")
    jobs = [("channel", size) for size in sizes] + ([] if args.no_step else [("step", None)])
    rounds = args.repeats + 1  # round 0 warms up
    opts = {"jobs": jobs, "rounds": rounds, "bucket_bytes": args.bucket_mib << 20,
            "micro_batch": args.micro_batch, "threads": args.threads, "model": str(WARM_START),
            "group_timeout_s": GROUP_TIMEOUT_S, "wait_s": WAIT_S}
    import torch

    started = datetime.datetime.now(datetime.timezone.utc)
    print(f"# bench/multinode_sync.py, {started:%Y-%m-%d %H:%M} UTC")
    print(f"# commit {_git('rev-parse', '--short', 'HEAD')}"
          f"{' (work tree has changes)' if _git('status', '--porcelain') not in ('', '?') else ''}"
          f"; {os.cpu_count()} CPUs; load average at start {_load()} (1, 5, 15 min)")
    print(f"# command: {' '.join(['python', 'bench/multinode_sync.py', *sys.argv[1:]])}")
    print(f"# torch {torch.__version__}; {args.threads} torch thread(s) per worker; "
          f"{args.repeats} counted rounds (+1 warm-up) per measurement; channel buckets "
          f"{args.bucket_mib} MiB; step: {args.rows} rows x {args.length} tokens, micro-batch "
          f"{args.micro_batch}, warm-start model")
    rows = []
    with TwoHosts() as hosts, tempfile.TemporaryDirectory() as logs:
        torch.save(_batch(args.rows, args.length), hosts.shared_dir / "batch.pt")
        pairs = Pairs(hosts, opts, Path(logs))
        began = time.monotonic()
        interfaces = pairs.ready()
        print(f"# workers up in {time.monotonic() - began:.1f} s; GLOO_SOCKET_IFNAME: "
              + ", ".join(f"{k} {v}" for k, v in interfaces.items()))
        for job, (kind, size) in enumerate(jobs):
            samples: dict[str, list[float]] = {"loopback": [], "veth": []}
            for round_ in range(rounds):
                times = pairs.round(job, round_)
                if round_ > 0:
                    for pair, took in times.items():
                        samples[pair].append(took)
            if kind == "channel":
                mib = (WARM_START / "model.safetensors").stat().st_size / 2**20 \
                    if size == "tiny" else float(size)
                what = f"channel {size}" + (f" ({mib:.1f} MiB)" if size == "tiny" else " MiB")
            else:
                mib, what = None, "FSDP step, 2 ranks"
            rows.append((what, mib, samples, _load()))
            print(f"# {what}: done, load average {_load()}", flush=True)
        pairs.finish()

    print()
    print("| measurement | loopback median (min–max) | veth median (min–max) | veth / loopback "
          "| loopback MiB/s | veth MiB/s | load average after |")
    print("|---|---|---|---|---|---|---|")
    for what, mib, samples, load in rows:
        med = {pair: statistics.median(values) for pair, values in samples.items()}

        def cell(pair: str) -> str:
            values = samples[pair]
            return f"{med[pair] * 1e3:.1f} ms ({min(values) * 1e3:.1f}–{max(values) * 1e3:.1f})"

        rates = [f"{mib / med[p]:.0f}" if mib else "–" for p in ("loopback", "veth")]
        print(f"| {what} | {cell('loopback')} | {cell('veth')} | "
              f"{med['veth'] / med['loopback']:.2f} | {rates[0]} | {rates[1]} | {load} |")
    print()
    print(f"# load average at the end {_load()}; whole run "
          f"{(datetime.datetime.now(datetime.timezone.utc) - started).total_seconds():.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
