"""The LangGraph workflow: planner, coder, verifier and profiler agents."""
