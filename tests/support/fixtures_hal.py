"""Contract tests run once per known platform (plug-ins included) and skip where it is absent."""

import pytest

from eddyrl.hal import get_platform, known_platforms


def _platform_params():
    params = []
    for name in known_platforms():
        platform = get_platform(name, require_available=False)
        reason = platform.check_usable()
        marks = [pytest.mark.skip(reason=f"{name}: {reason}")] if reason else []
        params.append(pytest.param(name, marks=marks, id=name))
    return params


@pytest.fixture(params=_platform_params())
def platform(request):
    return get_platform(request.param)
