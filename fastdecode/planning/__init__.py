"""The paper's performance model (planner) and the discrete-event simulator."""
