"""The learner: advantages over the archive Γ, training batches, the eq. 19 loss, the jitted update, the loop.

- ``advantages``: State-Anchored GRPO, the branch-advancement reflection reward, baselines (host numpy).
- ``batch``: archive + advantages → bucketed, padded token arrays (one sequence per segment).
- ``loss`` / ``update``: the clipped surrogate and the pure jitted ``update(params, opt_state, batch)``.
- ``checkpoint`` / ``trainer``: orbax checkpoints and the ``Trainer`` behind ``retrojax train``.
- ``sft``: supervised warm start on demonstrations (used by the demo).
"""
