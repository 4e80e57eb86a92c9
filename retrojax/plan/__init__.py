"""Memory plans (``retrojax plan``): what the update, the log-prob pass and the sampler hold per device,
from compile-only analyses, and the ``learn.remat: auto`` decision."""

from retrojax.plan.memory import GB, plan_memory, plan_sampler, plan_update, shapes_from_config
from retrojax.plan.runtime import device_memory_bytes, log_trainer_plan, resolve_remat

__all__ = ["GB", "device_memory_bytes", "log_trainer_plan", "plan_memory", "plan_sampler", "plan_update",
           "resolve_remat", "shapes_from_config"]
