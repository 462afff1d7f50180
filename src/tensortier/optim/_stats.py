"""``OptimizerStats``: the counters ``OffloadedAdamW`` returns from ``opt.stats()``.

Every part of the optimizer counts into the same object (the coordinator hands it to each); this
module owns only the counters' names and meaning.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class OptimizerStats:
    """Counters a user can print to see where a step's time went and how speculation fares."""

    steps: int = 0  # steps applied
    skipped_steps: int = 0  # steps GradScaler skipped (found_inf): nothing advanced
    buckets: int = 0
    launched_in_backward: int = 0  # bucket updates started by gradient hooks (speculated)
    launched_in_step: int = 0  # bucket updates run by step() (not speculated, or redone)
    speculated: int = 0  # = launched_in_backward
    validated: int = 0  # speculations kept: gradients, parameter and scale unchanged
    compared_equal: int = 0  # ...of which the gradient was edited (version bumped) to equal bits
    redone: int = 0  # speculations dropped in step() and recomputed from the committed state
    unversioned_edits: int = 0  # ...of which the gradient changed without a version bump
    discarded: int = 0  # speculations dropped without an update (zero_grad, skipped step)
    hyper_changed: int = 0  # ...redone because lr/betas/eps/weight_decay changed before step()
    paused_bucket_steps: int = 0  # bucket-steps without speculation because it kept failing
    update_seconds: float = 0.0  # worker time: state load + kernel + save
    kernel_seconds: float = 0.0  # worker time in the AdamW kernel alone
    kernel_threads: int = 0  # ATen threads the last kernel ran with (torch.get_num_threads())
    grad_wait_seconds: float = 0.0  # worker time getting gradients to the host (CUDA: D2H wait)
    prepare_seconds: float = 0.0  # worker time copying committed states to spares after a step
    step_wait_seconds: float = 0.0  # time step() waited for outstanding updates
    spec_wait_seconds: float = 0.0  # ...of which waiting for speculative updates to finish
    check_copy_seconds: float = 0.0  # ...copying the current gradients to the host (CUDA check)
    compare_seconds: float = 0.0  # ...comparing them with the snapshots (bit for bit)
    compare_threads: int = 0  # threads the last comparison ran on
    digest_seconds: float = 0.0  # ...digesting the current gradients and comparing (validate)
    digest_checks: int = 0  # speculations validated by digest instead of a full comparison
    writeback_seconds: float = 0.0  # time step() spent copying parameters back
    host_state_bytes: int = 0  # host memory held for optimizer state (bound for disk states)
    host_grad_bytes: int = 0  # host buffers holding gradient snapshots

    def as_dict(self) -> dict:
        return asdict(self)


def record_memory(stats: OptimizerStats, states, staging) -> None:
    """Refresh the memory counters from the state store and the gradient staging buffers."""
    stats.host_state_bytes = states.host_bytes
    stats.host_grad_bytes = staging.host_bytes
