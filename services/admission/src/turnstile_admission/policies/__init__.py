"""The admission policies, one module each (SPEC P1–P5).

Every policy has its own settings, a mode (off / shadow / enforce) and a fail
mode (open / closed) for when Redis cannot be reached. The checks and the
consumption of all policies run together in ``admit.lua``; a policy module says
when it applies, what it passes to the script, and how the script's raw answer
becomes a verdict.
"""

from turnstile_admission.policies.base import (
    ActivationShape,
    FailMode,
    Kind,
    Mode,
    Policy,
    PolicyName,
    PolicySettings,
    PolicyVerdict,
    RawResult,
    ShadowVerdict,
    Verdict,
)
from turnstile_admission.policies.cap import CapPolicy, CapSettings
from turnstile_admission.policies.concurrency import ConcurrencyPolicy, ConcurrencySettings
from turnstile_admission.policies.rate import RatePolicy, RateSettings
from turnstile_admission.policies.slots import SlotsPolicy, SlotsSettings

__all__ = [
    "ActivationShape",
    "CapPolicy",
    "CapSettings",
    "ConcurrencyPolicy",
    "ConcurrencySettings",
    "FailMode",
    "Kind",
    "Mode",
    "Policy",
    "PolicyName",
    "PolicySettings",
    "PolicyVerdict",
    "RatePolicy",
    "RateSettings",
    "RawResult",
    "ShadowVerdict",
    "SlotsPolicy",
    "SlotsSettings",
    "Verdict",
]
