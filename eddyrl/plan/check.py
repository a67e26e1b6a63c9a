"""`preflight.memory`: the memory plan at the start of `eddy train`, before the run directory,
Ray or any engine exists, so that a run that cannot fit is one message with the numbers and
the cheapest fixes, not an out-of-memory crash after minutes of start-up."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from ..errors import ConfigError

if TYPE_CHECKING:
    from ..config import EddyConfig
    from .memory_plan import MemoryPlan


def check_memory(config: EddyConfig) -> MemoryPlan | None:
    """`check`: refuse (ConfigError) a run predicted over its devices' memory; `warn`: warn and
    go on; `off`: nothing. On a host (the CPU platform) the plan is shown against the memory
    available now, which other programs change from moment to moment: a run over it is warned
    about, and refused only over the host's whole memory. A model whose shape is unknown here
    is not planned (the model-directory check then refuses the run, or the plan cannot be made:
    a warning says why). Returns the plan, or None when none was made."""
    from .memory_plan import plan_memory, shape_source
    from .report import format_plan

    mode = config.preflight.memory
    if mode == "off":
        return None
    try:
        shape_source(config)
    except ConfigError:
        return None  # no model here: `preflight` refuses the run by `model.path`
    try:
        plan = plan_memory(config)
    except Exception as exc:  # a prediction must not stop a run it cannot make: say why
        warnings.warn(f"preflight.memory: the memory plan could not be made "
                      f"({type(exc).__name__}: {exc}); the run starts unchecked", UserWarning,
                      stacklevel=2)
        return None
    if plan.fits:
        return plan
    over_ceiling = any(d.peak > d.memory.ceiling - d.reserve for d in plan.devices)
    told = (f"the run is predicted not to fit in memory (preflight.memory = {mode}; `eddy plan` "
            f"with the same arguments prints this plan):\n{format_plan(plan)}")
    if mode == "check" and over_ceiling:
        raise ConfigError(f"{told}\nnothing was started; apply the fixes, or set "
                          "preflight.memory=warn to start anyway")
    warnings.warn(told, UserWarning, stacklevel=2)
    return plan
