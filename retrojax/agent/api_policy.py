"""A policy behind any OpenAI-compatible chat endpoint (vLLM, SGLang, a hosted API, ``retrojax serve``).

``--policy api:MODEL`` answers the trial loop's requests through the official ``openai`` SDK. Each request
sends exactly ``Request.messages`` — the chat context the model would see (after ``rewind to C_j``: the C_j
prefix plus the new memory; for a reflection: its own context; for RIR auxiliary calls: their single-turn
prompts) — so a served model and the Flax policy see the same conversations.

Per call kind (the request's ``role``: ``execution``, ``reflection``, RIR's ``review``/``coarse``/``fine``/
``patch``, anything else) the ``api:`` config section gives temperature, top_p, max tokens and stop strings,
with section-wide defaults. The requests of one tick run concurrently (at most ``api.concurrency`` at once).
Rate limits (429), server errors (5xx), timeouts, dropped connections and malformed replies are retried with
exponential backoff (``Retry-After`` honoured, capped) up to ``api.retries`` times, and counted. A request
that still fails returns an empty reply — the trial counts it as an invalid turn — and its reason is kept
(:attr:`ApiPolicy.failures`, and as ``Generation.error`` → the call's ``invalid_reason``); the
batch always completes. A prompt the server says is too long ends that trial (``finish_reason='context'``).
Token usage the server reports rides on each ``Generation.usage`` into the archive's call and trial records
(``prompt_tokens``/``completion_tokens``) and is also summed per protocol (:meth:`ApiPolicy.report`).

OpenAI-style servers return the text *before* a stop string; the policy puts back the stop string the
server names (``stop_reason``, as vLLM and ``retrojax serve`` report it) or, without one, the closing tag a
reply left open (``<action>up`` + ``</action>``), so the trial parses the reply it would get from the
local sampler.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import time
from collections.abc import Sequence
from typing import Any

from retrojax.agent.chat import wrap_tokenizer
from retrojax.agent.policies import Policy
from retrojax.agent.trial import Generation, Request, TrialSpec

_RETRYABLE_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})
# RIR's auxiliary calls (review, range selection, restore point, patch) and the baselines' (critique,
# reflection, value, stepwise check) are not action turns: no stop strings unless their own section sets some
_NO_STOP_KINDS = frozenset({"review", "coarse", "fine", "patch", "critique", "reflect", "value", "assist"})


class ApiCallFailed(Exception):
    """A request that cannot succeed as sent (no retry helps) or that failed every attempt."""

    def __init__(self, reason: str, *, retryable: bool, context: bool = False,
                 retry_after: float | None = None):
        super().__init__(reason)
        self.reason, self.retryable, self.context, self.retry_after = reason, retryable, context, retry_after


@dataclasses.dataclass(frozen=True)
class CallSettings:
    """Sampling settings of one kind of call (``max_tokens`` None: the request's own limit)."""

    temperature: float
    top_p: float
    max_tokens: int | None
    stop: tuple[str, ...]


@dataclasses.dataclass
class Usage:
    """Tokens and calls of one trial (or of a whole run)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    requests: int = 0
    retries: int = 0
    failed: int = 0

    def add(self, other: Usage) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


def settings_from_config(api: Any) -> tuple[CallSettings, dict[str, CallSettings]]:
    """The default settings and the per-kind ones (``api.<kind>.*`` fields left None take the default; the
    auxiliary kinds, RIR's and the baselines', default to no stop strings)."""
    default = CallSettings(api.temperature, api.top_p, api.max_tokens, tuple(api.stop))
    kinds = {}
    for f in dataclasses.fields(api):
        section = getattr(api, f.name)
        if dataclasses.is_dataclass(section):
            kinds[f.name] = CallSettings(
                default.temperature if section.temperature is None else section.temperature,
                default.top_p if section.top_p is None else section.top_p,
                default.max_tokens if section.max_tokens is None else section.max_tokens,
                (() if f.name in _NO_STOP_KINDS else default.stop) if section.stop is None
                else tuple(section.stop))
    return default, kinds


def restore_stop(text: str, stops: Sequence[str], stop_reason: Any) -> str:
    """The reply with the stop string the server cut off put back (see the module docstring)."""
    if isinstance(stop_reason, str) and stop_reason in stops:
        return text + stop_reason
    for s in stops:
        if s.startswith("</") and s.endswith(">"):
            opening = "<" + s[2:]
            if text.lower().rfind(opening.lower()) > text.lower().rfind(s.lower()):
                return text + s
    return text


class ApiPolicy(Policy):
    """See the module docstring. ``client``: an ``openai.OpenAI`` (built from the settings when None)."""

    needs_text = True

    def __init__(self, model: str, *, base_url: str, api_key: str, default: CallSettings,
                 kinds: dict[str, CallSettings] | None = None, concurrency: int = 8, timeout_s: float = 60.0,
                 retries: int = 3, backoff_s: float = 0.5, backoff_max_s: float = 8.0, client: Any = None,
                 enable_thinking: bool | None = None, tokenizer: Any = None):
        if concurrency < 1 or retries < 0 or timeout_s <= 0 or backoff_s < 0 or backoff_max_s < 0:
            raise ValueError("api: needs concurrency >= 1, retries >= 0, timeout_s > 0 and backoffs >= 0")
        if not model:
            raise ValueError("api: no model name; use --policy api:MODEL or set api.model")
        if client is None:
            try:
                import openai
            except ImportError as e:
                raise ValueError("--policy api:MODEL needs the openai package: pip install -e '.[api]'"
                                 ) from e
            client = openai.OpenAI(base_url=base_url, api_key=api_key, timeout=timeout_s, max_retries=0)
        self.client, self.model, self.base_url = client, model, base_url
        self.default, self.kinds = default, dict(kinds or {})
        self.concurrency, self.retries = concurrency, retries
        self.backoff_s, self.backoff_max_s = backoff_s, backoff_max_s
        self.enable_thinking = enable_thinking
        # the served model's tokenizer when known locally (``api.tokenizer``): the runners record its ids and
        # RIR counts auxiliary prompt budgets with it; the requests still send text
        self.tokenizer = wrap_tokenizer(tokenizer) if tokenizer is not None else None
        self.sleep = time.sleep  # tests replace it
        self.protocol_of: dict[int, str] = {}  # trial → protocol, for the batch in progress
        self.usage: dict[tuple[str, int], Usage] = {}  # (protocol, trial) → usage (trial ids restart per run)
        self.calls_seen: dict[tuple[str, int], int] = {}
        self.failures: list[dict[str, Any]] = []
        self.errors: dict[str, int] = {}

    @classmethod
    def from_config(cls, cfg: Any, model: str | None = None, client: Any = None) -> ApiPolicy:
        api = cfg.api
        default, kinds = settings_from_config(api)
        key = os.environ.get(api.api_key_env, "") if api.api_key_env else ""
        tokenizer = None
        if api.tokenizer:
            from retrojax.model.tokenizer import load_tokenizer

            try:
                tokenizer = load_tokenizer(api.tokenizer)
            except (OSError, ValueError) as e:
                raise ValueError(f"api.tokenizer: {e}") from e
        return cls(model or api.model or "", base_url=api.base_url, api_key=key or "EMPTY", default=default,
                   kinds=kinds, concurrency=api.concurrency, timeout_s=api.timeout_s, retries=api.retries,
                   backoff_s=api.backoff_s, backoff_max_s=api.backoff_max_s, client=client,
                   enable_thinking=api.enable_thinking, tokenizer=tokenizer)

    # --- the policy interface --------------------------------------------------------------------------
    def begin(self, specs: Sequence[TrialSpec], slots: Sequence[int], env: Any) -> None:
        super().begin(specs, slots, env)
        for s in specs:
            self.protocol_of[s.trial] = s.protocol

    def settings(self, role: str) -> CallSettings:
        """The settings of a call kind (the section default for kinds without their own)."""
        return self.kinds.get(role, self.default)

    def generate(self, requests: Sequence[Request]) -> list[Generation]:
        if not requests:
            return []
        workers = min(self.concurrency, len(requests))
        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="api-call") as pool:
            outs = list(pool.map(self._answer, requests))
        gens = []
        for req, (gen, usage, failure) in zip(requests, outs, strict=True):
            key = (self.protocol_of.get(req.trial, "?"), req.trial)
            index = self.calls_seen.get(key, 0)
            self.calls_seen[key] = index + 1
            self.usage.setdefault(key, Usage()).add(usage)
            if failure is not None:
                self.failures.append({"protocol": key[0], "trial": req.trial, "call_index": index,
                                      "role": req.role, "reason": failure.reason,
                                      "attempts": usage.retries + 1})
            gen.usage = (usage.prompt_tokens, usage.completion_tokens)
            gen.error = failure.reason if failure is not None and not failure.context else ""
            gens.append(gen)
        return gens

    # --- one request -----------------------------------------------------------------------------------
    def _answer(self, req: Request) -> tuple[Generation, Usage, ApiCallFailed | None]:
        """One request with retries; never raises (a failure is an empty reply plus its reason)."""
        usage = Usage(requests=1)
        settings = self.settings(req.role)
        messages = [dict(m) for m in req.messages]
        if not messages:
            failure = ApiCallFailed("the request carries no chat messages (prompts were not rendered)",
                                    retryable=False)
            usage.failed = 1
            return Generation("", finish_reason="stop"), usage, failure
        max_tokens = settings.max_tokens if settings.max_tokens is not None else req.max_new_tokens
        attempt = 0
        while True:
            try:
                text, finish, prompt_tokens, completion_tokens = self._call(messages, settings, max_tokens)
                usage.prompt_tokens += prompt_tokens
                usage.completion_tokens += completion_tokens
                return Generation(text, finish_reason=finish), usage, None
            except ApiCallFailed as e:
                failure = e
            self.errors[failure.reason.split(":")[0]] = self.errors.get(failure.reason.split(":")[0], 0) + 1
            if failure.context:
                usage.failed = 1
                return Generation("", finish_reason="context"), usage, failure
            if not failure.retryable or attempt >= self.retries:
                usage.failed = 1
                if failure.retryable:
                    failure.reason = f"{failure.reason} (after {attempt + 1} attempts)"
                return Generation("", finish_reason="stop"), usage, failure
            delay = min(self.backoff_max_s, self.backoff_s * 2**attempt)
            if failure.retry_after is not None:
                delay = min(self.backoff_max_s, max(delay, failure.retry_after))
            self.sleep(delay)
            attempt += 1
            usage.retries += 1

    def _call(self, messages: list[dict[str, str]], settings: CallSettings,
              max_tokens: int) -> tuple[str, str, int, int]:
        """One HTTP request → (text, finish_reason, prompt tokens, completion tokens), or ApiCallFailed."""
        import openai

        kwargs: dict[str, Any] = {"model": self.model, "messages": messages, "max_tokens": max_tokens,
                                  "temperature": settings.temperature, "top_p": settings.top_p}
        if settings.stop:
            kwargs["stop"] = list(settings.stop)
        if self.enable_thinking is not None:  # Qwen3's switch on vLLM / SGLang / retrojax serve
            kwargs["extra_body"] = {"chat_template_kwargs": {"enable_thinking": self.enable_thinking}}
        try:
            reply = self.client.chat.completions.create(**kwargs)
        except openai.APIStatusError as e:
            body = e.body if isinstance(e.body, dict) else {}
            error = body.get("error") if isinstance(body.get("error"), dict) else body
            code = error.get("code") if isinstance(error, dict) else None
            message = (error.get("message") if isinstance(error, dict) else None) or str(e)
            retry_after = _retry_after(e.response)
            raise ApiCallFailed(f"HTTP {e.status_code}: {message}",
                                retryable=e.status_code in _RETRYABLE_STATUS,
                                context=code == "context_length_exceeded", retry_after=retry_after) from e
        except openai.APITimeoutError as e:
            raise ApiCallFailed(f"timeout: no reply within the client timeout ({e})", retryable=True) from e
        except openai.APIConnectionError as e:
            raise ApiCallFailed(f"connection: {e} ({type(e.__cause__).__name__})", retryable=True) from e
        except openai.APIResponseValidationError as e:
            raise ApiCallFailed(f"malformed reply: {e}", retryable=True) from e
        except (ValueError, TypeError) as e:  # a body that is not JSON at all
            raise ApiCallFailed(f"malformed reply: {type(e).__name__}: {e}", retryable=True) from e
        return _read_reply(reply, settings.stop)

    # --- results ---------------------------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        """Usage and failures: totals, per protocol (per-trial means) and per trial."""
        total = Usage()
        by_protocol: dict[str, Usage] = {}
        trials: dict[str, int] = {}
        for (name, _), u in self.usage.items():
            total.add(u)
            by_protocol.setdefault(name, Usage()).add(u)
            trials[name] = trials.get(name, 0) + 1
        per_protocol = {
            name: {**dataclasses.asdict(u), "trials": trials[name],
                   "prompt_tokens_per_trial": u.prompt_tokens / trials[name],
                   "completion_tokens_per_trial": u.completion_tokens / trials[name]}
            for name, u in sorted(by_protocol.items())}
        return {"model": self.model, "base_url": self.base_url, "usage": dataclasses.asdict(total),
                "protocols": per_protocol,
                "trials": {f"{p}/{t}": dataclasses.asdict(u) for (p, t), u in sorted(self.usage.items())},
                "errors": dict(sorted(self.errors.items())), "failures": list(self.failures)}


def _retry_after(response: Any) -> float | None:
    try:
        value = response.headers.get("retry-after")
        return max(0.0, float(value)) if value is not None else None
    except (AttributeError, TypeError, ValueError):
        return None


def _read_reply(reply: Any, stops: Sequence[str]) -> tuple[str, str, int, int]:
    """Text, finish reason and usage of a completion; ApiCallFailed when it lacks them (malformed)."""
    choices = getattr(reply, "choices", None)
    if not isinstance(choices, list) or not choices:
        raise ApiCallFailed(f"malformed reply: no choices in {str(reply)[:120]!r}", retryable=True)
    choice = choices[0]
    message = getattr(choice, "message", None)
    text = getattr(message, "content", None)
    if not isinstance(text, str):
        raise ApiCallFailed("malformed reply: the first choice has no message content", retryable=True)
    finish = getattr(choice, "finish_reason", None)
    stop_reason = (getattr(choice, "model_extra", None) or {}).get("stop_reason")
    if finish == "stop" or finish is None:
        text = restore_stop(text, stops, stop_reason)
    usage = getattr(reply, "usage", None)
    prompt = getattr(usage, "prompt_tokens", 0) if usage is not None else 0
    completion = getattr(usage, "completion_tokens", 0) if usage is not None else 0
    return text, "length" if finish == "length" else "stop", int(prompt or 0), int(completion or 0)
