"""The engine: sharded embedding tables, their planner, plans, mesh, collectives and the communication model."""
