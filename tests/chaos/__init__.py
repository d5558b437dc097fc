"""Losing a server node under load: a PostgreSQL primary (its replica promoted) and a RabbitMQ
cluster node. The suite runs each in a short form; `make chaos` runs them at scale
(AGENT_RADAR_CHAOS=full)."""
