"""Libra's bucket router: routing on crafted tool-return paths (agreement, heavy tails, fallback
to the global tree, deepest match), window statistics and rebuild cadence, least connections,
the baselines, carry_kv vs recompute, milestone states (MLFQ), config validation, OmegaConf."""

import pytest
from omegaconf import OmegaConf

from eddyrl.errors import ConfigError
from eddyrl.scheduler.buckets import (BucketRouter, BucketSpec, Milestone, Move, Placement,
                                      PrefixTrees, RoutingConfig, RoutingError, ToolState,
                                      milestone_state, p90)

SEARCH = ToolState("search", "small", "success")
RUN = ToolState("run_tests", "large", "failure")
INSTANCES = {"short": [0, 1], "medium": [2, 4], "long": [3]}


def _config(**overrides) -> RoutingConfig:
    settings = {"buckets": [BucketSpec("short", 1000, 1), BucketSpec("medium", 4000, 2),
                            BucketSpec("long", 16000, 4)],
                "policy": "bucket", "window": 50, "rebuild_every": 1, "min_observations": 2,
                **overrides}
    return RoutingConfig(**settings)


def _router(policy: str = "bucket", **kwargs) -> BucketRouter:
    overrides = {key: kwargs.pop(key) for key in ("milestones", "min_observations")
                 if key in kwargs}
    return BucketRouter(_config(policy=policy, **overrides), INSTANCES, **kwargs)


def _teach(router: BucketRouter, prompt_id: str, path, remaining, times: int = 2) -> None:
    for _ in range(times):
        router.trees.observe(prompt_id, path, remaining)


# -- routing on tool-return paths --------------------------------------------------------------

def test_prompt_and_global_agree_moves_to_the_bucket_that_fits():
    router = _router()
    _teach(router, "p", [SEARCH], [3000, 2500])  # 500 + 2500 fits medium, not short
    assert router.start("r", "p") == Placement("short", 0)
    move = router.on_state("r", SEARCH, 500)
    assert move == Move("r", Placement("short", 0), Placement("medium", 2), "recompute")
    assert router.placement("r") == Placement("medium", 2)
    stats = router.stats()
    assert stats.moves == 1 and stats.connections == {"short": 0, "medium": 1, "long": 0}
    assert stats.predictions == {"prompt": 1, "global": 0, "none": 0}


def test_no_move_when_the_prediction_fits_the_current_bucket():
    router = _router()
    _teach(router, "p", [SEARCH], [600, 300])
    router.start("r", "p")
    assert router.on_state("r", SEARCH, 300) is None
    assert router.placement("r").bucket == "short"


def test_heavy_tail_mean_and_p90_disagree_stays():
    router = _router()
    for remaining in [200] * 8 + [10000] * 2:  # mean 2160 fits medium, P90 10000 needs long
        router.trees.observe("p", [SEARCH], [remaining + 100, remaining])
    router.start("r", "p")
    assert router.on_state("r", SEARCH, 100) is None
    assert router.placement("r").bucket == "short" and router.stats().moves == 0
    assert router.stats().predictions["prompt"] == 1  # predicted, but not trusted to move


def test_unseen_prefix_falls_back_to_the_global_tree():
    router = _router()
    _teach(router, "p", [SEARCH], [500, 400])  # the prompt's own tree knows only SEARCH
    _teach(router, "other", [RUN], [9000, 8000])  # RUN reached the global tree via another
    assert router.trees.predict("p", [RUN]).source == "global"
    router.start("r", "p")
    move = router.on_state("r", RUN, 1000)
    assert move.target == Placement("long", 3)
    assert router.stats().predictions == {"prompt": 0, "global": 1, "none": 0}


def test_with_nothing_learned_a_request_stays_in_the_smallest_bucket():
    router = _router()
    router.start("r", "p")
    assert router.on_state("r", SEARCH, 5000) is None  # even past short's max_tokens
    assert router.placement("r").bucket == "short"
    assert router.stats().predictions == {"prompt": 0, "global": 0, "none": 1}


def test_deepest_match_wins_over_a_shallower_one():
    router = _router()
    _teach(router, "p", [SEARCH], [900, 800])  # after SEARCH alone: short enough
    _teach(router, "other", [SEARCH, RUN], [9000, 8800, 8000])  # SEARCH then RUN: long
    router.start("r", "p")
    assert router.on_state("r", SEARCH, 100) is None  # prompt's [SEARCH] says short
    move = router.on_state("r", RUN, 300)  # global [SEARCH, RUN] is deeper than anything else
    assert move.target.bucket == "long"
    assert router.trees.predict("p", [SEARCH, RUN]).depth == 2


