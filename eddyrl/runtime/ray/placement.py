"""Where Ray puts a run's actors: each worker's resource request, and the two placements
(`cluster.placement`): split (a device per worker, checked against what the machine has) and
colocated (one placement-group bundle per device, shared by rollout worker i and trainer
rank i)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...errors import ConfigError
from ...hal import get_platform

if TYPE_CHECKING:
    from ..settings import RuntimeSettings


def actor_options(platform_name: str, cpus: float, share: float = 1.0,
                   group: Any = None, bundle: int = 0) -> dict[str, Any]:
    """Ray options for one actor: `share` of one device, inside placement `group`'s `bundle`
    when given (colocated actors share the bundle's device)."""
    platform = get_platform(platform_name, require_available=False)
    options = {"num_cpus": cpus, **platform.ray_actor_resources(share)}
    if group is not None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=bundle)
    return options


def check_split_devices(run: RuntimeSettings, platforms: dict[str, str]) -> None:
    """A split placement gives every worker its own device; on a machine with too few, say so
    now rather than leave actors waiting for devices that never free up."""
    import ray

    needed: dict[str, int] = {}
    for role, name in platforms.items():
        resource = get_platform(name, require_available=False).ray_resource
        if resource:
            needed[resource] = needed.get(resource, 0) + run.workers(role)
    have = ray.cluster_resources()
    for resource, count in needed.items():
        if have.get(resource, 0) < count:
            raise ConfigError(
                f"cluster.placement = split gives each of rollout.num_workers = "
                f"{run.rollout_workers} and train.num_workers = "
                f"{run.trainer_ranks} its own {resource}, {count} in all; this machine "
                f"has {have.get(resource, 0):g}. Set cluster.placement = colocated to time-share "
                "the devices (synchronous training), or use fewer workers")


def colocation_group(run: RuntimeSettings, platform_name: str, cpus: float) -> Any:
    """One placement-group bundle per device, holding rollout worker i and trainer rank i:
    without it, fractional requests could put two trainer ranks on one device."""
    pairs = run.rollout_workers
    if pairs != run.trainer_ranks:
        raise ConfigError(
            "cluster.placement = colocated pairs rollout worker i with trainer rank i on one "
            f"device, but rollout.num_workers = {pairs} and train.num_workers = "
            f"{run.trainer_ranks}; make them equal")
    platform = get_platform(platform_name, require_available=False)
    bundle = {"CPU": 2 * cpus, **platform.ray_bundle(1)}
    strategy = run.cluster.train_strategy
    return _reserved([dict(bundle) for _ in range(pairs)],
                     "PACK" if strategy == "any" else strategy.upper(),
                     f"cluster.placement = colocated ({pairs} pair(s))", run.cluster.timeout_s)


def role_group(run: RuntimeSettings, role: str, platform_name: str, cpus: float) -> Any:
    """Split placement on a cluster: one bundle per actor of `role` ("train", "rollout"),
    placed by `cluster.<role>_strategy` (None for "any": Ray's own scheduling). Actor i takes
    bundle i; a replaced worker takes its predecessor's."""
    strategy = getattr(run.cluster, f"{role}_strategy")
    if strategy == "any":
        return None
    platform = get_platform(platform_name, require_available=False)
    bundle = {"CPU": cpus, **platform.ray_bundle(1)}
    count = run.workers(role)
    return _reserved([dict(bundle) for _ in range(count)], strategy.upper(),
                     f"cluster.{role}_strategy = {strategy} ({count} {role} actor(s))",
                     run.cluster.timeout_s)


def _reserved(bundles: list[dict], strategy: str, what: str, timeout_s: float) -> Any:
    """A placement group of `bundles` by `strategy`, reserved, or an error saying why not."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    group = placement_group(bundles, strategy=strategy)
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        nodes = sum(1 for node in ray.nodes() if node.get("Alive"))
        raise ConfigError(
            f"{what} needs {len(bundles)} bundle(s) of {bundles[0]} placed {strategy}; Ray "
            f"could not reserve them within {timeout_s:.0f} s (cluster.timeout_s;"
            f" {nodes} node(s) alive, resources {ray.cluster_resources()})") from None
    return group
