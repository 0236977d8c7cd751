"""The multi-round QA workload of vLLM's production stack, scaled to a small machine.

U users each hold a conversation of R rounds.  Every prompt starts with one system prompt
shared by all users and the user's own context (the production stack's "user history
prompt": an earlier chat, a document); round r of a user asks these, then every earlier
round's question and answer, then its own question.  Questions are short, as the production
stack's are (one sentence, "Here's question #r: ..."), so each round adds little to a long
history, and a KV store helps exactly when the engine's own KV space cannot keep every
user's history between their rounds.

The answers are fixed by the workload, not taken from the server: every system under test
then gets the very same requests, token for token (a benchmark's model has dummy weights,
whose answers mean nothing).  Requests carry token ids, so no tokenizer is needed.

Pure: building prompts and the order of requests does no I/O.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator

import attrs
from ucm.core.settings import int_in_range, positive_number, setting

#: token ids of the words a workload draws from (ids below 10 are left to special tokens)
FIRST_TOKEN, LAST_TOKEN = 10, 30_000


@attrs.frozen
class MultiRoundWorkload:
    """Users, rounds and the sizes of each piece of a conversation, in tokens."""

    users: int = setting(
        "Conversations held at once.", default=12, validator=int_in_range(1, 10_000)
    )
    rounds: int = setting("Rounds per conversation.", default=5, validator=int_in_range(1, 1000))
    system_tokens: int = setting(
        "The system prompt every conversation starts with.",
        default=1000,
        validator=int_in_range(0, 1 << 20),
    )
    user_tokens: int = setting(
        "The user's own context after the system prompt (the production stack's user "
        "history prompt).",
        default=2000,
        validator=int_in_range(0, 1 << 20),
    )
    question_tokens: int = setting(
        "Each round's question.", default=20, validator=int_in_range(1, 1 << 20)
    )
    answer_tokens: int = setting(
        "Each round's answer (the tokens asked of the server).",
        default=32,
        validator=int_in_range(1, 1 << 16),
    )
    request_rate: float = setting(
        "Requests started per second at most, over all users.",
        default=2.0,
        validator=positive_number,
    )
    seed: int = setting("Seed of every token drawn.", default=0, validator=int_in_range(0, 1 << 62))

    def _tokens(self, *what: int, n: int) -> list[int]:
        rng = random.Random(_mix(self.seed, *what))
        return [rng.randrange(FIRST_TOKEN, LAST_TOKEN) for _ in range(n)]

    def system_prompt(self) -> list[int]:
        return self._tokens(0, n=self.system_tokens)

    def user_context(self, user: int) -> list[int]:
        return self._tokens(3, user, n=self.user_tokens)

    def question(self, user: int, round_: int) -> list[int]:
        return self._tokens(1, user, round_, n=self.question_tokens)

    def answer(self, user: int, round_: int) -> list[int]:
        return self._tokens(2, user, round_, n=self.answer_tokens)

    def prompt(self, user: int, round_: int) -> list[int]:
        """Round ``round_`` (from 0) of ``user``: the system prompt, the user's context, the
        earlier rounds' questions and answers, this round's question."""
        tokens = self.system_prompt() + self.user_context(user)
        for earlier in range(round_):
            tokens += self.question(user, earlier) + self.answer(user, earlier)
        return tokens + self.question(user, round_)

    def prompt_tokens(self, round_: int) -> int:
        """The length of any user's prompt in round ``round_``."""
        return (
            self.system_tokens
            + self.user_tokens
            + round_ * (self.question_tokens + self.answer_tokens)
            + self.question_tokens
        )

    def history_tokens(self) -> int:
        """Tokens of every user's whole conversation (the last round's prompt and answer),
        the system prompt counted once: what a cache would hold to miss nothing."""
        per_user = self.prompt_tokens(self.rounds - 1) + self.answer_tokens - self.system_tokens
        return self.system_tokens + self.users * per_user

    def longest_request_tokens(self) -> int:
        """The last round's prompt and answer: the model length the server must allow."""
        return self.prompt_tokens(self.rounds - 1) + self.answer_tokens

    def kv_blocks(self, share: float, block_size: int) -> int:
        """Engine KV blocks holding ``share`` of ``history_tokens``, but never fewer than one
        request needs (its longest prompt and answer, and the block vLLM keeps aside)."""
        if not 0 < share <= 1:
            raise ValueError(f"share must be in (0, 1], got {share!r}")
        needed = math.ceil(self.longest_request_tokens() / block_size) + 1
        return max(math.ceil(share * self.history_tokens() / block_size), needed)

    def order(self) -> Iterator[tuple[int, int]]:
        """(user, round) in the order a client would issue them with no waiting: round by
        round, users in turn.  A user's next round waits for its answer (the driver's
        part), so within a round users interleave and their histories take turns in the
        engine's KV space."""
        for round_ in range(self.rounds):
            for user in range(self.users):
                yield user, round_


def _mix(*parts: int) -> int:
    """One integer seed from several (``random.Random`` takes no tuple)."""
    value = 0x9E3779B97F4A7C15
    for part in parts:
        value = (value * 1_000_003 ^ (part & ((1 << 64) - 1))) & ((1 << 64) - 1)
    return value
