"""The task names that belong to no operation kind (each kind's are in its module,
workflows/kinds/; RESULT_TASKS, the results a producer may read, are there too) and the
publish port: the names producers publish (public, README.md: code
outside the repository uses them), the ones the product publishes to itself, and the port
its rules and steps publish through (adapters/publisher.py implements it)."""

from collections.abc import Callable

# The publish port: publish(task name, keyword arguments) -> whether it went out. A failed
# publish loses nothing: the committed rows are the outbox, and the sweeper publishes again.
Publish = Callable[[str, dict], bool]
# At most this many operations share one dispatch message (`operation_ids`).
COALESCE_MAX_ITEMS = 16

# Public: what producers in any language publish.
REPORT_ACTIVITY_TASK = "agent_radar.report_activity"
# Reads an operation of any kind by id: with a result backend, a producer in any language
# learns an outcome through Celery's own results (README.md, producers).
GET_OPERATION_TASK = "agent_radar.get_operation"
# What a user's or an operator's own hand does, for producers that are not Python
# (docs/producers.md): resume a session, stop one, retry a failed operation.
ENSURE_SESSION_TASK = "agent_radar.ensure_session"
RETRY_OPERATION_TASK = "agent_radar.retry_operation"
# Internal: the product's own steps, published after a commit (the rows are the outbox).
# The prompt kind's dispatch is named here, not in workflows/kinds/prompt.py: the publisher,
# below the kinds, must know it (SHOWN_WHEN_EFFECTIVE).
PROMPT_TASK = "agent_radar.prompt.dispatch"
RESTORE_TASK = "agent_radar.session.restore"
SWEEP_TASK = "agent_radar.sweep"
PRUNE_TASK = "agent_radar.prune"
# Tasks that mostly do nothing (a report that a session is busy, a prompt dispatch that finds
# none queued): Flower shows them only once they did something (tasks/strict.py), so their
# publishers send no `task-sent` event, which would leave a row pending for ever.
SHOWN_WHEN_EFFECTIVE = frozenset({REPORT_ACTIVITY_TASK, PROMPT_TASK})
# Registered only in the benchmark's own workers.
BASELINE_TASK = "agent_radar.bench.noop"
