"""The queue worker client: agent tasks from Redis, every model call through the gateway."""
