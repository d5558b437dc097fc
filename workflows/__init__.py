# One import name (docs/packaging.md): imported as `workflows` from the repository's root, this
# folder would be a second copy of every module (SQLAlchemy: "Table already defined").
if __name__ != "agent_radar.workflows":
    raise ImportError(f"import agent_radar.workflows, not {__name__} (docs/packaging.md)")
