"""The performance model: predicted latency of any family and layout on a machine, fitted to published figures
(``model``: the schedule replayed; ``hardware``: devices and links; ``published``: the points; ``calibration``: the
fit and its error; ``planner``: every valid layout of a world, ranked)."""
