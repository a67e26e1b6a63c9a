"""The off-policy correction presets (`algorithm.correction`): which importance ratio each one
judges, what it does to a ratio outside its bounds, and its default bounds. Plain data, no
tensors: the config checks read it without loading torch; core/losses.py applies it.

Per trained token t, rho_t = exp(prox_t - behav_t) (the trainer's policy over the sampler's,
see losses.py); per row, over its trained tokens, the sequence ratio S = prod_t rho_t and the
geometric mean G = exp(mean_t log rho_t). The weight w multiplies each token's PPO objective:

    none        w_t = 1 (coupled), or rho_t when the batch carries proximal log-probs
    token_tis   w_t = min(rho_t, high)                         (`tis_cap`: the same, bit for bit)
    seq_tis     w_t = min(S, high) on every token of the row
    token_mask  w_t = rho_t if low <= rho_t <= high else 0
    seq_mask    w_t = S     if low <= S <= high     else 0 (the whole row)
    icepop      w_t = rho_t if low <= rho_t <= high else 0
    geo_mask    w_t = 1     if low <= G <= high     else 0 (the whole row)

Sources. verl's rollout correction
(https://github.com/verl-project/verl/blob/main/docs/algo/rollout_corr.md, and its presets in
`RolloutCorrectionConfig`, verl/trainer/config/algorithm.py there): token_tis is
`decoupled_token_is` (Token-TIS, threshold 2.0), seq_tis `decoupled_seq_is` (Seq-TIS, 2.0),
seq_mask `decoupled_seq_is_rs` (Seq-MIS: sequence IS plus `seq_sum_k1` rejection, "0.5_2.0"),
token_mask token IS plus `token_k1` rejection (2.0, the lower bound its reciprocal 0.5),
geo_mask `decoupled_geo_rs` (Geo-RS: `seq_mean_k1` rejection, no IS weight, "0.999_1.001").
icepop is IcePop (Ling Team, "Every Step Evolves: Scaling Reinforcement Learning for
Trillion-Scale Thinking Model", Ring-1T, Oct 2025): M(k) = k for k in [alpha, beta], else 0, on
the token ratio; verl's `rollout_is_threshold: "0.5_5.0"` gives the bounds.

Simplified: verl's rejection (the `*_mask` presets) also takes rejected tokens out of the
loss's token count; here every trained token counts in the step's normalisation (fixed before
the forward, across micro-batches and ranks), so token_mask and icepop differ only in their
default bounds, as IcePop itself normalises over all tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from ..validation import check_choice, check_range, contradiction

CorrectionName = Literal["none", "token_tis", "seq_tis", "token_mask", "seq_mask", "icepop",
                         "geo_mask"]
CORRECTIONS = get_args(CorrectionName)


@dataclass(frozen=True, slots=True)
class Preset:
    level: Literal["token", "sequence", "geometric"] | None  # the ratio judged; None: none
    masks: bool  # outside [low, high]: weight 0 (else: truncated at high)
    weighted: bool  # a kept token's weight is the judged ratio (else 1)
    low: float | None  # default lower bound; None: the preset has none
    high: float | None  # default upper bound


PRESETS: dict[str, Preset] = {
    "none": Preset(None, masks=False, weighted=True, low=None, high=None),
    "token_tis": Preset("token", masks=False, weighted=True, low=None, high=2.0),
    "seq_tis": Preset("sequence", masks=False, weighted=True, low=None, high=2.0),
    "token_mask": Preset("token", masks=True, weighted=True, low=0.5, high=2.0),
    "seq_mask": Preset("sequence", masks=True, weighted=True, low=0.5, high=2.0),
    "icepop": Preset("token", masks=True, weighted=True, low=0.5, high=5.0),
    "geo_mask": Preset("geometric", masks=True, weighted=False, low=0.999, high=1.001),
}


@dataclass(frozen=True, slots=True)
class Correction:
    """A preset with its bounds resolved (defaults filled in); pickles with the loss."""

    name: str = "none"
    low: float | None = None
    high: float | None = None

    @property
    def preset(self) -> Preset:
        return PRESETS[self.name]


def resolve_correction(name: str = "none", low: float | None = None, high: float | None = None,
                       tis_cap: float | None = None, *, prefix: str = "algorithm") -> Correction:
    """The correction the settings ask for, checked; errors name the dotted keys under
    `prefix`. `tis_cap: X` alone is `token_tis` with high X."""
    keys = {k: f"{prefix}.{k}" for k in ("correction", "correction_low", "correction_high",
                                         "tis_cap")}
    check_choice(keys["correction"], name, CORRECTIONS)
    if tis_cap is not None:
        check_range(keys["tis_cap"], tis_cap, 0, lo_open=True)
        if name not in ("none", "token_tis"):
            raise contradiction(f"{keys['tis_cap']} ({tis_cap}) is token_tis's bound, but "
                                f"{keys['correction']} = {name!r}; set {keys['tis_cap']}=null "
                                f"(the off-policy modes set it) and bound {name!r} with "
                                f"{keys['correction_low']} / {keys['correction_high']}")
        if high is not None and high != tis_cap:
            raise contradiction(f"{keys['tis_cap']} ({tis_cap}) and {keys['correction_high']} "
                                f"({high}) both bound token_tis; set one of them")
        name, high = "token_tis", tis_cap
    preset = PRESETS[name]
    for key, value, default in (("correction_low", low, preset.low),
                                ("correction_high", high, preset.high)):
        if value is None:
            continue
        if default is None:
            raise contradiction(f"{keys[key]} = {value} is not used by {keys['correction']} = "
                                f"{name!r}" + ("" if name == "none" else
                                               "; it truncates from above only"))
        check_range(keys[key], value, 0, lo_open=key == "correction_high")
    low = preset.low if low is None else low
    high = preset.high if high is None else high
    if low is not None and high is not None and low >= high:
        raise contradiction(f"{keys['correction_low']} ({low}) >= {keys['correction_high']} "
                            f"({high}) for {name!r}: the kept ratios are [low, high]")
    return Correction(name, low, high)

