"""`RayRuntime`, what the controller drives when workers are Ray actors: it never sees Ray,
only awaitable calls, the runtime's clock, and the weight sync as one operation.

It holds the trainer ranks' actors; the rollout workers are one object it holds
(`RolloutActors`), the weight channel between them another (`WeightSync`,
weight_sync.py), and every call goes through one `RayCalls` (named, with a deadline). The
trainer's checkpoints travel as trainer_checkpoints.py says. Ray itself is started and stopped
by `lifecycle.py`.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Sequence

from ...protocol import EngineStats, GenerationRequest, GenerationResult, TrainBatch
from ...core.batching import split_for_ranks
from ...errors import WorkerCallError, WorkerLost
from ...metric_kinds import is_maximum
from ...runtime_protocol import TrainerRankLost
from ..node_files import DirectoryShipment
from ..rollout_worker import RolloutWorker
from ..trainer_rank import TrainerRank
from . import trainer_checkpoints
from .calls import RayCalls
from .lifecycle import start_ray, stop_ray
from .placement import actor_options, check_split_devices, colocation_group, role_group
from .rollout_actors import PublishedWeights, RolloutActors
from .trainer_calls import RankPlace, TrainerCalls, dead_replicas
from .trainer_rebuild import rebuild_trainer
from .weight_sync import WeightSync

if TYPE_CHECKING:
    from ..settings import RuntimeSettings


class RayRuntime:
    placement: dict[str, list[str | None]] | None = None  # on a cluster: each actor's node
    devices: dict[str, list[dict]] | None = None  # each actor's device (runtime/devices.py)

    def __init__(self, settings: RuntimeSettings, model_path: str, work_dir: str) -> None:
        self.session = start_ray(settings)  # None when joining a cluster: nothing watched
        self.settings = settings
        self.work_dir = work_dir  # the run directory: its checkpoints (published_rebuild.py)
        # a worker's full traceback goes to the run's worker_errors.log, where its line points
        self.calls = RayCalls(self.session, settings.cluster.timeout_s,
                              Path(work_dir).resolve() / "worker_errors.log")
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
        self.actors: RolloutActors | None = None  # the rollout workers, once started
        # replicas lost mid-step (worker -> why), until a step's metrics carry them to the
        # elastic driver: kept across an attempt a lost trainer rank interrupts
        self._replicas_lost: dict[str, str] = {}
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
        # a trainer rank's actor; a replacement (`trainer_rebuild.py`) takes its predecessor's
        # bundle, and its incarnation in its name
        trainer_cls = ray.remote(TrainerRank)

        def new_trainer(rank: int, world: int, incarnation: int = 0) -> Any:
            return trainer_cls.options(
                **actor_options(train_platform, cpus, share, groups["train"], rank),
                name=f"trainer-{rank}" + (f".{incarnation}" if incarnation else ""),
                namespace=self.namespace).remote(settings.trainer, rank, world, None, model)

        self.new_trainer = new_trainer
        self.trainer_generation = 0  # the trainer group's: +1 at each rebuild
        self.trainers = [new_trainer(rank, world) for rank in range(world)]
        # the trainer's version after its last completed call: what a rebuild after a lost
        # rank must go back to (trainer_rebuild.py), never past it
        self.trainer_version = 0
        # the last publish: the trainer's version (optimizer steps) then, and the policy
        # version it went out as; a rebuild without buddy copies finds the trainer's state on
        # the rollout workers by it (published_rebuild.py)
        self.publishing = (0, 0)
        group = self._rendezvous("trainer_group", world)
        self.calls.get_all([(f"trainer rank {r}", "start (trainer group, model)",
                             t.start.remote(group)) for r, t in enumerate(self.trainers)])
        # Where each rank runs: what the report of its loss names (`trainer_calls.py`)
        self.ranks = self._trainer_calls(self.calls.get_all(
            [(f"trainer rank {r}", "whereabouts", t.whereabouts.remote())
             for r, t in enumerate(self.trainers)]))
        if self.colocated:
            # The trainers' state waits in host memory before the engines sharing their
            # devices start, so each engine sizes its KV cache on a free device.
            self.calls.get_all([(f"trainer rank {r}", "offload (colocated start-up)",
                                 t.offload.remote()) for r, t in enumerate(self.trainers)])
        # Each actor's device on its node (`runtime/devices.py`); a colocated rollout worker
        # takes its trainer rank's.
        trainer_devices = self.calls.get_all([(f"trainer rank {r}", "device",
                                               t.device_binding.remote())
                                              for r, t in enumerate(self.trainers)])

        def shared(index: int) -> int | None:  # colocated: pair i's device (trainer's claim)
            return trainer_devices[index]["index"] if self.colocated else None

        def new_worker(index: int, incarnation: int) -> Any:  # incarnation: replacements so far
            return ray.remote(RolloutWorker).options(
                name=f"rollout-{index}.{incarnation}", namespace=self.namespace,
                **actor_options(rollout_platform, cpus, share, groups["rollout"], index)
            ).remote(settings.rollout, index, model, shared(index))

        self.weights = PublishedWeights()  # what a replacement may take, and when
        self.actors = RolloutActors([new_worker(i, 0) for i in range(settings.rollout_workers)],
                                    new_worker, self.calls, self.weights,
                                    reconnect=self._connect_weight_channel,
                                    send_weights=self._send_weights)
        self.weight_sync = WeightSync(settings.weight_channel, self.calls, self.actors,
                                      self._rendezvous)
        self._connect_weight_channel()
        self.devices = {"trainer": trainer_devices,
                        "rollout": self.calls.get_all([(f"rollout worker {i}", "device",
                                                        w.device_binding.remote())
                                                       for i, w in enumerate(self.workers)])}
        if self.across_nodes:  # where each actor landed, for the summary (and the user)
            self.placement = {
                "trainer": self.calls.get_all([(f"trainer rank {r}", "node address",
                                                t.node_address.remote())
                                               for r, t in enumerate(self.trainers)]),
                "rollout": self.calls.get_all([(f"rollout worker {i}", "node address",
                                                w.node_address.remote())
                                               for i, w in enumerate(self.workers)])}

    def _trainer_calls(self, places: list[dict]) -> TrainerCalls:
        return TrainerCalls(self.calls, [RankPlace(**p) for p in places],
                            self.settings.trainer.train.collective_timeout_s)

    async def recover_trainer(self, lost: TrainerRankLost) -> dict[str, float]:
        """The trainer rebuilt without `lost`'s rank (trainer_rebuild.py)."""
        return await rebuild_trainer(self, lost)

    @property
    def workers(self) -> list[Any]:
        """Each rollout worker's actor handle (only its length is read by the controller)."""
        return self.actors.handles if self.actors is not None else []

    @property
    def replacements(self) -> int:
        """Processes started to replace lost rollout workers, in all."""
        return self.actors.replacements

    async def replace_worker(self, worker: int) -> int:
        """A new process for lost rollout worker `worker` (`RolloutActors.replace_worker`);
        returns the weights' version it hosts."""
        if self.colocated:
            raise WorkerLost(worker, "generation", "a colocated rollout worker shares its "
                             "device with a trainer rank and is not replaced; resume the run "
                             "from its last checkpoint (resume=auto)")
        return await self.actors.replace_worker(worker)

    def _connect_weight_channel(self) -> None:
        """The weight channel opened from trainer rank 0 (`WeightSync.connect`): at start,
        after a rollout worker's replacement, and by a rebuild with a new rank 0."""
        self.weight_sync.connect(self.trainers)

    def _rendezvous(self, name: str, world_size: int) -> str:
        """Where a group of `world_size` members led by trainer rank 0 meets: a file of this
        run on a local Ray, else the `tcp://` store rank 0 opens on its node for it."""
        if not self.across_nodes:
            return f"file://{self.rendezvous_dir}/{name}"
        return self.calls.get_all([("trainer rank 0", f"rendezvous ({name})",
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
        await self.calls.call_all(first)
        await self.calls.call_all(then)
        self._switch_s += self.now() - began

    # ---- what the controller uses ----------------------------------------------------------
    def now(self) -> float:
        return time.monotonic()

    async def generate(self, worker: int, requests: list[GenerationRequest]
                       ) -> AsyncIterator[GenerationResult]:
        """The worker's results one by one as its trajectories finish; the deadline applies to
        each wait for the next result."""
        if self.actors.is_lost(worker):
            raise WorkerLost(worker, "generate", "it is being replaced")
        stream = self.actors.handle(worker).generate.options(num_returns="streaming"
                                                             ).remote(requests)
        what = f"generate ({len(requests)} requests)"
        while True:
            try:
                ref = await self.actors.call(worker, what, lambda _: stream.__anext__())
            except StopAsyncIteration:
                return
            for result in await self.actors.call(worker, what, lambda _: ref):
                yield result

    async def train(self, batch: TrainBatch, replicas: Sequence[int] = ()
                    ) -> dict[str, float]:
        """One RL step over the trainer ranks and, from the elastic pool, the rollout workers
        in `replicas` (joined and active): rows are split by tokens over all of them; each
        replica's gradients reach the ranks through the object store (no new communicator).
        A replica whose process dies mid-step is dropped and the step runs again without it
        on the same batch (`replicas_lost` in the step's metrics names it)."""
        await self.weights.training()  # not while a replacement exports the weights
        if self.colocated:
            await self._hand_devices_to("train")
        switch_s, self._switch_s = self._switch_s, 0.0
        replicas = [w for w in replicas if not self.actors.is_lost(w)]
        while True:
            refs, step = self._train_step(batch, replicas)
            try:
                results = await step
                break
            except WorkerCallError:
                dead = dead_replicas(refs)
                if not dead:
                    raise
            # A replica died mid-step: no rank stepped its optimizer (they fetch the replicas'
            # gradients before it, and discard their own on the failure), so the same batch
            # runs again without it; the rollout side replaces its process (the elastic
            # driver reads `replicas_lost` at the step's boundary).
            for worker, why in dead.items():
                self.actors.mark_lost(worker)
                self._replicas_lost[str(worker)] = why
            replicas = [w for w in replicas if w not in dead]
        lost, self._replicas_lost = self._replicas_lost, {}
        metrics = _combine_rank_metrics(results)
        self.trainer_version = int(metrics.pop("trainer_version"))
        # colocated: the hand-overs since the last step (to rollout after it, to training now)
        return {**metrics, **({"switch_s": switch_s} if self.colocated else {}),
                **({"replicas_lost": lost} if lost else {})}

    def _train_step(self, batch: TrainBatch, replicas: list[int]
                    ) -> tuple[dict[int, Any], Awaitable[list[dict[str, float]]]]:
        """One attempt at a step: each replica's reference (by rollout worker), and the trainer
        ranks' calls."""
        parts = split_for_ranks(batch, len(self.trainers) + len(replicas))
        total = int(batch.loss_mask.sum())
        refs = {w: self.actors.handle(w).replica_gradients.remote(part, total)
                for w, part in zip(replicas, parts[len(self.trainers):])}
        replica_tokens = int(sum(p.loss_mask.sum() for p in parts[len(self.trainers):]))
        # Nested in a list, the references are not awaited before the ranks start: each rank
        # runs its own forward/backward first and fetches the replicas' gradients after.
        # The driver does not fetch the gradients itself: a replica's failure or hang reaches it
        # through the ranks' calls (and their deadline), which wait for them.
        what = f"train_step (with replicas {replicas})" if replicas else "train_step"
        listed = list(refs.values()) or None
        return refs, self.ranks.call_all([(r, what, t.train.remote(part, listed, replica_tokens))
                                          for r, (t, part) in enumerate(zip(self.trainers,
                                                                            parts))])

    async def configure_rollout(self, max_batch_size: int, partial_rollout: bool) -> list[int]:
        """A new generation plan on every rollout worker; returns the versions they host."""
        return await self.calls.call_all([(f"rollout worker {i}", "configure",
                                           w.configure.remote(max_batch_size, partial_rollout))
                                          for i, w in enumerate(self.workers)])

    # A lent worker's death in a move is `WorkerLost` (`RolloutActors.call`): the elastic
    # driver forgets the move and the rollout replaces the worker; the run goes on.
    async def join_training(self, worker: int) -> None:
        await self.actors.call(worker, "join training", lambda a: a.join_training.remote())

    async def replica_version(self, worker: int) -> int:
        return await self.actors.call(worker, "replica version",
                                      lambda a: a.replica_version.remote())

    async def leave_training(self, worker: int) -> int:
        return await self.actors.call(worker, "leave training",
                                      lambda a: a.leave_training.remote())

    async def abort(self, worker: int, request_ids: list[str]) -> None:
        await self.actors.call(worker, f"abort ({len(request_ids)} requests)",
                                 lambda actor: actor.abort.remote(request_ids))

    async def sync_weights(self, version: int, hold: Sequence[int] = ()) -> list[int]:
        """Trainer -> every rollout worker, through the channel opened at start-up; returns
        the version each worker now hosts (a busy one, or one in `hold`, keeps its own with
        the new one staged; -1 for a worker being replaced, which gets the weights as it comes
        back)."""
        self.publishing = (self.trainer_version, version)
        hosted = await self._send_weights(version, hold)
        await self.weights.published(version)
        return hosted

    async def _send_weights(self, version: int, hold: Sequence[int] = ()) -> list[int]:
        # colocated: the export holds the weights in host memory, then it is the engines' turn
        hand_over = (lambda: self._hand_devices_to("rollout")) if self.colocated else None
        return await self.weight_sync.send(version, hold, self.trainers, self.ranks, hand_over)

    async def save(self, path: str) -> None:
        """The trainer's checkpoint into `path` (trainer_checkpoints.py)."""
        if self.colocated:  # the trainers gather their state on the devices
            await self._hand_devices_to("train")
        await trainer_checkpoints.save(
            self.ranks, self.trainers, path, namespace=self.namespace,
            ship_from=self.placement["trainer"] if self.ship_checkpoints else None)
        if self.colocated:
            await self._hand_devices_to("rollout")

    async def load(self, path: str) -> None:
        """Every trainer rank loads a checkpoint `save` wrote (trainer_checkpoints.py); the
        rollout workers get the weights with the next `sync_weights`."""
        if self.colocated:  # as in `save`: the trainers' state is on the devices meanwhile
            await self._hand_devices_to("train")
        self.trainer_version = await trainer_checkpoints.load(
            self.ranks, self.trainers, path, ship=self.ship_checkpoints)
        if self.colocated:
            await self._hand_devices_to("rollout")

    async def worker_stats(self) -> list[Any]:
        """Each worker's engine statistics; an empty record for one lost or being replaced."""
        async def one(worker: int) -> Any:
            try:
                return await self.actors.call(worker, "stats", lambda a: a.stats.remote())
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
    """Sums for each rank's own sums and token counts, maxima for maxima (metric_kinds.py),
    rank 0's value for the rest (already all-reduced; seconds ran side by side)."""
    combined = dict(results[0])
    for key in combined:
        values = [r.get(key, 0.0) for r in results]
        if is_maximum(key):
            combined[key] = max(values)
        elif key.endswith(("_sum", "_tokens")):
            combined[key] = sum(values)
    return combined
