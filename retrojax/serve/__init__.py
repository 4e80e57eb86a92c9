"""An OpenAI-compatible chat server over the KV-cache sampler (``retrojax serve``).

- :mod:`retrojax.serve.protocol`: request validation and the OpenAI response/error shapes;
- :mod:`retrojax.serve.template`: messages → prompt ids with the model's own chat template;
- :mod:`retrojax.serve.engine`: continuous batching (requests join the running batch, leave when done);
- :mod:`retrojax.serve.app`: the FastAPI app, the uvicorn runner and the command's handler.
"""
