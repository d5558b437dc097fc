# One import name (docs/packaging.md): imported as `tasks` from the repository's root, this
# folder would be a second copy of every module (SQLAlchemy: "Table already defined").
if __name__ != "agent_radar.tasks":
    raise ImportError(f"import agent_radar.tasks, not {__name__} (docs/packaging.md)")
