"""The test tiers (tests/conftest.py): every collected test is in exactly one of fast,
integration and hardware, no `slow` one in fast; and the rules catch what they should."""


def _loads_a_model(path):
    from eddyrl.models.tiny import build_tiny_model  # never run: only its code is read

    return build_tiny_model(path)


def _calls_a_helper_that_loads_a_model(path):
    return [_loads_a_model(p) for p in path]


def _pure(values):
    return sorted(values)


# Reached by key, not by name, so that this module's own tests do not use them.
SAMPLES = {"helper": _calls_a_helper_that_loads_a_model, "pure": _pure}


def test_every_collected_test_is_in_exactly_one_tier(tier_rules):
    assert tier_rules.records, "the tier hook in tests/conftest.py recorded no test"
    assert tier_rules.problems(tier_rules.records) == []


def test_this_check_is_itself_fast(tier_rules, request):
    mine = {nodeid: names for nodeid, names in tier_rules.records.items()
            if nodeid.startswith(request.node.nodeid.split("::")[0] + "::")}
    assert mine and all("fast" in names for names in mine.values()), mine


def test_the_check_catches_two_tiers_none_and_slow_in_fast(tier_rules):
    problems = tier_rules.problems({
        "t.py::two": {"fast", "integration"},
        "t.py::none": {"parametrize"},
        "t.py::slow_but_fast": {"slow", "fast"},
        "t.py::three": {"fast", "integration", "hardware"},
        "t.py::slow": {"slow", "integration"},
        "t.py::device": {"hardware"},
        "t.py::slow_device": {"hardware", "slow"},
        "t.py::logic": {"fast", "timeout"},
    })
    assert {problem.split(": ")[0] for problem in problems} == {
        "t.py::two", "t.py::none", "t.py::slow_but_fast", "t.py::three"}, problems


def test_a_model_built_in_a_helper_of_a_helper_makes_a_test_integration(tier_rules):
    helper, pure = SAMPLES["helper"], SAMPLES["pure"]
    why = tier_rules.code_signal(helper.__code__, helper.__globals__)
    assert why and "builds a model" in why and "build_tiny_model" in why
    assert tier_rules.code_signal(pure.__code__, pure.__globals__) is None