def test_at_equal_depth_the_prompt_tree_wins():
    trees = PrefixTrees(window=10, rebuild_every=1, min_observations=1)
    trees.observe("p", [SEARCH], [600, 500])
    for _ in range(5):
        trees.observe("q", [SEARCH], [9100, 9000])
    prediction = trees.predict("p", [SEARCH])
    assert (prediction.mean, prediction.p90, prediction.source) == (500, 500, "prompt")


def test_a_node_is_trusted_only_from_min_observations():
    router = _router(min_observations=3)
    _teach(router, "p", [SEARCH], [3000, 2500], times=2)
    assert router.trees.predict("p", [SEARCH]) is None
    _teach(router, "p", [SEARCH], [3000, 2500], times=1)
    assert router.trees.predict("p", [SEARCH]).mean == 2500


def test_requests_can_move_down_when_the_path_says_so():
    router = _router()
    _teach(router, "p", [SEARCH], [9000, 8000])
    _teach(router, "p", [SEARCH, RUN], [600, 500, 100])
    router.start("r", "p")
    assert router.on_state("r", SEARCH, 100).target.bucket == "long"
    assert router.on_state("r", RUN, 500).target.bucket == "short"


# -- prefix-tree statistics --------------------------------------------------------------------

def test_p90_is_nearest_rank_on_known_lists():
    assert p90(list(range(1, 11))) == 9
    assert p90(list(range(100, 0, -1))) == 90
    assert p90(list(range(1, 21))) == 18
    assert p90([7]) == 7


def test_the_sliding_window_drops_old_observations():
    trees = PrefixTrees(window=3, rebuild_every=1, min_observations=1)
    for total in (100, 200, 300, 400):
        trees.observe("p", [], [total])
    prediction = trees.predict("p", [])
    assert prediction.mean == 300 and prediction.p90 == 400  # 100 fell out of the window


def test_statistics_change_only_every_rebuild_every_requests():
    trees = PrefixTrees(window=10, rebuild_every=3, min_observations=1)
    trees.observe("p", [], [10])
    trees.observe("p", [], [20])
    assert trees.predict("p", []) is None  # nothing rebuilt yet
    trees.observe("p", [], [30])
    assert trees.predict("p", []).mean == 20
    trees.observe("p", [], [1000])
    trees.observe("p", [], [1000])
    assert trees.predict("p", []).mean == 20  # two new observations, no rebuild yet
    trees.rebuild()  # on demand
    assert trees.predict("p", []).mean == 412


def test_finish_records_the_remaining_length_after_every_prefix():
    router = _router()
    router.start("r", "p")
    router.on_state("r", SEARCH, 100)
    router.on_state("r", RUN, 400)
    router.finish("r", 1000)
    trees = router.trees
    trees.min_observations = 1
    assert [trees.predict("p", path).mean for path in ([], [SEARCH], [SEARCH, RUN])] == \
        [1000, 900, 600]
    assert router.stats().connections == {"short": 0, "medium": 0, "long": 0}


def test_observe_needs_one_remaining_length_per_prefix():
    trees = PrefixTrees(window=10, rebuild_every=1, min_observations=1)
    with pytest.raises(ValueError, match="one per prefix"):
        trees.observe("p", [SEARCH], [100])


# -- placement and the baselines ---------------------------------------------------------------

def test_least_connections_within_a_bucket():
    router = _router()
    assert [router.start(f"r{i}", "p").instance for i in range(3)] == [0, 1, 0]
    router.cancel("r1")
    assert router.start("r3", "p") == Placement("short", 1)


def test_a_move_goes_to_the_least_connected_instance_of_the_target():
    router = _router()
    _teach(router, "p", [SEARCH], [3000, 2500])
    for request_id in ("a", "b"):
        router.start(request_id, "p")
    assert router.on_state("a", SEARCH, 500).target == Placement("medium", 2)
    assert router.on_state("b", SEARCH, 500).target == Placement("medium", 4)


