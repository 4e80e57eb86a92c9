"""The terminal loop shared by ``retrojax play <game>``: checkpoints, rewinds, quitting.

A :class:`PlaySession` keeps the active path as a trail of states ``C_0 … C_k`` with the path score ``S``
at each checkpoint. :meth:`PlaySession.run` reads one command per line; it handles the commands every game
shares (``quit``, ``rewind to C_j``, end of input) and hands the rest to the game's ``handle`` callback,
which calls :meth:`PlaySession.advance` for a turn that changed the world. Bad input only ever gets a message.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, TextIO

from envs.trail import TrailOverflowError, trail_init, trail_push_checked, trail_rewind_checked

REWIND = re.compile(r"^rewind\s+(?:to\s+)?(?:c_?)?(\d+)$")
QUIT = ("quit", "exit", "q")


class PlaySession:
    """One person's game: the current state, its trail of checkpoints and the path scores."""

    def __init__(self, state: Any, capacity: int, show: Callable[[Any, list[float], TextIO], None],
                 out: TextIO):
        self.state = state
        self.trail = trail_init(state, capacity)
        self.scores = [0.0]
        self.show, self.out = show, out

    def say(self, text: str) -> None:
        print(text, file=self.out)

    def rewind(self, j: int) -> None:
        """Restore ``C_j`` (state and score) or explain why not."""
        try:
            self.trail, self.state = trail_rewind_checked(self.trail, j)
        except IndexError as err:
            self.say(f"cannot rewind: {err}")
            return
        del self.scores[j + 1:]
        self.say(f"rewound to C_{j}")
        self.show(self.state, self.scores, self.out)

    def advance(self, new_state: Any, reward: float) -> bool:
        """Make ``new_state`` the next checkpoint; False (with a message) when the trail is full."""
        try:
            self.trail = trail_push_checked(self.trail, new_state)
        except TrailOverflowError as err:
            self.say(f"cannot add a checkpoint: {err}; rewind first")
            return False
        self.state = new_state
        self.scores.append(self.scores[-1] + float(reward))
        return True

    def run(self, stdin: TextIO, handle: Callable[[str, str], None]) -> int:
        """Read commands until ``quit`` or end of input (returns 0); ``handle(cmd, line)`` plays the rest."""
        self.show(self.state, self.scores, self.out)
        while True:
            print("> ", end="", file=self.out, flush=True)
            line = stdin.readline()
            if not line:
                self.say("\nbye")
                return 0
            cmd = line.strip().lower()
            if not cmd:
                continue
            if cmd in QUIT:
                self.say("bye")
                return 0
            m = REWIND.match(cmd)
            if m:
                self.rewind(int(m.group(1)))
                continue
            handle(cmd, line.strip())
