"""The planner: profile one iteration, simulate plans, choose keep / swap / compress / recompute.

``profile`` measures, ``simulator`` predicts, ``policies`` choose, ``report`` draws, ``runtime``
turns a plan into the activation offloader's ``decide`` callable and checkpointed modules (with
``config`` its settings, ``buckets`` the input shape buckets, ``cache`` the plan cache and
``ranks`` the agreement of many ranks on one plan).
"""

from tensortier.planner.policies import POLICIES, Choice, Options, choose, plan_all
from tensortier.planner.profile import Bandwidth, Profile, TensorProfile, UnitProfile
from tensortier.planner.simulator import Mode, Plan, SimResult, UnitAction, simulate

__all__ = [
    "POLICIES",
    "Bandwidth",
    "Choice",
    "Mode",
    "Options",
    "Plan",
    "Profile",
    "SimResult",
    "TensorProfile",
    "UnitAction",
    "UnitProfile",
    "choose",
    "plan_all",
    "simulate",
]