def test_round_robin_cycles_over_all_instances_and_never_moves():
    router = _router("round_robin")
    _teach(router, "p", [SEARCH], [9000, 8000])
    placements = [router.start(f"r{i}", "p") for i in range(6)]
    assert placements == [Placement("short", 0), Placement("short", 1), Placement("medium", 2),
                          Placement("medium", 4), Placement("long", 3), Placement("short", 0)]
    assert router.on_state("r0", SEARCH, 100) is None
    assert router.stats().predictions == {"prompt": 0, "global": 0, "none": 0}


def test_least_load_picks_the_fewest_connections_overall_and_never_moves():
    router = _router("least_load")
    _teach(router, "p", [SEARCH], [9000, 8000])
    assert [router.start(f"r{i}", "p").instance for i in range(5)] == [0, 1, 2, 4, 3]
    router.finish("r2", 10)
    assert router.start("r5", "p") == Placement("medium", 2)
    assert router.on_state("r0", SEARCH, 100) is None


def test_fifo_starts_in_the_smallest_bucket_and_never_moves():
    router = _router("fifo")
    _teach(router, "p", [SEARCH], [9000, 8000])
    assert [router.start(f"r{i}", "p") for i in range(3)] == [
        Placement("short", 0), Placement("short", 1), Placement("short", 0)]
    assert router.on_state("r0", SEARCH, 100) is None
    assert router.stats().moves == 0


# -- how a request moves -----------------------------------------------------------------------

def _moved_with(carry_kv_instances, carry_seconds, recompute_seconds=1.0, **kwargs):
    calls = []

    def carry(tokens, source, target):
        calls.append((tokens, source.name, target.name))
        return carry_seconds

    router = _router(recompute_seconds=lambda *_: recompute_seconds, carry_kv_seconds=carry,
                     carry_kv_instances=carry_kv_instances, **kwargs)
    _teach(router, "p", [SEARCH], [3000, 2500])
    router.start("r", "p")
    return router.on_state("r", SEARCH, 500), router, calls


def test_carry_kv_when_cheaper_and_both_engines_support_it():
    move, router, calls = _moved_with({0, 2}, carry_seconds=0.2)
    assert move.how == "carry_kv" and router.stats().carry_kv_moves == 1
    assert calls == [(500, "short", "medium")]


def test_recompute_when_carrying_the_kv_cache_costs_more():
    move, router, _ = _moved_with({0, 2}, carry_seconds=3.0)
    assert move.how == "recompute" and router.stats().carry_kv_moves == 0


def test_recompute_when_the_target_cannot_take_a_kv_cache():
    move, _, calls = _moved_with({0}, carry_seconds=0.0)
    assert move.how == "recompute" and calls == []


def test_recompute_without_cost_functions():
    router = _router(carry_kv_instances={0, 2})
    _teach(router, "p", [SEARCH], [3000, 2500])
    router.start("r", "p")
    assert router.on_state("r", SEARCH, 500).how == "recompute"


# -- single-turn milestones: a multi-level feedback queue --------------------------------------

def test_milestone_state_is_the_last_milestone_passed():
    milestones = [256, 1024, 4096]
    assert milestone_state(0, milestones) is None
    assert milestone_state(255, milestones) is None
    assert milestone_state(256, milestones) == Milestone(0)
    assert milestone_state(4095, milestones) == Milestone(1)
    assert milestone_state(10**6, milestones) == Milestone(2)


def test_single_turn_requests_climb_buckets_as_they_pass_milestones():
    router = _router(milestones=[500, 3500], min_observations=1)
    lengths = [300] * 5 + [3000] * 9 + [10000]  # mostly short; past 3500 only the long one
    for i, total in enumerate(lengths):
        router.start(f"t{i}", "p")
        for progress in range(100, total + 1, 100):  # a caller reporting every 100 tokens
            router.on_progress(f"t{i}", progress)
        router.finish(f"t{i}", total)
    router.start("r", "p")
    assert router.on_progress("r", 400) is None  # no milestone yet
    assert router.on_progress("r", 600).target.bucket == "medium"  # M0: mean 3200, P90 2500
    assert router.on_progress("r", 3000) is None
    assert router.on_progress("r", 3600).target.bucket == "long"  # past M1 only 10000 went


