"""Scheduling policies, clock-free: Libra's bucket scheduler, the cost model, the elastic pool
protocol and ReFlow's adaptive scheduler. The runtime and the simulator drive the same objects."""
