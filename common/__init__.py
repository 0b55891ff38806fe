"""Code the coordinator (`daemon/`) and the agent (`agent/`) share that is not a cross-process contract:
the YAML config loader. Contracts between processes are in `proto/`, which stays free of pydantic and YAML."""