def test_on_progress_enters_skipped_milestones_at_their_own_token_counts():
    router = _router(milestones=[500, 1000])
    router.start("r", "p")
    router.on_progress("r", 2000)  # both milestones passed between two reports
    router.finish("r", 2500)
    router.trees.min_observations = 1
    assert router.trees.predict("p", [Milestone(0)]).mean == 2000
    assert router.trees.predict("p", [Milestone(0), Milestone(1)]).mean == 1500


# -- states, protocol and config -----------------------------------------------------------------

def test_tool_state_payload_size_classes():
    sizes = [ToolState.from_return("grep", n, "success", [1024, 16384]).size
             for n in (0, 1023, 1024, 16383, 16384)]
    assert sizes == ["small", "small", "medium", "medium", "large"]
    with pytest.raises(ValueError, match="'crashed'"):
        ToolState("grep", "small", "crashed")
    with pytest.raises(ValueError, match="-1"):
        ToolState.from_return("grep", -1, "success", [1024, 16384])


def test_protocol_errors_name_the_request():
    router = _router()
    router.start("r", "p")
    with pytest.raises(RoutingError, match="'r' is already started"):
        router.start("r", "p")
    with pytest.raises(RoutingError, match="'ghost'"):
        router.on_state("ghost", SEARCH, 1)
    router.on_state("r", SEARCH, 100)
    with pytest.raises(RoutingError, match="tokens_so_far = 50"):
        router.on_state("r", RUN, 50)
    with pytest.raises(RoutingError, match="fewer than the 100"):
        router.finish("r", 99)


@pytest.mark.parametrize("overrides,key", [
    ({"policy": "bukcet"}, "did you mean 'bucket'"),
    ({"window": 0}, "routing.window"),
    ({"rebuild_every": 0}, "routing.rebuild_every"),
    ({"min_observations": 0}, "routing.min_observations"),
    ({"window": 4, "min_observations": 5}, "routing.min_observations = 5"),
    ({"buckets": []}, "routing.buckets"),
    ({"buckets": [BucketSpec("a", 10), BucketSpec("b", 0)]}, "routing.buckets[1].max_tokens"),
    ({"buckets": [BucketSpec("a", 10, -1)]}, "routing.buckets[0].parallelism"),
    ({"buckets": [BucketSpec("a", 10, workers=0)]}, "routing.buckets[0].workers"),
    ({"buckets": [BucketSpec("a", 10, max_batch_size=0)]}, "routing.buckets[0].max_batch_size"),
    ({"buckets": [BucketSpec("", 10)]}, "routing.buckets[0].name"),
    ({"buckets": [BucketSpec("a", 20), BucketSpec("b", 10)]}, "must rise strictly"),
    ({"buckets": [BucketSpec("a", 10), BucketSpec("a", 20)]}, "repeats the name(s) ['a']"),
    ({"milestones": [1024, 256]}, "routing.milestones"),
    ({"milestones": [0]}, "routing.milestones[0]"),
    ({"payload_bytes": [1024]}, "routing.payload_bytes"),
])
def test_config_validation_names_the_key(overrides, key):
    with pytest.raises(ConfigError) as error:
        RoutingConfig(**overrides).validate("routing")
    assert key in str(error.value)


@pytest.mark.parametrize("instances,message", [
    ({"short": [0], "medium": [1], "long": [2], "huge": [3]}, "unknown bucket(s) ['huge']"),
    ({"short": [0], "medium": [], "long": [2]}, "['medium'] have no instance"),
    ({"short": [0], "medium": [0], "long": [2]}, "instance(s) [0] appear more than once"),
])
def test_instances_must_cover_the_buckets_once(instances, message):
    with pytest.raises(ConfigError) as error:
        BucketRouter(_config(), instances)
    assert message in str(error.value)


def test_defaults_are_valid_and_follow_libra():
    config = RoutingConfig()
    config.validate("routing")
    assert [(b.name, b.max_tokens, b.parallelism) for b in config.buckets] == [
        ("short", 3000, 0), ("medium", 6000, 0), ("long", 32768, 0)]


