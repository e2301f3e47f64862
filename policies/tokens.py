"""Token estimates, used where the real count is not known yet (admission) or never arrives.

The estimate is deliberately simple and slightly generous: four characters of text per token,
plus four tokens of framing per message and three for the reply's priming. Structured content
(parts, images) counts by the length of its JSON. It never calls a tokenizer: admission must be
cheap, and the reservation is settled to the upstream's real usage afterwards.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from providers.base import Message

CHARS_PER_TOKEN = 4
TOKENS_PER_MESSAGE = 4
REPLY_PRIMING_TOKENS = 3


def estimate_text_tokens(text: str) -> int:
    """Tokens in a piece of text, rounded up."""
    return -(-len(text) // CHARS_PER_TOKEN)


def estimate_prompt_tokens(messages: list[Message]) -> int:
    """Prompt tokens of a chat request."""
    total = REPLY_PRIMING_TOKENS
    for message in messages:
        total += TOKENS_PER_MESSAGE
        content = message.content
        if isinstance(content, str):
            total += estimate_text_tokens(content)
        elif content is not None:
            total += sum(-(-len(part) // CHARS_PER_TOKEN) for part in content)
    return total
