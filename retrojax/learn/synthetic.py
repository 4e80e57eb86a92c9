"""Synthetic archives with the shape of real ones (growing conversations, rewinds, reflections).

Used by the update bench and by tests of the batch/update/checkpoint layers (no trial loop needed).
Token ids are random in ``[0, vocab)``; rewards, scores and branch values are random small integers.
"""

from __future__ import annotations

import numpy as np

from retrojax.agent.archive import (
    EXECUTION,
    REFLECTION,
    Archive,
    CallRecord,
    RecoveryRecord,
    SegmentRecord,
    TrialRecord,
)


def synthetic_archive(rng: np.random.Generator, *, tasks: int = 2, trials: int = 4, vocab: int = 1000,
                      segments: int = 2, decisions: int = 3, prompt_len: int = 24, turn_len: int = 6,
                      output_len: int = 8, n_states: int = 3) -> Archive:
    """Trials of ``segments`` segments of ``decisions`` execution calls each, separated by recoveries."""
    arch = Archive()

    def ids(n: int) -> np.ndarray:
        return rng.integers(0, vocab, size=n, dtype=np.int32)

    trial_id = 0
    for task in range(tasks):
        system = ids(prompt_len)
        for _ in range(trials):
            ci = 0
            score = 0.0
            start_ck = 0
            base = system.copy()
            for m in range(segments):
                convo = base.copy()
                seg_calls = []
                for t in range(decisions):
                    prompt = np.concatenate([convo, ids(turn_len)])
                    n_out = int(rng.integers(1, output_len + 1))
                    out = ids(n_out)
                    reward = float(rng.integers(-1, 2))
                    score += reward
                    arch.calls.append(CallRecord(
                        trial=trial_id, task=task, call_index=ci, role=EXECUTION, segment=m, position=t,
                        checkpoint=start_ck + t, state_key=f"s{rng.integers(n_states)}",
                        history_key=f"h{rng.integers(2)}", prompt_ids=prompt, output_ids=out,
                        logprobs=(-rng.random(n_out) * 3.0).astype(np.float32), reward=reward))
                    seg_calls.append(ci)
                    ci += 1
                    convo = np.concatenate([prompt, out])
                last = m == segments - 1
                arch.segments.append(SegmentRecord(
                    trial=trial_id, task=task, index=m, start_checkpoint=start_ck, calls=seg_calls,
                    end_reason="calls" if last else "rewind", end_checkpoint=start_ck + decisions,
                    score=score))
                if not last:
                    n_out = int(rng.integers(0, output_len + 1))
                    arch.calls.append(CallRecord(
                        trial=trial_id, task=task, call_index=ci, role=REFLECTION, segment=m, position=-1,
                        checkpoint=start_ck + decisions, state_key="r", history_key="r",
                        prompt_ids=np.concatenate([system, ids(turn_len * 2)]), output_ids=ids(n_out),
                        logprobs=(-rng.random(n_out) * 3.0).astype(np.float32)))
                    arch.recoveries.append(RecoveryRecord(
                        trial=trial_id, task=task, index=m, trigger="model",
                        from_checkpoint=start_ck + decisions,
                        target=start_ck, reflection_call=ci, remark="r" if n_out else "",
                        abandoned_calls=seg_calls, resumed_segment=m + 1,
                        v_abandoned=float(rng.integers(-2, 3)), v_resumed=float(rng.integers(-2, 3))))
                    ci += 1
                    base = np.concatenate([base, ids(turn_len)])  # the remark appended at C_j
            arch.trials.append(TrialRecord(trial=trial_id, task=task, seed=0, protocol="T@3",
                                           final_score=score))
            trial_id += 1
    return arch
