"""Pure-stdlib pieces shared by the coordinator, the agent and the worker runtime."""
