"""Synthetic archives with the shape of real ones (growing conversations, rewinds, reflections).

Used by the update bench and by tests of the batch/update/checkpoint layers (no trial loop needed).
Token ids are random in ``[0, vocab)``; rewards, scores and branch values are random small integers.

A trial keeps an active path of checkpoints ``C_0..C_k`` as the trial loop does (``retrojax.agent.trial``):
each checkpoint saves the conversation just after the turn that reached it, its state key and its path
score. A recovery restores ``C_j`` as ReTRAIL's App. D.3 describes for the games (the trial loop's
``memory_turn`` context): the conversation saved at ``C_j`` is restored, the abandoned continuation is
dropped, and the branch memory (the reflection's remark) is appended as a user turn; a newer remark at the
same ``C_j`` replaces the older one. The resumed branch therefore shares the abandoned branch's whole
context up to ``C_j`` (not only the prompt), and its first decision is taken at the abandoned decision's
state with the same retained history (a state-anchored group, App. D.5.1). The reflection is its own
conversation c_ref (the trial loop's): a task-wide head (the rules and rollback semantics, the same for
every reflection of the task) and the recovery's own tokens; it shares no prefix with the execution
context.
"""

from __future__ import annotations

import dataclasses

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

REWIND_TARGETS = ("path", "start")


@dataclasses.dataclass
class _Checkpoint:
    convo: np.ndarray  # the conversation saved at this checkpoint (no later memory turn)
    state_key: str
    history_key: str
    score: float


def synthetic_archive(rng: np.random.Generator, *, tasks: int = 2, trials: int = 4, vocab: int = 1000,
                      segments: int = 2, decisions: int = 3, prompt_len: int = 24, turn_len: int = 6,
                      output_len: int = 8, n_states: int = 3, rewind: str = "path") -> Archive:
    """Trials of ``segments`` segments of ``decisions`` execution calls each, separated by recoveries.

    A segment that does not end the trial ends in a recovery: a model rewind (its last decision is the
    ``rewind to C_j`` request, no move) or, for a one-decision segment or by a coin flip, a forced recovery
    after a failed move. ``rewind`` picks the restored checkpoint: ``path`` draws ``j`` uniformly from every
    checkpoint the trial loop would grant (``0 ≤ j < k`` on the active path); ``start`` restores the
    segment's starting checkpoint. Either way the resumed context is built as App. D.3 says (module doc).
    """
    if rewind not in REWIND_TARGETS:
        raise ValueError(f"rewind must be one of {REWIND_TARGETS}, got {rewind!r}")
    if decisions < 1 or segments < 1:
        raise ValueError(f"segments and decisions must be ≥ 1, got {segments} and {decisions}")
    arch = Archive()

    def ids(n: int) -> np.ndarray:
        return rng.integers(0, vocab, size=n, dtype=np.int32)

    def logprobs(n: int) -> np.ndarray:
        return (-rng.random(n) * 3.0).astype(np.float32)

    def checkpoint(convo: np.ndarray, score: float) -> _Checkpoint:
        return _Checkpoint(convo, f"s{rng.integers(n_states)}", f"h{rng.integers(2)}", score)

    trial_id = 0
    for task in range(tasks):
        system = ids(prompt_len)
        reflection_head = ids(prompt_len)  # c_ref's rules and rollback semantics: the same for the task
        for _ in range(trials):
            ci = 0
            path = [checkpoint(system, 0.0)]
            path_calls: list[tuple[int, int]] = []  # (checkpoint at the decision, call_index), retained
            convo = system
            for m in range(segments):
                start_ck = len(path) - 1
                last = m == segments - 1
                model_rewind = not last and decisions > 1 and bool(rng.integers(2))
                seg_calls = []
                for t in range(decisions):
                    k = len(path) - 1
                    here = path[k]
                    prompt = np.concatenate([convo, ids(turn_len)])
                    request = model_rewind and t == decisions - 1
                    out = ids(int(rng.integers(1, output_len + 1)))
                    reward = 0.0 if request else float(rng.integers(-1, 2))  # a rewind request moves nothing
                    call = CallRecord(
                        trial=trial_id, task=task, call_index=ci, role=EXECUTION, segment=m, position=t,
                        checkpoint=k, state_key=here.state_key, history_key=here.history_key,
                        prompt_ids=prompt, output_ids=out, logprobs=logprobs(out.size), reward=reward)
                    arch.calls.append(call)
                    seg_calls.append(ci)
                    path_calls.append((k, ci))
                    convo = np.concatenate([prompt, out])
                    if request:
                        call.is_rewind = True
                    else:
                        path.append(checkpoint(convo, here.score + reward))
                    ci += 1
                k = len(path) - 1
                end = "calls" if last else ("rewind" if model_rewind else "failure")
                arch.segments.append(SegmentRecord(
                    trial=trial_id, task=task, index=m, start_checkpoint=start_ck, calls=seg_calls,
                    end_reason=end, end_checkpoint=k, score=path[k].score))
                if last:
                    break
                j = int(rng.integers(0, k)) if rewind == "path" else min(start_ck, k - 1)
                if model_rewind:
                    arch.calls[-1].rewind_target = j
                    arch.calls[-1].action = f"rewind to C_{j}"
                n_out = int(rng.integers(0, output_len + 1))
                arch.calls.append(CallRecord(
                    trial=trial_id, task=task, call_index=ci, role=REFLECTION, segment=m, position=-1,
                    checkpoint=k, state_key="r", history_key="r",
                    prompt_ids=np.concatenate([reflection_head, ids(turn_len * 2)]), output_ids=ids(n_out),
                    logprobs=logprobs(n_out)))
                arch.recoveries.append(RecoveryRecord(
                    trial=trial_id, task=task, index=m, trigger="model" if model_rewind else "failure",
                    from_checkpoint=k, target=j, reflection_call=ci, remark="r" if n_out else "",
                    abandoned_calls=[c for (kd, c) in path_calls if kd >= j], resumed_segment=m + 1,
                    v_abandoned=float(rng.integers(-2, 3)), v_resumed=float(rng.integers(-2, 3))))
                ci += 1
                # D.3: restore the conversation saved at C_j, then the memory turn (replacing an older one)
                del path[j + 1:]
                path_calls = [(kd, c) for (kd, c) in path_calls if kd < j]
                convo = np.concatenate([path[j].convo, ids(turn_len)]) if n_out else path[j].convo
            arch.trials.append(TrialRecord(trial=trial_id, task=task, seed=0, protocol="T@3",
                                           final_score=path[-1].score))
            trial_id += 1
    return arch
