"""The trial loop: environments interface, prompts, parser, Algorithm 1 state machine, runner, policies."""
