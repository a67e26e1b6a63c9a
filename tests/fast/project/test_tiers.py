"""The test tiers (tests/conftest.py): a test's tier is its folder; every collected test is in
exactly one of fast, integration and hardware; and the check catches a fast test that is not."""


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
    mine = {nodeid: names for nodeid, (names, _) in tier_rules.records.items()
            if nodeid.startswith(request.node.nodeid.split("::")[0] + "::")}
    assert mine and all("fast" in names for names in mine.values()), mine


def test_the_folder_decides_the_tier(tier_rules):
    tier = tier_rules.folder_tier
    tests = tier_rules.tests_dir
    assert tier(tests / "fast" / "core" / "test_x.py") == "fast"
    assert tier(tests / "integration" / "core" / "test_x.py") == "integration"
    assert tier(tests / "faults" / "test_x.py") == "integration"
    assert tier(tests / "multinode" / "test_x.py") == "integration"
    assert tier(tests / "hardware" / "test_x.py") == "hardware"
    assert tier(tests / "test_x.py") is None
    assert tier(tests / "core" / "test_x.py") is None


def test_the_check_catches_two_tiers_none_slow_and_heavy_fast_tests(tier_rules):
    problems = tier_rules.problems({
        "t.py::two": ({"fast", "integration"}, None),
        "t.py::none": ({"parametrize"}, None),
        "t.py::slow_but_fast": ({"slow", "fast"}, None),
        "t.py::heavy_but_fast": ({"fast"}, "builds a model (build_tiny_model in f)"),
        "t.py::three": ({"fast", "integration", "hardware"}, None),
        "t.py::slow": ({"slow", "integration"}, None),
        "t.py::device": ({"hardware"}, None),
        "t.py::slow_device": ({"hardware", "slow"}, None),
        "t.py::logic": ({"fast", "timeout"}, None),
    })
    assert {problem.split(": ")[0] for problem in problems} == {
        "t.py::two", "t.py::none", "t.py::slow_but_fast", "t.py::heavy_but_fast",
        "t.py::three"}, problems


def test_a_model_built_in_a_helper_of_a_helper_is_caught(tier_rules):
    helper, pure = SAMPLES["helper"], SAMPLES["pure"]
    why = tier_rules.code_signal(helper.__code__, helper.__globals__)
    assert why and "builds a model" in why and "build_tiny_model" in why
    assert tier_rules.code_signal(pure.__code__, pure.__globals__) is None
