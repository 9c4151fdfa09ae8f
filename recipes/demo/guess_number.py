"""An environment for online RL (grpo.environment, recipes/demo/tiny_grpo_env_cpu.yaml): a guessing game
that answers back. One object is made per completion; `reset(row)` gives the first user message, then
every assistant turn goes to `step(text)`, which returns (observation, reward, done): the observation
is the next user turn, the rewards add up to the reward `environment`.

The secret number is the row's answer (prompts.jsonl's `#### 52`); the model guesses, the game says
higher or lower, and the episode ends at the right number or after grpo.max_tool_calls turns.

>>> game = GuessNumber()
>>> game.reset({"answer": "#### 52"})
'Guess my number: a whole number from 0 to 100. Answer with the number only.'
>>> game.step("50"), game.step("I say 52.")
(('Higher.', 0.1, False), ('Right!', 1.0, True))
>>> GuessNumber().step("no idea")
('Answer with a number.', 0.0, False)
"""

from __future__ import annotations

import re


class GuessNumber:
    """The guessing game: a closer guess earns a little (0.1 for being within 10), the number 1."""

    def reset(self, row: dict) -> str:
        self.secret = int(str(row["answer"]).split()[-1])
        return "Guess my number: a whole number from 0 to 100. Answer with the number only."

    def step(self, text: str) -> tuple[str, float, bool]:
        numbers = re.findall(r"-?\d+", text)
        if not numbers:
            return "Answer with a number.", 0.0, False
        guess = int(numbers[-1])
        if guess == self.secret:
            return "Right!", 1.0, True
        close = 0.1 if abs(guess - self.secret) <= 10 else 0.0
        return ("Higher." if guess < self.secret else "Lower."), close, False
