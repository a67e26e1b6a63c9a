"""Workers as Ray actors. With no `cluster.address`, Ray starts on this machine bound to
loopback (token authentication stays on); with an address, Eddy joins that cluster.

`RayRuntime` is what the controller drives: it never sees Ray, only awaitable calls, the
runtime's clock, and the weight sync as one operation.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Sequence

from ..protocol import EngineStats, GenerationRequest, GenerationResult, TrainBatch
from ..core.batching import split_for_ranks
from ..errors import ConfigError, EddyError, WorkerLost
from ..stopping import stop_signals_as_interrupt
from .ray_calls import RayCalls
from .ray_placement import actor_options, check_split_devices, colocation_group, role_group
from .ray_recovery import PublishedWeights, WorkerReplacement
from . import ray_connect
from .devices import node_resources
from .node_files import DirectoryShipment
from .ray_session import LocalRaySession
from .workers import RolloutWorker, TrainerRank, weight_group_layout

if TYPE_CHECKING:
    from .settings import RuntimeSettings


_session: LocalRaySession | None = None  # the local Ray this process started, while it runs


def start_ray(settings: RuntimeSettings) -> LocalRaySession | None:
    """Local mode: every Ray server (GCS, raylet, object manager, workers' gRPC, agents, metrics)
    listens on loopback only, and Ray's token authentication stays on (its default for a local
    `ray.init`; RAY_AUTH_MODE is left alone) with a token of this session's own; its processes
    are reaped when the driver stops or dies, and its GCS and raylet watched
    (`ray_session.py`); it declares the devices of both roles' platforms. Returns that
    session (None when joining a cluster)."""
    global _session
    cluster = settings.cluster
    if cluster.address is None:
        if os.environ.get("RAY_ADDRESS"):
            # ray.init would join it, and refuse this call's local settings with a traceback
            raise ConfigError(f"RAY_ADDRESS is set ({os.environ['RAY_ADDRESS']!r}) but "
                              "cluster.address is not: a run without cluster.address starts "
                              "its own Ray on this machine. To join that cluster set "
                              "cluster.address=auto; to run locally, unset RAY_ADDRESS")
        # Ray 2.60 binds its servers to the node IP when that is loopback and to the wildcard
        # (or the machine's address) otherwise. `ray.init` replaces a loopback
        # `_node_ip_address` with the machine's routable address unless this variable is 0,
        # which Ray reads once, when first imported; set before that, it also reaches the
        # processes Ray starts.
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        # Ray starts its workers at niceness 15 (background work by default); Eddy's workers
        # are the run itself. At 15, any busy process beside the run takes nearly all the CPU
        # from them: on the 2-core VM with two busy loops, a test suite's e2e runs stalled.
        # A user's own setting wins.
        os.environ.setdefault("RAY_worker_niceness", "0")
        # When the driver connects, Ray's raylet starts a Python worker per CPU, ahead of any
        # task. A run's work is its actors, each started for itself, so on a small machine
        # those idle workers only take CPU from the run's start: with them a 2-step e2e run
        # on the 2-core VM took 1.14x the CPU (1.14-1.17 over 3 pairs); its wall time, 1.09x
        # in the median, was within the machine's noise (0.96-1.25).
        os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
    else:
        ray_connect.prepare_join(cluster.address)
    import ray

    if ray.is_initialized():
        return _session
    if _session is not None:  # shut down by someone else since: what is left of it goes
        _session.close()
        _session = None
    if cluster.address is None:
        from ray._private import ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = False  # the same, where Ray was imported earlier
        session = LocalRaySession()
        session.private_token()
        try:
            # address="local": a Ray of its own even when a cluster started with `ray start`
            # runs on this machine (without it, ray.init joins that one, found through
            # /tmp/ray/ray_current_cluster, and refuses num_cpus with a traceback)
            # A plug-in platform's devices are declared as Ray resources (Ray counts only
            # the accelerators it knows): without them its actors could never be placed.
            ray.init(address="local", num_cpus=cluster.num_cpus or os.cpu_count(),
                     resources=node_resources(settings.platforms) or None,
                     include_dashboard=False,
                     _node_ip_address="127.0.0.1",
                     logging_level="WARNING", log_to_driver=True, configure_logging=True)
        except BaseException:
            session.close()
            raise
        node_ip = ray.util.get_node_ip_address()
        if node_ip != "127.0.0.1":  # fail closed: never leave Ray listening on the network
            ray.shutdown()
            session.close()
            raise EddyError(f"local Ray started on {node_ip} instead of loopback (127.0.0.1); "
                            "its servers would accept connections from the network")
        session.started()
        _session = session
    else:
        ray_connect.join(cluster.address)
    stop_signals_as_interrupt()  # again after ray.init, which sets its own (a stack dump, an abort)
    return _session


def stop_ray() -> None:
    """Shut the local Ray down; then its session's leftovers are killed and its token removed
    (not while Ray is still up: a test may keep one Ray for two runs)."""
    global _session
    import ray

    ray.shutdown()
    if not ray.is_initialized() and _session is not None:
        _session.close()
        _session = None


class RayRuntime(RayCalls, WorkerReplacement):
    workers: list[Any]  # each rollout worker's actor handle
    placement: dict[str, list[str | None]] | None = None  # on a cluster: each actor's node
    devices: dict[str, list[dict]] | None = None  # each actor's device (runtime/devices.py)

    def __init__(self, settings: RuntimeSettings, model_path: str, work_dir: str) -> None:
        self.session = start_ray(settings)  # None when joining a cluster: nothing watched
        self._lost_future: asyncio.Future | None = None
        self.settings = settings
        self.timeout_s = settings.cluster.timeout_s
        # a worker's full traceback, where its one-line error points
        self.error_log = Path(work_dir).resolve() / "worker_errors.log"
        # On a local Ray every group's members are on this machine: they meet through files
        # in the run directory, with no listening socket at all. On a cluster they meet at a
        # store trainer rank 0 serves on its node's cluster address (`_rendezvous`).
        self.across_nodes = settings.cluster.address is not None
        # Checkpoints: the ranks write run_dir themselves where every node sees it; else they
        # save on their own nodes and the driver writes what it collects (`save`, `load`).
        self.ship_checkpoints = self.across_nodes and not settings.cluster.shared_run_dir
        self.rendezvous_dir = tempfile.mkdtemp(prefix="rendezvous-",
                                               dir=os.path.abspath(work_dir))
        self.trainers: list[Any] = []
        self.workers = []
        self._group = None
        try:
            self._start(settings, model_path)
        except BaseException:  # a worker that failed to start: nothing of this start stays up
            self.shutdown()
            raise

    def _start(self, settings: RuntimeSettings, model_path: str) -> None:
        import ray

        cluster = settings.cluster
        # Fractional CPUs: on a 2-core laptop all workers must fit at once (they take turns).
        cpus = min(1.0, (cluster.num_cpus or os.cpu_count() or 2) /
                   (settings.rollout_workers + settings.trainer_ranks + 1))
        train_platform = settings.platforms.train
        rollout_platform = settings.platforms.rollout
        world = settings.trainer_ranks
        # A cluster's nodes may not see the driver's files: the model goes to them as data.
        model = DirectoryShipment.from_path(model_path, shared=cluster.shared_model) \
            if self.across_nodes else model_path
        # Colocated: rollout worker i and trainer rank i take turns on device i (half of it
        # each as far as Ray is concerned; really all of it, one role at a time).
        self.colocated = cluster.placement == "colocated"
        self._group = colocation_group(settings, train_platform, cpus) if self.colocated \
            else None
        if not self.colocated and cluster.address is None:
            check_split_devices(settings, {"train": train_platform, "rollout": rollout_platform})
        share = 0.5 if self.colocated else 1.0
        # split: each role's actors placed over the cluster's nodes as configured (or not)
        self._role_groups = {} if self.colocated else {
            role: role_group(settings, role, platform, cpus)
            for role, platform in (("train", train_platform), ("rollout", rollout_platform))}
        groups = {role: self._role_groups.get(role, self._group) for role in ("train", "rollout")}
        # Actors are named (`trainer-<rank>`, `rollout-<index>.<incarnation>`: what `ray list
        # actors` shows) in a namespace of this run's own, so runs sharing a cluster never clash.
        self.namespace = f"eddy-{uuid.uuid4().hex[:12]}"
        self._switch_s = 0.0  # colocated hand-over time not yet reported in a step's metrics
        trainer_cls = ray.remote(TrainerRank)
        self.trainers = [trainer_cls.options(**actor_options(train_platform, cpus, share,
                                                              groups["train"], rank),
                                             name=f"trainer-{rank}", namespace=self.namespace
                                             ).remote(settings.trainer, rank, world, None, model)
                         for rank in range(world)]
        group = self._rendezvous("trainer_group", world)
        self._get_all([(f"trainer rank {r}", "start (trainer group, model)", t.start.remote(group))
                       for r, t in enumerate(self.trainers)])
        if self.colocated:
            # The trainers' state waits in host memory before the engines sharing their
            # devices start, so each engine sizes its KV cache on a free device.
            self._get_all([(f"trainer rank {r}", "offload (colocated start-up)",
                            t.offload.remote()) for r, t in enumerate(self.trainers)])
        # Each actor's device on its node (`runtime/devices.py`); a colocated rollout worker
        # takes its trainer rank's.
        trainer_devices = self._get_all([(f"trainer rank {r}", "device",
                                          t.device_binding.remote())
                                         for r, t in enumerate(self.trainers)])

        def shared(index: int) -> int | None:  # colocated: pair i's device (trainer's claim)
            return trainer_devices[index]["index"] if self.colocated else None

        # the incarnation counts a rollout worker's replacements after losses
        self._new_worker = lambda index, incarnation: ray.remote(RolloutWorker).options(
            name=f"rollout-{index}.{incarnation}", namespace=self.namespace,
            **actor_options(rollout_platform, cpus, share, groups["rollout"], index)
        ).remote(settings.rollout, index, model, shared(index))
        self.workers = [self._new_worker(index, 0) for index in range(settings.rollout_workers)]
        self._incarnations = [0] * len(self.workers)
        self._lost: set[int] = set()  # workers being replaced: calls to them fail at once
        self.weights = PublishedWeights()  # what a replacement may take, and when
        self._channel_generation = 0
        self._connect_weight_channel()
        self.devices = {"trainer": trainer_devices,
                        "rollout": self._get_all([(f"rollout worker {i}", "device",
                                                   w.device_binding.remote())
                                                  for i, w in enumerate(self.workers)])}
        if self.across_nodes:  # where each actor landed, for the summary (and the user)
            self.placement = {
                "trainer": self._get_all([(f"trainer rank {r}", "node address",
                                           t.node_address.remote())
                                          for r, t in enumerate(self.trainers)]),
                "rollout": self._get_all([(f"rollout worker {i}", "node address",
                                           w.node_address.remote())
                                          for i, w in enumerate(self.workers)])}

    # ---- calls with names and deadlines: `_call`, `_get_all` (ray_calls.py) ----------------
    async def _all(self, calls: list[tuple[str, str, Any]]) -> list[Any]:
        return await asyncio.gather(*(self._call(*c) for c in calls))

    def _connect_weight_channel(self) -> None:
        """Open the weight channel between trainer rank 0 and every rollout worker. A worker
        found dead meanwhile is marked lost (its next call tells the rollout); a collective
        group cannot form without it, so there that is an error."""
        kind = self.settings.weight_channel
        # Trainer rank 0 sends; each rollout worker receives with one rank, or with one per
        # process of its engine where the engine takes the broadcast itself (vLLM's workers).
        ranks = self._each_worker([w.weight_ranks.remote(kind) for w in self.workers], kind, 1)
        offsets, world = weight_group_layout(ranks)
        # a new rendezvous per connection: a replaced worker rebuilds the group for every member
        rendezvous = self._rendezvous(f"weight_channel.{self._channel_generation}", world) \
            if kind == "collective" else ""
        self._channel_generation += 1
        trainers = [(f"trainer rank {r}", "weight channel set-up",
                     t.connect_weight_channel.remote(kind, rendezvous, 0, world))
                    for r, t in enumerate(self.trainers)]
        self._each_worker([w.connect_weight_channel.remote(kind, rendezvous, offset, world)
                           for w, offset in zip(self.workers, offsets)], kind, None)
        self._get_all(trainers)

    def _rendezvous(self, name: str, world_size: int) -> str:
        """Where a group of `world_size` members led by trainer rank 0 meets: a file of this
        run on a local Ray, else the `tcp://` store rank 0 opens on its node for it."""
        if not self.across_nodes:
            return f"file://{self.rendezvous_dir}/{name}"
        return self._get_all([("trainer rank 0", f"rendezvous ({name})",
                               self.trainers[0].open_rendezvous.remote(world_size))])[0]

    async def _hand_devices_to(self, role: str) -> None:
        """Colocated turn-taking. To training: every engine finishes and sleeps (KV cache
        freed, weights off the device), then the trainers' state comes back. To rollout: the
        trainers' state goes to host memory, then the engines wake."""
        sleepers = [(f"rollout worker {i}", f"sleep (device to {role})", w.sleep.remote()
                     if role == "train" else w.wake.remote()) for i, w in enumerate(self.workers)]
        movers = [(f"trainer rank {r}", f"{'onload' if role == 'train' else 'offload'} "
                   "(colocated)", t.onload.remote() if role == "train" else t.offload.remote())
                  for r, t in enumerate(self.trainers)]
        first, then = (sleepers, movers) if role == "train" else (movers, sleepers)
        began = self.now()
        await self._all(first)
        await self._all(then)
        self._switch_s += self.now() - began

    # ---- what the controller uses ----------------------------------------------------------
    def now(self) -> float:
        return time.monotonic()

    async def generate(self, worker: int, requests: list[GenerationRequest]
                       ) -> AsyncIterator[GenerationResult]:
        """The worker's results one by one as its trajectories finish; the deadline applies to
        each wait for the next result."""
        if worker in self._lost:
            raise WorkerLost(worker, "generate", "it is being replaced")
        stream = self.workers[worker].generate.options(num_returns="streaming").remote(requests)
        what = f"generate ({len(requests)} requests)"
        while True:
            try:
                ref = await self._rollout_call(worker, what, lambda _: stream.__anext__())
            except StopAsyncIteration:
                return
            for result in await self._rollout_call(worker, what, lambda _: ref):
                yield result

    async def train(self, batch: TrainBatch, replicas: Sequence[int] = ()
                    ) -> dict[str, float]:
        """One RL step over the trainer ranks and, from the elastic pool, the rollout workers
        in `replicas` (joined and active): rows are split by tokens over all of them; each
        replica's gradients reach the ranks through the object store (no new communicator)."""
        await self.weights.training()  # not while a replacement exports the weights
        if self.colocated:
            await self._hand_devices_to("train")
        switch_s, self._switch_s = self._switch_s, 0.0
        replicas = list(replicas)
        parts = split_for_ranks(batch, len(self.trainers) + len(replicas))
        total = int(batch.loss_mask.sum())
        refs = [self.workers[w].replica_gradients.remote(part, total)
                for w, part in zip(replicas, parts[len(self.trainers):])]
        replica_tokens = int(sum(p.loss_mask.sum() for p in parts[len(self.trainers):]))
        # Nested in a list, the references are not awaited before the ranks start: each rank
        # runs its own forward/backward first and fetches the replicas' gradients after.
        # The driver does not fetch the gradients itself: a replica's failure or hang reaches it
        # through the ranks' calls (and their deadline), which wait for them.
        results = await self._all([(f"trainer rank {r}", "train_step (with replicas "
                                    f"{replicas})" if replicas else "train_step",
                                    t.train.remote(part, refs or None, replica_tokens))
                                   for r, (t, part) in enumerate(zip(self.trainers, parts))])
        # colocated: the hand-overs since the last step (to rollout after it, to training now)
        return {**_combine_rank_metrics(results), **({"switch_s": switch_s}
                                                     if self.colocated else {})}

    async def configure_rollout(self, max_batch_size: int, partial_rollout: bool) -> list[int]:
        """A new generation plan on every rollout worker; returns the versions they host."""
        return await self._all([(f"rollout worker {i}", "configure",
                                 w.configure.remote(max_batch_size, partial_rollout))
                                for i, w in enumerate(self.workers)])

    async def join_training(self, worker: int) -> None:
        await self._call(f"rollout worker {worker}", "join training",
                         self.workers[worker].join_training.remote())

    async def replica_version(self, worker: int) -> int:
        return await self._call(f"rollout worker {worker}", "replica version",
                                self.workers[worker].replica_version.remote())

    async def leave_training(self, worker: int) -> int:
        return await self._call(f"rollout worker {worker}", "leave training",
                                self.workers[worker].leave_training.remote())

    async def abort(self, worker: int, request_ids: list[str]) -> None:
        await self._rollout_call(worker, f"abort ({len(request_ids)} requests)",
                                 lambda actor: actor.abort.remote(request_ids))

    async def sync_weights(self, version: int, hold: Sequence[int] = ()) -> list[int]:
        """Trainer -> every rollout worker, through the channel opened at start-up; returns
        the version each worker now hosts (a busy one, or one in `hold`, keeps its own with
        the new one staged; -1 for a worker being replaced, which gets the weights as it comes
        back)."""
        hosted = await self._send_weights(version, hold)
        await self.weights.published(version)
        return hosted

    async def _send_weights(self, version: int, hold: Sequence[int] = ()) -> list[int]:
        specs = await self._all([(f"trainer rank {r}", "weight export", t.describe_weights.remote())
                                 for r, t in enumerate(self.trainers)])
        if self.colocated:  # the export holds the weights in host memory: the engines' turn
            await self._hand_devices_to("rollout")
        receivers = [i for i in range(len(self.workers)) if i not in self._lost]
        results = await asyncio.gather(
            *(self._call(f"trainer rank {r}", "weight send", t.send_weights.remote())
              for r, t in enumerate(self.trainers)),
            *(self._rollout_call(i, f"weight load v{version}",
                                 lambda actor, i=i: actor.load_weights.remote(
                                     version, specs[0], i in hold))
              for i in receivers), return_exceptions=True)
        hosted = [-1] * len(self.workers)
        for result in results[:len(self.trainers)]:
            if isinstance(result, BaseException):
                raise result
        for worker, result in zip(receivers, results[len(self.trainers):]):
            if isinstance(result, WorkerLost):
                # dead before anyone noticed: its next call raises WorkerLost to the rollout,
                # which puts its requests back and has it replaced
                self._lost.add(worker)
            elif isinstance(result, BaseException):
                raise result
            else:
                hosted[worker] = result
        return hosted

    async def save(self, path: str) -> None:
        if self.colocated:  # the trainers gather their state on the devices
            await self._hand_devices_to("train")
        if self.ship_checkpoints:
            await self._save_through_driver(path)
        else:
            await self._all([(f"trainer rank {r}", f"save to {path}", t.save.remote(path))
                             for r, t in enumerate(self.trainers)])
        if self.colocated:
            await self._hand_devices_to("rollout")

    async def _save_through_driver(self, path: str) -> None:
        """Each rank saves on its node's disk; from one rank per node the driver collects the
        files (through the object store) and writes them into `path`, which the caller then
        renames into place (checkpoints.write); the nodes' copies are removed."""
        name = f"{self.namespace}-{uuid.uuid4().hex[:8]}"
        ranks = list(enumerate(self.trainers))
        local = await self._all([(f"trainer rank {r}", "save on its node",
                                  t.save_on_node.remote(name)) for r, t in ranks])
        nodes = self.placement["trainer"]  # the ranks' nodes, asked once at start
        first_on_node = {node: rank for rank, node in reversed(list(enumerate(nodes)))}
        try:
            shipments = await self._all([(f"trainer rank {r}", f"checkpoint files ({nodes[r]})",
                                          self.trainers[r].collect.remote(local[r]))
                                         for r in sorted(first_on_node.values())])
            for shipment in shipments:  # blocking reads of the object store: off the loop
                await asyncio.to_thread(shipment.write_into, path)
        finally:
            await self._all([(f"trainer rank {r}", "discard its node's copy",
                              self.trainers[r].discard.remote(local[r]))
                             for r in sorted(first_on_node.values())])

    async def load(self, path: str) -> None:
        """Every trainer rank loads a checkpoint `save` wrote (weights, optimizer, RNG); the
        rollout workers get the weights with the next `sync_weights`. On a cluster without a
        shared run directory the checkpoint's files go to the ranks through the object store."""
        if self.colocated:  # as in `save`: the trainers' state is on the devices meanwhile
            await self._hand_devices_to("train")
        checkpoint = await asyncio.to_thread(DirectoryShipment.from_path, path) \
            if self.ship_checkpoints else path
        await self._all([(f"trainer rank {r}", f"load from {path}", t.load.remote(checkpoint))
                         for r, t in enumerate(self.trainers)])
        if self.colocated:
            await self._hand_devices_to("rollout")

    async def worker_stats(self) -> list[Any]:
        """Each worker's engine statistics; an empty record for one lost or being replaced."""
        async def one(worker: int) -> Any:
            try:
                return await self._rollout_call(worker, "stats", lambda a: a.stats.remote())
            except WorkerLost:
                return EngineStats(running=0, waiting=0, version=-1, tokens_generated=0,
                                   busy_seconds=0.0)
        return list(await asyncio.gather(*(one(i) for i in range(len(self.workers)))))

    def shutdown(self) -> None:
        import ray

        lost = self.session is not None and self.session.lost() is not None
        for actor in self.trainers + self.workers if not lost else ():  # gone with the raylet
            ray.kill(actor)
        groups = [self._group, *getattr(self, "_role_groups", {}).values()]
        if not lost:
            from ray.util.placement_group import remove_placement_group

            for group in filter(None, groups):
                remove_placement_group(group)
        if self.settings.cluster.address is None:
            stop_ray()
        else:  # the driver leaves the cluster (which goes on): its workers' forwarded log
            ray.shutdown()  # lines stop here, not after the run's last line
        shutil.rmtree(self.rendezvous_dir, ignore_errors=True)


def _combine_rank_metrics(results: list[dict[str, float]]) -> dict[str, float]:
    """Sums for counts, maxima for maxima, rank 0's value for the rest (already all-reduced)."""
    combined = dict(results[0])
    for key in combined:
        values = [r.get(key, 0.0) for r in results]
        if key.endswith("_max"):
            combined[key] = max(values)
        elif key.endswith(("_sum", "_tokens")):
            combined[key] = sum(values)
    return combined
