"""Cluster description, communication / compute / memory costs and the reshard planner
(installed as ``autopar.cost_model``)."""
