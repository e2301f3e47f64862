"""Policies applied to every request: admission, routing, retries, breakers and accounting."""
