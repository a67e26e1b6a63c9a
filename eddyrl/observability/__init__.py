"""Observability: metric sinks (JSON lines, TensorBoard, W&B), the trace of every worker's
activity in a real run, and `eddy report`'s plots. Nothing here is imported by the RL logic:
launch.py wires it around the runtime and the controller's `log` callback."""