def test_omegaconf_structured_config_round_trips():
    schema = OmegaConf.structured(RoutingConfig)
    assert OmegaConf.to_object(schema) == RoutingConfig()
    override = OmegaConf.create(
        "policy: least_load\n"
        "milestones: [128, 512]\n"
        "buckets:\n"
        "  - {name: s, max_tokens: 2048}\n"
        "  - {name: l, max_tokens: 8192, parallelism: 4}\n")
    config = OmegaConf.to_object(OmegaConf.merge(schema, override))
    assert config.buckets == [BucketSpec("s", 2048, 0), BucketSpec("l", 8192, 4)]
    assert config.policy == "least_load" and config.milestones == [128, 512]
    config.validate("routing")
    yaml_again = OmegaConf.to_yaml(OmegaConf.structured(config))
    assert OmegaConf.to_object(OmegaConf.merge(schema, OmegaConf.create(yaml_again))) == config


# -- in a run: the assignment's allowed workers, moves made by others ------------------------

def test_start_and_moves_stay_within_the_allowed_instances():
    router = _router()
    _teach(router, "p", [SEARCH], [3000, 2500])
    # short instance 0 is not allowed (say, lent to training): the other short one takes it
    assert router.start("a", "p", allowed={1, 2, 3, 4}) == Placement("short", 1)
    # no short instance allowed: the smallest bucket that has one
    assert router.start("b", "p", allowed={3, 4}) == Placement("medium", 4)
    # the move to medium may only go to instance 4, although 2 has fewer connections
    assert router.on_state("a", SEARCH, 500, allowed={1, 4}).target == Placement("medium", 4)


def test_a_move_with_no_allowed_target_is_not_made_and_counted_as_blocked():
    router = _router()
    _teach(router, "p", [SEARCH], [3000, 2500])
    router.start("a", "p")
    assert router.on_state("a", SEARCH, 500, allowed={0, 1, 3}) is None  # no medium instance
    assert router.placement("a") == Placement("short", 0)
    assert router.stats().blocked == 1 and router.stats().moves == 0


def test_baselines_honour_allowed_instances_too():
    round_robin = _router("round_robin")
    assert [round_robin.start(f"r{i}", "p", allowed={1, 3}).instance for i in range(3)] == \
        [1, 3, 1]
    least_load = _router("least_load")
    # ties go to the order instances are configured in: medium's 4 before long's 3
    assert least_load.start("r", "p", allowed={3, 4}).instance == 4


def test_allowed_must_name_known_instances():
    router = _router()
    for allowed in (set(), {7}):
        with pytest.raises(RoutingError, match="non-empty subset"):
            router.start("a", "p", allowed=allowed)


def test_relocate_follows_a_move_made_by_someone_else():
    router = _router()
    router.start("a", "p")
    router.relocate("a", 3)
    assert router.placement("a") == Placement("long", 3)
    assert router.stats().connections == {"short": 0, "medium": 0, "long": 1}
    router.finish("a", 10)
    assert router.stats().connections == {"short": 0, "medium": 0, "long": 0}
    with pytest.raises(RoutingError, match="is not running"):
        router.relocate("a", 0)


def test_workers_are_assigned_to_buckets_in_config_order():
    from eddyrl.scheduler.buckets import bucket_instances, bucket_of_worker

    config = RoutingConfig(policy="bucket", buckets=[
        BucketSpec("short", 100, workers=2, max_batch_size=64),
        BucketSpec("long", 1000, workers=1, max_batch_size=8)])
    assert bucket_instances(config) == {"short": [0, 1], "long": [2]}
    assert bucket_of_worker(config, 2).max_batch_size == 8
    with pytest.raises(ValueError, match="worker 3 is in no bucket"):
        bucket_of_worker(config, 3)


def test_a_router_needs_a_policy():
    with pytest.raises(ConfigError, match="no router"):
        BucketRouter(RoutingConfig(), INSTANCES)


def test_set_layout_reassigns_instances_and_relabels_running_requests():
    router = BucketRouter(_config(buckets=[BucketSpec("short", 100), BucketSpec("long", 1000)]),
                          {"short": [0, 1, 2], "long": [3]})
    assert router.layout == (3, 1)
    router.start("a", "p")  # instance 0
    router.start("b", "p")  # instance 1
    router.set_layout((1, 3))
    assert router.instances == {"short": [0], "long": [1, 2, 3]}
    assert router.placement("b") == Placement("long", 1)  # still on instance 1, now long
    assert router.stats().connections == {"short": 1, "long": 1}
    assert router.start("c", "p") == Placement("short", 0)  # the smallest bucket: instance 0
    for bad in ((4, 0), (2, 1), (1, 1, 2)):
        with pytest.raises(RoutingError, match="at least one"):
            router.set_layout(bad)
