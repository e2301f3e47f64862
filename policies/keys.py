"""Redis key names for shared state, in one place.

Every key of one gateway deployment carries the same hash tag, ``{prefix}``: one request's
admission and settlement touch the tenant's keys and the chosen provider's keys together in one
script, and a script's keys must share a Redis Cluster slot. Per-tenant tags would split a
request across slots; the state is small, so one slot is the sound choice.

Names and ids may contain ``:``, the separator of key parts, so each part is escaped (``:`` as
``%3A``; ``%`` is not allowed in names or ids): tenant ``a`` with task ``x:task:y`` and tenant
``a:task:x`` with task ``y`` would otherwise share a key.
"""

from __future__ import annotations

from dataclasses import dataclass


def _part(text: str) -> str:
    return text.replace(":", "%3A") if ":" in text else text


@dataclass(frozen=True, slots=True)
class Keys:
    """Key names under one prefix."""

    prefix: str = "mg"

    @property
    def tag(self) -> str:
        return "{" + self.prefix + "}"

    def tenant(self, tenant: str, what: str) -> str:
        """A tenant's bucket or slot set: ``what`` is ``rpm``, ``tpm`` or ``conc``."""
        return f"{{{self.prefix}}}:t:{_part(tenant)}:{what}"

    def provider(self, provider: str, what: str) -> str:
        """A provider's fleet-wide bucket or slot set."""
        return f"{{{self.prefix}}}:p:{_part(provider)}:{what}"

    def usage(self, tenant: str, period: str) -> str:
        """A tenant's usage in one budget period (``2026-11-29``, ``2026-11`` or ``total``)."""
        return f"{{{self.prefix}}}:t:{_part(tenant)}:usage:{period}"

    def breaker(self, target: str) -> str:
        """A target's (``provider/model``) circuit breaker."""
        return f"{{{self.prefix}}}:b:{_part(target)}"

    def task(self, tenant: str, task_id: str) -> str:
        return f"{{{self.prefix}}}:t:{_part(tenant)}:task:{_part(task_id)}"
