"""An example worker module: summarise text through the gateway.

Run it with ``modelgate worker client.example:handlers --gateway-url ... --gateway-key ...`` and
enqueue ``await queue.enqueue("summarise", {"text": "..."})``. The model is ``mock`` (dev mode's
built-in model) unless ``MODELGATE_EXAMPLE_MODEL`` names another. Both steps are checkpointed: a
retry after the model call does not call the model again, and ``returns=ChatCompletion`` gives the
replayed step the SDK object back instead of a plain dict.
"""

from __future__ import annotations

import os
from typing import Any

from openai.types.chat import ChatCompletion

from client.context import TaskContext
from client.errors import Fatal

MAX_CHARS = 20_000


def _text(payload: Any) -> str:
    text = payload.get("text") if isinstance(payload, dict) else None
    if not isinstance(text, str) or not text.strip():
        raise Fatal('payload must be {"text": "<non-empty text>"}')
    return text[:MAX_CHARS]


async def summarise(ctx: TaskContext, payload: Any) -> dict[str, Any]:
    text = await ctx.step("prepare", lambda: _text(payload))
    reply = await ctx.step(
        "summarise",
        lambda: ctx.model.chat.completions.create(
            model=os.environ.get("MODELGATE_EXAMPLE_MODEL", "mock"),
            messages=[
                {"role": "system", "content": "Summarise the user's text in at most three sentences."},
                {"role": "user", "content": text},
            ],
        ),
        returns=ChatCompletion,
    )
    return {"summary": reply.choices[0].message.content, "model": reply.model}


handlers = {"summarise": summarise}
